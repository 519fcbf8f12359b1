"""The conformance matrix: one row per engine x mode, compared with the reference run."""

from __future__ import annotations

import conformance_sequence as sequence

# fp32 everywhere: what differs between pairs is summation order (data-parallel all-reduce, the
# fused LoRA layer, a sharded norm), ~1e-7 per op; Adam divides by sqrt(v) and 8 steps compound it.
TOLERANCE = 1e-4
COLUMNS = ("losses", "grad_norms", "lrs", "logprobs", "metric_loss", "resumed", "weights")
MATRIX: dict[str, dict] = {}


def local_mode(make, init_folder, tmp_path):
    return sequence.Mode(
        make=make, init_path=init_folder, checkpoint=str(tmp_path / "ckpt"), sample=sequence.sample_locally
    )


def _max_diff(got, want) -> float:
    if isinstance(want, dict):
        if set(got) != set(want):
            return float("inf")
        return max((_max_diff(got[k], want[k]) for k in want), default=0.0)
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return float("inf")
        return max((_max_diff(g, w) for g, w in zip(got, want)), default=0.0)
    if want is None or got is None:
        return 0.0 if got is want else float("inf")
    return abs(float(got) - float(want))


def compare(pair: str, record: dict, reference: dict, skip=()) -> None:
    """Record the pair's row (max |difference| per column; None = not exposed by that API) and
    assert it within TOLERANCE, greedy samples identical."""
    row = {c: (None if c in skip else _max_diff(record[c], reference[c])) for c in COLUMNS}
    row["samples"] = None if "samples" in skip else record["samples"] == reference["samples"]
    MATRIX[pair] = row
    worst = {c: v for c, v in row.items() if c != "samples" and v is not None and v > TOLERANCE}
    assert not worst, f"{pair} differs from the reference beyond {TOLERANCE}: {worst}"
    assert row["samples"] in (True, None), (
        f"{pair}: greedy samples differ: {record['samples']} vs {reference['samples']}"
    )


def refuse(pair: str, message: str) -> None:
    MATRIX[pair] = {"refused": message}


def markdown() -> str:
    head = ["engine · mode", *COLUMNS, "samples"]
    lines = [
        f"Max |difference| from local TransformersModel (fp32, twinkle://qwen3-tiny, tolerance {TOLERANCE:g}; "
        "samples: identical greedy tokens; — : not exposed by that API). DPO rows run a DPO sequence "
        "(conformance_dpo.py) and are compared with local TransformersModel on that sequence.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for pair, row in MATRIX.items():
        if "refused" in row:
            lines.append(f"| {pair} | refused: {row['refused']} |" + " |" * (len(head) - 2))
            continue
        cells = ["—" if row[c] is None else f"{row[c]:.1e}" for c in COLUMNS]
        cells.append("—" if row["samples"] is None else ("same" if row["samples"] else "DIFFER"))
        lines.append("| " + " | ".join([pair, *cells]) + " |")
    return "\n".join(lines) + "\n"
