"""Packed rows: several encoded sequences in one row of about `max_length` tokens (twinkle-kit's
PackingDataset / IterablePackingDataset), so every batch holds about the same number of tokens.

A packed row is `input_ids` and `labels` of its sequences one after another, `position_ids` restarting
at 0 where each sequence starts, and `lengths` (tokens per sequence). The InputProcessor collates a
batch of packed rows padding-free (each sequence attends only to itself), so a packed row trains
exactly as its sequences would one by one. Sequences go into bins first-fit by decreasing length
(eager data) or greedily in arrival order (streamed data); none is ever split.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import datasets

from twinkle.dataset.dataset import Dataset
from twinkle.dataset.errors import DataError
from twinkle.dataset.loading import rows_to_dataset
from twinkle.dataset.meta import DatasetMeta
from twinkle.dataset.stream import RowStream

PACKED_KEYS = ("input_ids", "labels", "position_ids", "lengths")


def _packed(rows: list[dict]) -> dict:
    out = {"input_ids": [], "labels": [], "position_ids": [], "lengths": []}
    for row in rows:
        ids = list(row["input_ids"])
        labels = row.get("labels")
        out["input_ids"].extend(ids)
        out["labels"].extend(list(labels) if labels is not None else [-100] * len(ids))
        out["position_ids"].extend(range(len(ids)))
        out["lengths"].append(len(ids))
    return out


def _check(row: dict, max_length: int) -> int:
    if "input_ids" not in row:
        raise DataError(f"packing needs encoded rows (with input_ids); got columns {sorted(row)}: call encode() first")
    n = len(row["input_ids"])
    if n > max_length:
        raise DataError(f"a sequence of {n} tokens does not fit a packed row of max_length={max_length}")
    return n


def pack_rows(rows: Iterable[dict], max_length: int) -> list[dict]:
    """Bins of at most `max_length` tokens, first fit by decreasing length (the order of a bin's rows
    is their order in the data)."""
    rows = list(rows)
    lengths = [_check(r, max_length) for r in rows]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(rows)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_length - lengths[i])
    return [_packed([rows[i] for i in sorted(members)]) for members in bins]


def pack_stream(rows: Iterable[dict], max_length: int) -> Iterator[dict]:
    """Bins filled in arrival order: a bin is emitted when the next sequence does not fit it."""
    current: list[dict] = []
    used = 0
    for row in rows:
        n = _check(row, max_length)
        if current and used + n > max_length:
            yield _packed(current)
            current, used = [], 0
        current.append(row)
        used += n
    if current:
        yield _packed(current)


def _max_length(dataset: Dataset, max_length: int | None) -> int:
    limit = max_length or getattr(dataset.template, "max_length", None)
    if not limit:
        raise DataError("packing needs a row length: set_template(..., max_length=N) or pack_dataset(max_length=N)")
    return int(limit)


class PackingDataset(Dataset):
    """A Dataset whose `pack_dataset()` packs its encoded rows into rows of about max_length tokens."""

    def pack_dataset(self, max_length: int | None = None) -> PackingDataset:
        limit = _max_length(self, max_length)
        for key, part in list(self._parts.items()):
            if isinstance(part, RowStream):
                self._parts[key] = RowStream(lambda part=part: pack_stream(part, limit), batch_size=self.batch_size)
            else:
                packed = pack_rows(part, limit)
                self._parts[key] = rows_to_dataset(packed) if packed else datasets.Dataset.from_dict({})
            self._lineage[key] = None
        return self


class IterablePackingDataset(PackingDataset):
    """PackingDataset over streamed data: rows are packed as they are read."""

    def __init__(self, dataset_meta: DatasetMeta | str | None = None, *, batch_size: int = 256) -> None:
        super().__init__(dataset_meta, streaming=True, batch_size=batch_size)


class IterableDataset(Dataset):
    """A streamed Dataset (`Dataset(..., streaming=True)`): every op runs as rows are read."""

    def __init__(self, dataset_meta: DatasetMeta | str | None = None, *, batch_size: int = 256) -> None:
        super().__init__(dataset_meta, streaming=True, batch_size=batch_size)
