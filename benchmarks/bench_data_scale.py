"""Encoding a 1M-row chat JSONL: Twinkle's streamed encoder against `datasets` with two processes.

A deterministic 1M-row chat JSONL (single- and multi-turn, some with a system prompt) is written to
a temp dir. Each side runs in a fresh process, so its peak RSS is its own:
- twinkle: `encode_to_arrow(iter_rows(jsonl), template, out, num_proc=2)` — rows read lazily,
  chunks encoded in 2 worker processes, record batches written to one Arrow file as they come.
- hf: `datasets.Dataset.from_json(jsonl)` then `.map(batched=True, num_proc=2)` calling the same
  Template's `batch_encode`: the same work and output (checked on a sample of rows), the usual
  `datasets` pipeline around it.
- threads (indication, on the first tenth of the rows): twinkle with one process and the tokenizer's
  own batch parallelism (TOKENIZERS_PARALLELISM=true), to show which parallelism pays here.
The two main sides run once each by default (`--rounds 2` alternates them ABBA; medians are compared):
at 1M rows one side takes 7-15 minutes, long enough that run-to-run noise is small.

Prints a final JSON line: `speedup` (rows/s twinkle / hf), rows/s of each, and peak RSS (MB) of each
side's main process and of its largest worker process (most of it is torch + transformers, imported
before the first row: `rss_after_imports_mb`). Most of the time is Jinja rendering and tokenizing
inside `Template.batch_encode`, the same on both sides; at ~2,500 rows/s on two cores the two
1M-row runs take ~15 minutes (twice that with `--rounds 2`).
Run: .venv/bin/python benchmarks/bench_data_scale.py [--rows 1000000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NUM_PROC = 2
TOPICS = ("rivers", "prime numbers", "lanterns", "the moon", "bread", "chess", "rain", "bridges", "glass", "owls")
WORDS = (
    "light quiet stone over under seven bright slowly because water every small old new far near "
    "always never maybe first last deep open"
).split()


def write_jsonl(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def sentence(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."

    with path.open("w") as f:
        for i in range(rows):
            messages = [{"role": "system", "content": "You are a helpful assistant."}] if i % 4 == 0 else []
            for _ in range(1 + (i % 5 == 0)):
                messages.append({"role": "user", "content": f"Tell me about {rng.choice(TOPICS)}. {sentence(2, 12)}"})
                messages.append(
                    {"role": "assistant", "content": " ".join(sentence(4, 16) for _ in range(rng.randint(1, 4)))}
                )
            f.write(json.dumps({"id": i, "messages": messages}) + "\n")


def rss_now_mb() -> float:
    return round(int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def peak_mb() -> dict:
    return {
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "worker_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
    }


def side_twinkle(jsonl: Path, out: Path, rows: int, num_proc: int) -> dict:  # the first `rows` rows
    from twinkle.dataset import encode_to_arrow
    from twinkle.dataset.readers import iter_rows
    from twinkle.hub import TEST_MODEL
    from twinkle.template import Template

    template = Template(model_id=TEST_MODEL)
    before = rss_now_mb()
    start = time.perf_counter()
    source = (row for row, _ in zip(iter_rows(jsonl), range(rows)))
    encoded, report = encode_to_arrow(
        source, template, out / "twinkle.arrow", num_proc=num_proc, chunk_rows=1000, total=rows, desc="twinkle encode"
    )
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "rows": report.rows_written,
        "max_rows_held": report.max_rows_held,
        "rss_before_mb": before,
        "sample": sample(encoded),
        **peak_mb(),
    }


def side_hf(jsonl: Path, out: Path) -> dict:
    import datasets

    from twinkle.hub import TEST_MODEL
    from twinkle.template import Template

    template = Template(model_id=TEST_MODEL)
    before = rss_now_mb()

    def encode(batch):
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
        encoded = template.batch_encode(rows)
        return {"input_ids": [e["input_ids"] for e in encoded], "labels": [e["labels"] for e in encoded]}

    start = time.perf_counter()
    data = datasets.Dataset.from_json(str(jsonl), cache_dir=str(out / "hf-cache"))
    encoded = data.map(encode, batched=True, batch_size=1000, num_proc=NUM_PROC, load_from_cache_file=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "rows": len(encoded), "rss_before_mb": before, "sample": sample(encoded), **peak_mb()}


def sample(encoded) -> list:
    step = max(1, len(encoded) // 50)
    return [[encoded[i]["id"], encoded[i]["input_ids"], encoded[i]["labels"]] for i in range(0, len(encoded), step)]


def run_side(name: str, jsonl: Path, out: Path, rows: int | None = None, env: dict | None = None) -> dict:
    cmd = [sys.executable, __file__, "--side", name, "--jsonl", str(jsonl), "--out", str(out)]
    if rows is not None:
        cmd += ["--rows", str(rows)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(f"side {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--side", choices=("twinkle", "hf", "threads"))
    parser.add_argument("--jsonl", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.side == "twinkle":
        print(json.dumps(side_twinkle(args.jsonl, args.out, args.rows, NUM_PROC)))
        return
    if args.side == "threads":
        print(json.dumps(side_twinkle(args.jsonl, args.out, args.rows, 1)))
        return
    if args.side == "hf":
        print(json.dumps(side_hf(args.jsonl, args.out)))
        return

    with tempfile.TemporaryDirectory(prefix="bench-data-scale-") as tmp:
        tmp = Path(tmp)
        jsonl = tmp / "chat.jsonl"
        t0 = time.perf_counter()
        write_jsonl(jsonl, args.rows)
        print(
            f"wrote {args.rows} rows ({jsonl.stat().st_size / 2**20:.0f} MB) in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        runs: dict[str, list[dict]] = {"twinkle": [], "hf": []}
        for r in range(args.rounds):
            for name in ("hf", "twinkle") if r % 2 == 0 else ("twinkle", "hf"):
                out = tmp / f"{name}-{r}"
                out.mkdir()
                result = run_side(name, jsonl, out, rows=args.rows, env={"TOKENIZERS_PARALLELISM": "false"})
                runs[name].append(result)
                print(
                    f"round {r} {name}: {result['rows'] / result['seconds']:.0f} rows/s, "
                    f"peak {result['peak_rss_mb']} MB (+ worker {result['worker_peak_rss_mb']} MB)",
                    flush=True,
                )
        out = tmp / "threads"
        out.mkdir()
        threads = run_side("threads", jsonl, out, rows=args.rows // 10, env={"TOKENIZERS_PARALLELISM": "true"})
    tw, hf = runs["twinkle"][-1], runs["hf"][-1]
    assert tw["rows"] == hf["rows"] == args.rows, (tw["rows"], hf["rows"])
    assert tw["sample"] == hf["sample"], "the two sides encoded differently"
    tw_rps = statistics.median(r["rows"] / r["seconds"] for r in runs["twinkle"])
    hf_rps = statistics.median(r["rows"] / r["seconds"] for r in runs["hf"])
    print(
        json.dumps(
            {
                "benchmark": "bench_data_scale",
                "rows": args.rows,
                "num_proc": NUM_PROC,
                "speedup": round(tw_rps / hf_rps, 3),
                "twinkle_rows_per_s": round(tw_rps, 1),
                "hf_map_num_proc_rows_per_s": round(hf_rps, 1),
                "twinkle_peak_rss_mb": max(r["peak_rss_mb"] for r in runs["twinkle"]),
                "twinkle_worker_peak_rss_mb": max(r["worker_peak_rss_mb"] for r in runs["twinkle"]),
                "hf_peak_rss_mb": max(r["peak_rss_mb"] for r in runs["hf"]),
                "hf_worker_peak_rss_mb": max(r["worker_peak_rss_mb"] for r in runs["hf"]),
                "twinkle_max_rows_held": tw["max_rows_held"],
                "rss_after_imports_mb": tw["rss_before_mb"],  # torch + transformers + tokenizer, before any row
                "tokenizer_threads_1_proc_rows_per_s": round(threads["rows"] / threads["seconds"], 1),
                "tokenizer_threads_rows": threads["rows"],
                "rounds": args.rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
