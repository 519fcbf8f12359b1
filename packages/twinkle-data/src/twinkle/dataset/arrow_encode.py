"""Encoding at scale: rows streamed through a Template into an Arrow file, one chunk at a time.

Memory stays bounded whatever the row count. Rows are pulled from the source a chunk at a time; at
most ``2 * num_proc`` chunks are in flight (being encoded or waiting their turn to be written); each
encoded chunk becomes one Arrow record batch, written the moment it is next in order and then dropped.
The result is read back memory-mapped, so the encoded dataset never sits in Python lists.

Rendering a chat template is Python (Jinja) and takes most of the time, so a process pool over chunks
uses every core; the tokenizer's own threads would only speed up the tokenizing part
(``benchmarks/bench_data_scale.py`` measures both). Workers run with ``TOKENIZERS_PARALLELISM=false``
so the two kinds of parallelism do not fight over the same cores.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import pyarrow as pa
from tqdm import tqdm

from twinkle.dataset.errors import DataError
from twinkle.dataset.readers import rows_to_columns

if TYPE_CHECKING:
    from twinkle.template.template import Template


@dataclass
class EncodeReport:
    rows_read: int = 0
    rows_written: int = 0
    dropped: int = 0  # deleted by the template (longer than max_length, truncation 'delete')
    max_rows_held: int = 0  # most rows read from the source but not yet written, at any moment


_template: Template | None = None  # a worker process's own copy, set once by _start_worker


def _start_worker(template: Template) -> None:
    global _template
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _template = template


def encode_chunk(
    rows: list[dict], first: int, add_generation_prompt: bool, template: Template | None = None
) -> tuple[pa.RecordBatch | None, int]:
    """One chunk of rows to (its record batch or None when every row was dropped, rows dropped)."""
    template = template or _template
    assert template is not None, "encode_chunk runs in a worker started by _start_worker, or is given the template"
    encoded = template.batch_encode(rows, add_generation_prompt=add_generation_prompt, first_index=first)
    kept = [e for e in encoded if e is not None]
    if not kept:
        return None, len(encoded)
    try:
        return pa.RecordBatch.from_pydict(rows_to_columns(kept)), len(encoded) - len(kept)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DataError(f"rows {first}..{first + len(rows) - 1}: encoded rows have inconsistent types: {e}") from None


def _cast(batch: pa.RecordBatch, schema: pa.Schema, first: int) -> pa.RecordBatch:
    """``batch`` in a schema at least as wide as its own (columns it lacks become nulls)."""
    columns = [
        batch.column(f.name) if f.name in batch.schema.names else pa.nulls(batch.num_rows, f.type) for f in schema
    ]
    try:
        return pa.RecordBatch.from_arrays([c.cast(f.type) for c, f in zip(columns, schema)], schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise DataError(f"rows from {first}: column types differ from earlier rows' ({e})") from None


def _widen(schema: pa.Schema, other: pa.Schema, first: int) -> pa.Schema:
    try:
        return pa.unify_schemas([schema, other], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DataError(f"rows from {first}: column types differ from earlier rows' ({e})") from None


class _Sink:
    """Writes record batches in order to one Arrow stream file and keeps the counts.

    Chunks can disagree in detail (a key or message field only later rows have, a column all None so
    far): a batch the current schema cannot hold losslessly starts a new segment in the widened
    schema, and at the end the segments are rewritten, batch by batch, into the final schema, so the
    file equals what one conversion of all rows would give."""

    def __init__(self, path: Path, report: EncodeReport, bar: tqdm) -> None:
        self.path, self.report, self.bar = path, report, bar
        self.writer = self.schema = None
        self.segments: list[Path] = []
        self.done = 0  # rows read and fully handled (written or dropped)

    def _start_segment(self, schema: pa.Schema) -> None:
        if self.writer is not None:
            self.writer.close()
        self.segments.append(self.path.with_name(f"{self.path.name}.part{len(self.segments)}"))
        self.schema, self.writer = schema, pa.ipc.new_stream(str(self.segments[-1]), schema)

    def put(self, result: tuple[pa.RecordBatch | None, int], n_rows: int, first: int) -> None:
        batch, dropped = result
        if batch is not None:
            if self.schema is None:
                self._start_segment(batch.schema)
            elif not batch.schema.equals(self.schema):
                wider = _widen(self.schema, batch.schema, first)
                if not wider.equals(self.schema):
                    self._start_segment(wider)
                batch = _cast(batch, self.schema, first)
            assert self.writer is not None  # _start_segment opened it for the first batch
            self.writer.write_batch(batch)
            self.report.rows_written += batch.num_rows
        self.report.dropped += dropped
        self.done += n_rows
        self.bar.update(n_rows)

    def close(self) -> None:
        if self.writer is None:  # nothing survived: an empty file that still reads back
            pa.ipc.new_stream(str(self.path), pa.schema([])).close()
            return
        self.writer.close()
        if len(self.segments) == 1:
            os.replace(self.segments[0], self.path)
            return
        with pa.ipc.new_stream(str(self.path), self.schema) as out:
            for segment in self.segments:
                with pa.memory_map(str(segment)) as source:
                    for batch in pa.ipc.open_stream(source):
                        out.write_batch(_cast(batch, self.schema, 0))
                segment.unlink()


def _chunks(rows: Iterable[dict], size: int, report: EncodeReport, sink: _Sink) -> Iterator[tuple[int, list[dict]]]:
    it = iter(rows)
    while chunk := list(itertools.islice(it, size)):
        first = report.rows_read
        report.rows_read += len(chunk)
        report.max_rows_held = max(report.max_rows_held, report.rows_read - sink.done)
        yield first, chunk


def encode_to_arrow(
    rows: Iterable[dict],
    template: Template,
    path: str | os.PathLike,
    *,
    add_generation_prompt: bool = False,
    num_proc: int = 1,
    chunk_rows: int = 1000,
    total: int | None = None,
    desc: str = "encode",
) -> tuple[datasets.Dataset, EncodeReport]:
    """Encode ``rows`` (any iterable, read once) with ``template`` into the Arrow file ``path``.

    Returns the encoded dataset, memory-mapped from ``path``, and an EncodeReport. ``num_proc`` > 1
    encodes chunks of ``chunk_rows`` in that many worker processes; the output order is the input's.
    A progress bar is drawn on stderr only when it is a terminal.
    """
    if num_proc < 1 or chunk_rows < 1:
        raise ValueError(f"num_proc and chunk_rows must be >= 1, got {num_proc} and {chunk_rows}")
    path = Path(path)
    report = EncodeReport()
    with tqdm(total=total, desc=desc, unit="row", disable=None) as bar:
        sink = _Sink(path, report, bar)
        try:
            chunks = _chunks(rows, chunk_rows, report, sink)
            if num_proc == 1:
                for first, chunk in chunks:
                    sink.put(encode_chunk(chunk, first, add_generation_prompt, template), len(chunk), first)
            else:
                _encode_in_pool(chunks, template, add_generation_prompt, num_proc, sink)
        finally:
            sink.close()
    return datasets.Dataset.from_file(str(path)), report


def _encode_in_pool(
    chunks: Iterable[tuple[int, list[dict]]],
    template: Template,
    add_generation_prompt: bool,
    num_proc: int,
    sink: _Sink,
) -> None:
    # fork where there is one (as datasets.map does): a worker starts in milliseconds and shares the
    # parent's pages; spawn would re-import transformers in every worker (seconds, and its own ~0.7 GB).
    # Workers touch only Jinja and the Rust tokenizer, never torch, so the parent's threads are no hazard.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(
        num_proc, mp_context=multiprocessing.get_context(method), initializer=_start_worker, initargs=(template,)
    )
    pending: deque[tuple[Future, int, int]] = deque()
    try:
        for first, chunk in chunks:
            pending.append((pool.submit(encode_chunk, chunk, first, add_generation_prompt), len(chunk), first))
            if len(pending) >= 2 * num_proc:  # bounded: wait for the oldest before reading more
                future, n, at = pending.popleft()
                sink.put(future.result(), n, at)
        while pending:
            future, n, at = pending.popleft()
            sink.put(future.result(), n, at)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
