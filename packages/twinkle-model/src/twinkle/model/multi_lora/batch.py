"""Turning one tenant's rows into tensors, and several tenants' tensors into one fused batch.

A row is a dict with `input_ids` (list of ints), optional `labels` (same length, -100 where no
loss; default: the input ids, i.e. language modelling), and optional loss inputs: a number is a
per-row field, a list of numbers as long as `input_ids` a per-token field aligned with `labels`
(so it is shifted together with them), a [len(input_ids), K] array K values per token (K ids
scored at each position, twinkle.loss.sft). Image rows carry `pixel_values` and `image_grid_thw`
(twinkle.processor.images). Anything else a row carries along is ignored.
A dict of tensors (`input_ids` [B, T], optional `attention_mask`, `labels`, fields) is accepted too.
Padding is on the right, so every real token keeps positions 0..len-1 whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.processor.images import collate_images

_RESERVED = {"input_ids", "labels", "attention_mask", "position_ids", "pixel_values", "image_grid_thw"}


@dataclass
class Batch:
    input_ids_B_T: torch.Tensor
    attention_mask_B_T: torch.Tensor
    labels_B_T: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # [B, T] or [B, T, K] per token, [B] per row
    images: dict[str, torch.Tensor] = field(default_factory=dict)  # pixel_values / image_grid_thw, rows' order

    @property
    def rows(self) -> int:
        return self.input_ids_B_T.shape[0]

    @property
    def length(self) -> int:
        return self.input_ids_B_T.shape[1]

    @property
    def tokens(self) -> int:
        return int(self.attention_mask_B_T.sum())

    def shifted_fields(self) -> dict[str, torch.Tensor]:
        """The loss inputs as the shifted targets `labels_B_T[:, 1:]` see them: per-token ones shifted."""
        return {k: (v[:, 1:] if v.dim() >= 2 else v) for k, v in self.fields.items()}

    def padded_to(self, length: int, pad_id: int) -> Batch:
        extra = length - self.length
        if extra == 0:
            return self

        def pad(t, value):  # along dim 1, the time
            return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, extra), value=value)

        fields = {k: pad(v, 0.0) if v.dim() >= 2 else v for k, v in self.fields.items()}
        return Batch(
            pad(self.input_ids_B_T, pad_id),
            pad(self.attention_mask_B_T, 0),
            pad(self.labels_B_T, IGNORE_INDEX),
            fields,
            self.images,
        )


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_number_sequence(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.dim() in (1, 2) and v.numel() > 0
    if isinstance(v, np.ndarray):  # a server's decoded arrays: made a tensor once, in collate
        return v.ndim in (1, 2) and v.size > 0 and v.dtype.kind in "iuf"
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(_is_number(x) for x in v)


def _row_fields(rows: list[dict]) -> dict[str, torch.Tensor | list]:
    names = sorted({k for r in rows for k in r} - _RESERVED)
    out = {}
    for name in names:
        values = [r.get(name) for r in rows]
        if all(_is_number(v) for v in values):
            out[name] = torch.tensor(values, dtype=torch.float32)
        elif all(_is_number_sequence(v) for v in values):
            for i, r in enumerate(rows):
                if len(r[name]) != len(r["input_ids"]):
                    raise ValueError(
                        f"row {i}: field {name!r} has {len(r[name])} values for {len(r['input_ids'])} "
                        "input_ids (per-token fields are aligned with labels)"
                    )
            out[name] = [torch.as_tensor(v, dtype=torch.float32) for v in values]
            widths = {tuple(t.shape[1:]) for t in out[name]}
            if len(widths) > 1:
                raise ValueError(f"field {name!r} has per-token widths {sorted(widths)}: one K for all rows")
        elif any(_is_number(v) for v in values):
            raise ValueError(f"field {name!r} is a number in some rows and not in others")
    return out


def collate(inputs, pad_id: int) -> Batch:
    """One tenant's inputs (rows or a dict of tensors) as a right-padded Batch."""
    if isinstance(inputs, dict) and isinstance(inputs.get("input_ids"), torch.Tensor):
        return _from_tensors(inputs)
    if isinstance(inputs, dict):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise ValueError("inputs must be a non-empty list of rows (dicts with 'input_ids') or a dict of tensors")
    for i, row in enumerate(inputs):
        if not isinstance(row, dict) or "input_ids" not in row:
            raise ValueError(f"row {i} has no 'input_ids'")
        if len(row["input_ids"]) < 2:
            raise ValueError(f"row {i} has {len(row['input_ids'])} input_ids; at least 2 are needed to predict one")
        if "labels" in row and len(row["labels"]) != len(row["input_ids"]):
            raise ValueError(f"row {i}: {len(row['labels'])} labels for {len(row['input_ids'])} input_ids")
    T = max(len(r["input_ids"]) for r in inputs)
    B = len(inputs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    fields = _row_fields(inputs)
    per_token = {k: torch.zeros((B, T, *v[0].shape[1:])) for k, v in fields.items() if isinstance(v, list)}
    for i, row in enumerate(inputs):
        n = len(row["input_ids"])
        ids[i, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.as_tensor(row.get("labels", row["input_ids"]), dtype=torch.long)
        mask[i, :n] = 1
        for k in per_token:
            per_token[k][i, :n] = fields[k][i]
    # the per-token lists are now padded tensors
    fields = {**{k: v for k, v in fields.items() if isinstance(v, torch.Tensor)}, **per_token}
    return Batch(ids, mask, labels, fields, collate_images(inputs))


def _from_tensors(inputs: dict) -> Batch:
    ids = inputs["input_ids"].long()
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, time], got shape {tuple(ids.shape)}")
    mask = inputs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.long()
    labels = inputs.get("labels")
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX) if labels is None else labels.long()
    fields = {k: v.float() for k, v in inputs.items() if k not in _RESERVED and isinstance(v, torch.Tensor)}
    images = {k: inputs[k] for k in ("pixel_values", "image_grid_thw") if inputs.get(k) is not None}
    return Batch(ids, mask, labels, fields, images)


def fuse(batches: list[Batch], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of all batches stacked row-wise, padded to the longest."""
    if len(batches) == 1:
        return batches[0].input_ids_B_T, batches[0].attention_mask_B_T
    T = max(b.length for b in batches)
    padded = [b.padded_to(T, pad_id) for b in batches]
    return torch.cat([b.input_ids_B_T for b in padded]), torch.cat([b.attention_mask_B_T for b in padded])


def fused_images(batches: list[Batch], ids_B_T: torch.Tensor, config, device) -> dict:
    """The model's image kwargs for the fused rows (every batch's images in row order), or {}."""
    with_images = [b.images for b in batches if b.images]
    if not with_images:
        return {}
    from twinkle.model.inputs import image_kwargs

    images = {k: torch.cat([im[k] for im in with_images]) for k in ("pixel_values", "image_grid_thw")}
    kwargs = image_kwargs({"input_ids": ids_B_T, **images}, config)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
