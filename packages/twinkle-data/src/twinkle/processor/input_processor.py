"""InputProcessor: encoded rows to model tensors, padded or packed.

Padded (``packing=False``): ``[B, T]`` tensors, pads on the right or left, ``attention_mask`` marks
real tokens, ``position_ids`` count real tokens from 0, pad labels are -100. Rows with images add
``pixel_values`` and ``image_grid_thw`` (``twinkle.processor.images``), in row order in both modes.

Packed (``packing=True``, padding-free): all rows concatenated into one ``[1, sum(len)]`` row;
``position_ids`` restart at 0 for every sequence, which is how transformers (flash-attention and,
with no attention mask and no KV cache, sdpa / eager) keeps sequences from attending to each other.
There is therefore NO ``attention_mask`` in a packed batch (an all-ones mask would merge the
sequences); call the model with ``use_cache=False``. The first
label of each sequence is -100: nothing inside that sequence predicts it, exactly as when padded.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.processor.images import collate_images
from twinkle.registry import Registry


class InputProcessor:
    """Collate rows with ``input_ids`` (and optionally ``labels``) into tensors.

    padding_side: ``'right'`` or ``'left'`` (padded mode).
    packing: concatenate rows padding-free (see module docs).
    pad_token_id: the id written into pads (masked out, so any valid id works).
    pad_to_multiple_of: round the padded length up (kernels like multiples of 8).
    padding_free: twinkle-kit's name for ``packing``.

    Rows packed by a PackingDataset (several sequences in one row, with ``lengths``) are split into
    their sequences and collated padding-free whatever ``packing`` says: padded, their sequences
    would attend to each other.
    """

    name: ClassVar[str] = "InputProcessor"

    def __init__(
        self,
        padding_side: str = "right",
        packing: bool = False,
        pad_token_id: int = 0,
        pad_to_multiple_of: int | None = None,
        *,
        padding_free: bool | None = None,
    ) -> None:
        if padding_free is not None:
            packing = packing or padding_free
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        self.padding_side = padding_side
        self.packing = packing
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    @staticmethod
    def _columns(rows: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
        if not rows:
            raise ValueError("InputProcessor got an empty batch")
        ids, labels = [], []
        for i, row in enumerate(rows):
            if "input_ids" not in row:
                raise ValueError(
                    f"batch row {i} has no 'input_ids' (columns: {', '.join(row)}); "
                    f"encode the dataset with a Template first"
                )
            row_ids = list(row["input_ids"])
            row_labels = row.get("labels")
            row_labels = [IGNORE_INDEX] * len(row_ids) if row_labels is None else list(row_labels)
            if len(row_labels) != len(row_ids):
                raise ValueError(f"batch row {i}: {len(row_ids)} input_ids but {len(row_labels)} labels")
            ids.append(row_ids)
            labels.append(row_labels)
        return ids, labels

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        ids, labels = self._columns(rows)
        # pixel_values / image_grid_thw of every image, in row order (packed or padded alike; a packed
        # batch's 3-D rope positions are the model's: twinkle.model.vision.packed_rope_positions)
        images = collate_images(rows)
        if any(row.get("lengths") for row in rows):
            ids, labels = _sequences(rows, ids, labels)
            return {**self.pack(ids, labels), **images}
        batch = self.pack(ids, labels) if self.packing else self.pad(ids, labels)
        return {**batch, **images}

    def pad(self, ids: list[list[int]], labels: list[list[int]]) -> dict[str, torch.Tensor]:
        T = max(len(x) for x in ids)
        if self.pad_to_multiple_of:
            T = -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of
        B = len(ids)
        input_ids_B_T = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        labels_B_T = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        attention_mask_B_T = torch.zeros((B, T), dtype=torch.long)
        position_ids_B_T = torch.zeros((B, T), dtype=torch.long)
        for b, (row_ids, row_labels) in enumerate(zip(ids, labels)):
            n = len(row_ids)
            cols = slice(0, n) if self.padding_side == "right" else slice(T - n, T)
            input_ids_B_T[b, cols] = torch.tensor(row_ids, dtype=torch.long)
            labels_B_T[b, cols] = torch.tensor(row_labels, dtype=torch.long)
            attention_mask_B_T[b, cols] = 1
            position_ids_B_T[b, cols] = torch.arange(n)
        return {
            "input_ids": input_ids_B_T,
            "attention_mask": attention_mask_B_T,
            "labels": labels_B_T,
            "position_ids": position_ids_B_T,
        }

    def pack(self, ids: list[list[int]], labels: list[list[int]]) -> dict[str, torch.Tensor]:
        lengths = [len(x) for x in ids]
        flat_labels = []
        for row_labels in labels:
            flat_labels.extend([IGNORE_INDEX, *row_labels[1:]])
        input_ids_1_T = torch.tensor([t for row in ids for t in row], dtype=torch.long)[None]
        position_ids_1_T = torch.cat([torch.arange(n) for n in lengths])[None]
        return {
            "input_ids": input_ids_1_T,
            "labels": torch.tensor(flat_labels, dtype=torch.long)[None],
            "position_ids": position_ids_1_T,
        }


def _sequences(
    rows: list[dict], ids: list[list[int]], labels: list[list[int]]
) -> tuple[list[list[int]], list[list[int]]]:
    """The sequences of packed rows (a row without `lengths` is one sequence), in order."""
    out_ids, out_labels = [], []
    for i, (row, row_ids, row_labels) in enumerate(zip(rows, ids, labels)):
        lengths = list(row.get("lengths") or [len(row_ids)])
        if sum(lengths) != len(row_ids):
            raise ValueError(f"batch row {i}: lengths {lengths} do not add up to its {len(row_ids)} input_ids")
        start = 0
        for n in lengths:
            out_ids.append(row_ids[start : start + n])
            out_labels.append(row_labels[start : start + n])
            start += n
    return out_ids, out_labels


INPUT_PROCESSORS: Registry[InputProcessor] = Registry("input processor", "twinkle.input_processor", InputProcessor)
