"""LazyDataset (twinkle-kit's name): map and encode recorded, run on each row when it is read.

For data whose preprocessed or encoded form is too big to hold (images decoded to pixels): rows stay
raw in Arrow, and `dataset[i]` runs the recorded preprocessors and the encoder on row i alone. A
preprocessor must give one row per row here (random access needs it); a row it drops, or one the
encoder refuses, reads as a row carrying its reason, which the DataLoader skips and logs. `filter`
runs at once on the raw rows (it changes which rows exist), so it comes before any map.
"""

from __future__ import annotations

from collections.abc import Iterator

from twinkle.dataset.dataset import ERROR_KEY, Dataset, lazy_encoder
from twinkle.dataset.errors import DataError
from twinkle.dataset.meta import DatasetMeta
from twinkle.dataset.stream import BatchOp


class LazyDataset(Dataset):
    def __init__(self, dataset_meta: DatasetMeta | str | None = None, *, batch_size: int = 256) -> None:
        super().__init__(dataset_meta, batch_size=batch_size)
        self.ops: list[BatchOp] = []  # preprocessors, then the encoder: run on each row as it is read

    def _apply(self, op: BatchOp, dataset_meta: DatasetMeta | str | None, describe: str | None) -> None:
        """Dataset.map and .filter end here: a filter runs now, on the raw rows; a preprocessor is recorded."""
        from twinkle.preprocessor.base import Filter

        if isinstance(op, Filter):
            if self.ops:
                raise DataError("LazyDataset filters raw rows, before any map or encode: call filter first")
            super()._apply(op, dataset_meta, describe)
            return
        if dataset_meta is not None:
            raise NotImplementedError("LazyDataset maps every part alike: call map without dataset_meta")
        self.ops.append(op)

    def encode(
        self,
        add_generation_prompt: bool = False,
        cache: bool = True,  # noqa: ARG002 - Dataset.encode's signature; nothing is cached
        num_proc: int = 1,  # noqa: ARG002 - Dataset.encode's signature; rows encode as read
        *,
        batched: bool = True,  # noqa: ARG002 - Dataset.encode's signature
        load_from_cache_file: bool | None = None,  # noqa: ARG002 - Dataset.encode's signature
    ) -> LazyDataset:
        """Records the encoder; rows are encoded one at a time as they are read (nothing is cached)."""
        if self.template is None:
            raise DataError("encode() needs a template: call dataset.set_template(...) first")
        self.ops.append(lazy_encoder(self.template, add_generation_prompt, "lazy"))
        return self

    def __getitem__(self, index: int) -> dict:
        rows = [super().__getitem__(index)]
        for op in self.ops:
            try:
                rows = op(rows, int(index))
            except DataError as e:
                return {ERROR_KEY: f"row {index}: {e}"}
            if len(rows) != 1:
                return {ERROR_KEY: f"row {index}: a lazy preprocessor gave {len(rows)} rows for one"}
        return rows[0]

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))
