"""Reading local data files (jsonl, json, csv, parquet, txt) into rows or Arrow tables.

Errors name the file and, where the format has them, the line: a user with a 2 GB jsonl needs to know
which line to fix, not that "JSON parsing failed".
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import pyarrow as pa

from twinkle.dataset.errors import DataError

SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")


def data_format(path: Path) -> str:
    name = path.name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix) or name.endswith(suffix + ".gz"):
            return suffix[1:]
    raise DataError(f"{path}: unsupported data file type; expected one of {', '.join(SUFFIXES)}")


def _open_text(path: Path) -> TextIO:
    if path.name.endswith(".gz"):
        import gzip

        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_jsonl(path: Path) -> Iterator[dict]:
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON line ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            yield row


def iter_json(path: Path) -> Iterator[dict]:
    with _open_text(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several objects, one per line: a jsonl file named .json
            yield from iter_jsonl(path)
            return
        raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    if isinstance(data, dict):
        # {"data": [...]} / {"train": [...]}: the single list-valued field holds the rows
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a list of objects or one list-valued field, got keys {list(data)}")
        data = lists[0]
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DataError(f"{path}: item {i} is {type(row).__name__}, expected a JSON object")
        yield row


def iter_txt(path: Path) -> Iterator[dict]:
    with _open_text(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line.strip():
                yield {"text": line}


def read_table(path: Path) -> pa.Table:
    """Columnar formats straight to Arrow (no Python rows)."""
    fmt = data_format(path)
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path)
        import pyarrow.csv as pcsv

        return pcsv.read_csv(path)
    except pa.ArrowInvalid as e:
        raise DataError(f"{path}: cannot read {fmt}: {e}") from None


def iter_rows(path: Path) -> Iterator[dict]:
    """Rows of any supported file, one dict at a time (the streaming path)."""
    fmt = data_format(path)
    if fmt == "jsonl":
        yield from iter_jsonl(path)
    elif fmt == "json":
        yield from iter_json(path)
    elif fmt == "txt":
        yield from iter_txt(path)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    else:
        yield from read_table(path).to_pylist()


def rows_to_columns(rows: list[dict]) -> dict[str, list]:
    """Column dict over the union of keys (rows missing a key get None), first-seen key order."""
    keys: dict[str, None] = {}
    for row in rows:
        keys.update(dict.fromkeys(row))
    return {k: [row.get(k) for row in rows] for k in keys}


def read_file(path: Path, chunk_rows: int = 10_000) -> pa.Table:
    """The whole file as one Arrow table, built ``chunk_rows`` rows at a time: a big JSONL never sits
    in memory as Python dicts (a dict per row costs several times its Arrow form)."""
    fmt = data_format(path)
    if fmt in ("parquet", "csv"):
        return read_table(path)
    rows = iter_rows(path)
    try:
        tables = [
            pa.Table.from_pydict(rows_to_columns(chunk))
            for chunk in iter(lambda: list(itertools.islice(rows, chunk_rows)), [])
        ]
        if not tables:
            return pa.table({})
        # chunks may differ in detail (a key or struct field only some rows have): unified like one table
        return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DataError(f"{path}: rows have inconsistent types across lines: {e}") from None
