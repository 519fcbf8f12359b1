"""One DatasetMeta to one part: an Arrow-backed ``datasets.Dataset`` or a lazy ``RowStream``.

Each part carries a lineage (a hash of where its rows came from and every op applied since), the key
of the encode cache; None when some step cannot be described.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets
import pyarrow as pa
from datasets.table import InMemoryTable

from twinkle.dataset.errors import DataError
from twinkle.dataset.meta import DatasetMeta
from twinkle.dataset.readers import iter_rows, read_file, rows_to_columns
from twinkle.dataset.sources import resolve_dataset_path, split_files
from twinkle.dataset.stream import RowStream

Part = datasets.Dataset | RowStream


def lineage_hash(*items: object) -> str:
    return hashlib.sha256(json.dumps(items, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _from_table(table: pa.Table) -> datasets.Dataset:
    return datasets.Dataset(InMemoryTable(table))


def rows_to_dataset(rows: list[dict]) -> datasets.Dataset:
    return _from_table(pa.Table.from_pydict(rows_to_columns(rows)))


def _in_memory(meta: DatasetMeta, streaming: bool) -> tuple[Part, str | None]:
    data = meta.data
    if isinstance(data, datasets.Dataset):
        part, lineage = data, getattr(data, "_fingerprint", None)
    elif isinstance(data, datasets.IterableDataset):
        return RowStream(lambda: iter(data)), None
    elif isinstance(data, dict):
        part, lineage = _from_table(pa.Table.from_pydict(data)), lineage_hash(data)
    elif isinstance(data, Sequence) and all(isinstance(r, dict) for r in data):
        part, lineage = rows_to_dataset(list(data)), lineage_hash(list(data))
    else:
        raise DataError(
            f"DatasetMeta.data must be a list of dicts, a dict of columns or a datasets.Dataset, "
            f"got {type(data).__name__}"
        )
    if streaming:
        return RowStream(lambda: iter(part)), lineage
    return part, lineage


def _from_files(files: list[Path], streaming: bool) -> Part:
    if streaming:

        def rows() -> Iterator[dict]:
            for f in files:
                yield from iter_rows(f)

        return RowStream(rows)
    tables = [read_file(f) for f in files]
    try:
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DataError(f"files {', '.join(map(str, files))} have incompatible columns: {e}") from None
    return _from_table(table)


def _slice(part: Part, data_slice: range | slice | Sequence[int], key: str) -> Part:
    if isinstance(part, RowStream):
        if isinstance(data_slice, range | slice) and (data_slice.step or 1) == 1:
            return part.select(data_slice.start or 0, data_slice.stop)
        raise DataError(f"{key}: a streamed dataset takes only a contiguous range as data_slice")
    n = len(part)
    if isinstance(data_slice, slice):
        indices = range(n)[data_slice]
    elif isinstance(data_slice, range) and data_slice.start == 0 and data_slice.step == 1 and n:
        indices = [i % n for i in data_slice]  # "the first N samples", N past the end: the data repeats
    else:
        indices = list(data_slice)
        bad = [i for i in indices if not -n <= i < n]
        if bad:
            raise DataError(f"{key}: data_slice asks for row {bad[0]} but the dataset has {n} rows")
    return part.select(indices)


def load_part(meta: DatasetMeta, streaming: bool = False) -> tuple[Part, str | None]:
    """Load the rows ``meta`` names; returns the part and its lineage."""
    if meta.data is not None or meta.dataset_id is None:  # DatasetMeta has one or the other
        part, lineage = _in_memory(meta, streaming)
    else:
        path = resolve_dataset_path(meta.dataset_id)
        files = split_files(path, meta.subset_name, meta.split)
        part = _from_files(files, streaming)
        lineage = lineage_hash([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files])
    if meta.data_slice is not None:
        part = _slice(part, meta.data_slice, meta.key)
        lineage = lineage and lineage_hash(lineage, repr(meta.data_slice))
    return part, lineage
