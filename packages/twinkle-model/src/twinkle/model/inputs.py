"""From what the user passes to forward_backward to tensors the model runs on.

Accepted: a list of encoded rows ({'input_ids', 'labels', ...}), a list of raw trajectories (rows
without 'input_ids', encoded through the model's template), one row, or an already collated dict
of tensors. Fields beyond the standard ones are loss inputs: a number per row becomes a [B] tensor,
a list as long as the row a per-token [B, T] tensor (right-padded with 0), a list of equal-length
lists a [B, T, K] tensor. Per-token fields are aligned with `labels` (position t of a field
belongs to the target labels[t]).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.processor import InputProcessor
from twinkle.processor.images import IMAGE_KEYS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from twinkle.data_format.loss_inputs import Rows
    from twinkle.template import Template

# images (IMAGE_KEYS) are model inputs, concatenated over the batch, not per-row loss inputs;
# `lengths`: the sequences of a packed row (twinkle.dataset.packing), which the InputProcessor splits
MODEL_KEYS = ("input_ids", "attention_mask", "labels", "position_ids", "lengths", *IMAGE_KEYS)
FLOAT_FIELDS = ("weights", "advantages", "logprobs", "ref_logprobs", "sequence_ratio_mask", "teacher_topk_logprobs")


def as_rows(
    inputs: Rows,
    template: Template | None = None,
) -> list[dict] | dict[str, torch.Tensor]:
    """Normalise `inputs` to a list of encoded rows, or pass a collated tensor dict through."""
    if isinstance(inputs, Mapping):
        ids = inputs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            return dict(inputs)
        if ids is not None and len(ids) and isinstance(ids[0], Sequence):  # columns of rows
            return [{k: v[i] for k, v in inputs.items()} for i in range(len(ids))]
        inputs = [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, str) or not inputs:
        raise ValueError(
            f"inputs must be a non-empty list of rows (encoded or trajectories), got {type(inputs).__name__}"
        )
    rows = []
    for i, row in enumerate(inputs):
        if isinstance(row, Mapping) and "input_ids" in row:
            rows.extend(_expand_pair(dict(row)))
            continue
        if template is None:
            raise ValueError(
                f"row {i} is a raw trajectory (no 'input_ids'); call set_template(...) first or pass encoded rows"
            )
        encoded = template.encode(row)
        if encoded is None:
            raise ValueError(f"row {i} was dropped by the template (longer than its max_length)")
        encoded = dict(encoded)
        if isinstance(row, Mapping):  # carry per-row loss inputs (advantages, ...) along
            for k, v in row.items():
                if k not in encoded and k not in ("messages", "tools"):
                    encoded[k] = v
        rows.extend(_expand_pair(encoded))
    return rows


def has_trajectories(inputs: Rows) -> bool:
    if isinstance(inputs, Mapping):
        return "input_ids" not in inputs
    return isinstance(inputs, Sequence) and any(not (isinstance(r, Mapping) and "input_ids" in r) for r in inputs)


def _expand_pair(row: dict) -> list[dict]:
    """A preference row (chosen plus `rejected_input_ids`/`rejected_labels`) becomes two adjacent
    rows, chosen then rejected: the layout the preference losses read."""
    if "rejected_input_ids" not in row:
        return [row]
    rejected = {"input_ids": row.pop("rejected_input_ids"), "labels": row.pop("rejected_labels")}
    return [row, rejected]


def _field_tensor(name: str, values: list, T: int) -> torch.Tensor | None:
    first = values[0]
    dtype = torch.float32 if name in FLOAT_FIELDS else None
    if isinstance(first, (int, float, bool)) or (isinstance(first, torch.Tensor) and first.dim() == 0):
        return torch.as_tensor([float(v) if dtype else v for v in values], dtype=dtype)
    if not isinstance(first, (Sequence, torch.Tensor)) or isinstance(first, str):
        return None  # metadata carried along (ids, text): not a loss input
    try:
        tensors = [torch.as_tensor(v, dtype=dtype) for v in values]
    except (TypeError, ValueError, RuntimeError):
        return None  # e.g. the messages a trajectory carried along
    if tensors[0].dim() == 0 or not (tensors[0].dtype.is_floating_point or tensors[0].dtype == torch.long):
        return None
    out = torch.zeros(len(values), T, *tensors[0].shape[1:], dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out


def collate(
    rows: list[dict] | dict,
    processor: InputProcessor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(model tensors, loss-input fields) for a batch of encoded rows; `processor` (default: a right-
    padding InputProcessor) makes the model tensors."""
    if isinstance(rows, dict):  # already collated
        batch = {k: v for k, v in rows.items() if k in MODEL_KEYS}
        if "labels" not in batch:
            raise ValueError("a collated batch needs 'labels' (-100 where no loss)")
        return batch, {k: v for k, v in rows.items() if k not in MODEL_KEYS and isinstance(v, torch.Tensor)}
    for i, r in enumerate(rows):
        if not len(r["input_ids"]):
            raise ValueError(f"row {i} has no tokens")
        if "labels" in r and len(r["labels"]) != len(r["input_ids"]):
            raise ValueError(f"row {i}: {len(r['labels'])} labels for {len(r['input_ids'])} input_ids")
    core = [{k: r[k] for k in ("input_ids", "labels", "lengths", *IMAGE_KEYS) if k in r} for r in rows]
    batch = (processor if processor is not None else InputProcessor())(core)
    B, T = batch["input_ids"].shape
    extra_names = sorted({k for r in rows for k in r} - set(MODEL_KEYS))
    fields = {}
    for name in extra_names:
        values = [r.get(name) for r in rows]
        if any(v is None for v in values):
            if name in FLOAT_FIELDS:
                raise ValueError(f"loss input {name!r} is missing from some rows")
            continue
        t = _field_tensor(name, values, T)
        if t is not None:
            if len(rows) != B:
                raise ValueError(
                    f"the input processor packed {len(rows)} rows into {B}; per-row loss input "
                    f"{name!r} cannot follow (use padding, not packing, for such losses)"
                )
            fields[name] = t
    return batch, fields


