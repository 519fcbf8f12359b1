"""forward_backward's loss-input keywords (twinkle-kit's names) as per-row fields of the batch.

    model.forward_backward(inputs=rows, old_logps=..., advantages=...)      # GRPO
    model.forward_backward(inputs=pairs, ref_outputs=ref_model.forward_only(inputs=pairs))   # DPO

- `advantages`: one number per row (or one list per row, per token of its completion);
- `old_logps`: one list per row: the sampler's log-probs of the row's completion tokens, in order;
- `ref_outputs`: what `forward_only` returned for the same rows (its `logprobs`, aligned with labels).

A per-completion-token list becomes a per-position field: its values land, in order, on the positions
whose label is not -100, so the loss reads them where it reads the targets. Rows keep their own keys;
a key the row already has is an error, never silently overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from twinkle.data_format.labels import IGNORE_INDEX

if TYPE_CHECKING:
    import numpy as np
    import torch

    # per row: one number, or one list (per completion token); a tensor or array of them is read alike
    PerRow = Sequence[float | Sequence[float]] | torch.Tensor | np.ndarray
    Rows = Mapping[str, Any] | Sequence[Mapping[str, Any]]


def _plain(value: Any) -> Any:  # a tensor / array becomes lists; anything else is returned as is
    return value.tolist() if hasattr(value, "tolist") else value


def _on_completion(row: Mapping, values: Sequence[float], name: str, i: int) -> list[float]:
    labels = _plain(row.get("labels"))
    if labels is None:
        raise ValueError(f"{name}: row {i} has no labels, so its completion tokens are unknown")
    positions = [t for t, label in enumerate(labels) if label != IGNORE_INDEX]
    if len(values) != len(positions):
        raise ValueError(
            f"{name}: row {i} has {len(values)} values but {len(positions)} completion tokens (labels != -100)"
        )
    out = [0.0] * len(labels)
    for t, v in zip(positions, values):
        out[t] = float(v)
    return out


def _per_row(values: PerRow, n: int, name: str) -> list:
    values = _plain(values)
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != n:
        raise ValueError(f"{name} must have one entry per row ({n} rows), got {values!r:.80}")
    return list(values)


def completion_values(rows: Sequence[Mapping], values: PerRow, name: str) -> list:
    """Row i's field `name` from values[i]: a number (for the whole row), or one per completion token
    (spread onto the positions whose label is not -100). `advantages` is read so; so are a critic's
    `returns` and `old_values` (twinkle.model.TransformersValueModel)."""
    per_row = _per_row(values, len(rows), name)
    return [
        float(v) if not isinstance(v, Sequence) else _on_completion(r, v, name, i)
        for i, (r, v) in enumerate(zip(rows, per_row))
    ]


def merge_loss_inputs(
    inputs: Rows,
    *,
    old_logps: PerRow | None = None,
    advantages: PerRow | None = None,
    ref_outputs: Mapping[str, Any] | None = None,
) -> Rows:
    """`inputs` (encoded rows) with the keywords added as fields; `inputs` unchanged when none is given."""
    if old_logps is None and advantages is None and ref_outputs is None:
        return inputs
    rows = [inputs] if isinstance(inputs, Mapping) else list(inputs)
    if not all(isinstance(r, Mapping) and "input_ids" in r for r in rows):
        raise ValueError("old_logps / advantages / ref_outputs need encoded rows (dicts with input_ids and labels)")
    fields: dict[str, list] = {}
    if advantages is not None:
        fields["advantages"] = completion_values(rows, advantages, "advantages")
    if old_logps is not None:
        values = _per_row(old_logps, len(rows), "old_logps")
        fields["logprobs"] = [_on_completion(r, v, "old_logps", i) for i, (r, v) in enumerate(zip(rows, values))]
    if ref_outputs is not None:
        logps = ref_outputs.get("logprobs") if isinstance(ref_outputs, Mapping) else None
        if logps is None:
            raise ValueError("ref_outputs must be what forward_only returned (a dict with 'logprobs')")
        fields["ref_logprobs"] = [[float(x) for x in _plain(v)] for v in _per_row(logps, len(rows), "ref_outputs")]
    out = []
    for i, row in enumerate(rows):
        clash = [k for k in fields if k in row]
        if clash:
            raise ValueError(f"row {i} already has {clash}: pass them either in the rows or as keywords")
        out.append({**row, **{k: v[i] for k, v in fields.items()}})
    return out
