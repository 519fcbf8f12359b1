"""RowStream: a lazily read dataset for data too big to hold; rows flow through the op chain on iteration."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

BatchOp = Callable[[list[dict], int], list[dict]]  # (rows, index of the first row) -> rows


class RowStream:
    """An iterable of row dicts: a re-startable source plus batched ops applied on the fly."""

    def __init__(
        self, source: Callable[[], Iterable[dict]], ops: tuple[BatchOp, ...] = (), batch_size: int = 256
    ) -> None:
        self.source = source
        self.ops = ops
        self.batch_size = batch_size

    def with_op(self, op: BatchOp) -> RowStream:
        return RowStream(self.source, (*self.ops, op), self.batch_size)

    def select(self, start: int, stop: int | None) -> RowStream:
        return RowStream(lambda: itertools.islice(self.source(), start, stop), self.ops, self.batch_size)

    def __iter__(self) -> Iterator[dict]:
        rows = iter(self.source())
        index = 0
        while batch := list(itertools.islice(rows, self.batch_size)):
            first = index
            index += len(batch)
            for op in self.ops:
                batch = op(batch, first)
            yield from batch