def check_vocab(batch: dict[str, torch.Tensor], vocab_size: int) -> None:
    """ValueError naming the first out-of-vocabulary id, before the model sees the batch."""
    for key, allowed_ignore in (("input_ids", False), ("labels", True)):
        ids = batch.get(key)
        if ids is None:
            continue
        bad = (ids < 0) | (ids >= vocab_size)
        if allowed_ignore:
            bad &= ids != IGNORE_INDEX
        if bad.any():
            row, pos = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"token id {int(ids[row, pos])} in {key} (row {row}, position {pos}) is outside "
                f"the vocabulary of size {vocab_size}"
            )


def sequence_spans(batch: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """(batch row, start, length) of each input sequence: one per row when padded (its real tokens
    from the attention mask: they start after the pads when padded on the left), several per row
    when packed (padding-free: no attention mask, and ``position_ids`` restart at 0 where each
    sequence begins)."""
    ids = batch["input_ids"]
    if "attention_mask" in batch:
        mask = batch["attention_mask"].bool()
        starts = mask.int().argmax(1).tolist()  # the first real token (0 for right padding)
        return [(b, int(s), int(n)) for b, (s, n) in enumerate(zip(starts, mask.sum(1).tolist()))]
    if "position_ids" not in batch:
        return [(b, 0, ids.shape[1]) for b in range(ids.shape[0])]
    spans = []
    for b, positions in enumerate(batch["position_ids"]):
        starts = [*(positions == 0).nonzero().flatten().tolist(), positions.numel()]
        spans.extend((b, s, e - s) for s, e in itertools.pairwise(starts))
    return spans


def shift_fields(fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Align per-token fields with the shifted targets (drop position 0, which nothing predicts)."""
    return {k: (v[:, 1:] if v.dim() >= 2 else v) for k, v in fields.items()}


def image_kwargs(batch: dict[str, torch.Tensor], config: PretrainedConfig) -> dict:
    """Model kwargs for a batch with images. The 1-D ``position_ids`` are dropped (set to None): a
    Qwen-VL model builds its own 3-D rope positions (time, height, width) from the image grids, and
    finds the image tokens through ``mm_token_type_ids`` (1 on an image token)."""
    image_token = getattr(config, "image_token_id", None)
    if image_token is None:
        raise ValueError(f"the batch holds images but the model ({type(config).__name__}) is text-only")
    return {
        "position_ids": None,
        "pixel_values": batch["pixel_values"],
        "image_grid_thw": batch["image_grid_thw"],
        "mm_token_type_ids": (batch["input_ids"] == image_token).int(),
    }
