"""Dataset: load one or more sources, preprocess, filter, mix and encode them for training.

Operations run at once on Arrow-backed data (``streaming=False``) and lazily, row batch by row batch,
on streamed data. Methods return ``self`` so calls can be chained or written as statements.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import datasets

from twinkle.dataset.cache import encode_cached
from twinkle.dataset.errors import DataError
from twinkle.dataset.loading import Part, lineage_hash, load_part, rows_to_dataset
from twinkle.dataset.meta import DatasetMeta
from twinkle.dataset.mixing import mix_order, mix_streams
from twinkle.dataset.stream import BatchOp, RowStream

if TYPE_CHECKING:
    from twinkle.preprocessor.base import Filter, Preprocessor
    from twinkle.template.template import Template

logger = logging.getLogger(__name__)
ERROR_KEY = "_twinkle_error"  # a streamed row that failed encoding carries its reason here


def apply_rows(
    part: datasets.Dataset, op: Callable[[list[dict], int], list[dict]], batch_size: int = 1000
) -> datasets.Dataset:
    """Run a batched row op over an Arrow dataset and rebuild it from the output rows."""
    out: list[dict] = []
    first = 0
    for columns in part.iter(batch_size=batch_size):
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
        out.extend(op(rows, first))
        first += len(rows)
    if not out:
        return datasets.Dataset.from_dict({})
    return rows_to_dataset(out)


class Dataset:
    """One or more data sources behind the standard row format.

    ``Dataset(DatasetMeta('twinkle://self-cognition', data_slice=range(100)))``; ``add_dataset`` adds
    more sources; ``mix_dataset`` combines them (otherwise they are concatenated on first read).
    """

    def __init__(
        self, dataset_meta: DatasetMeta | str | None = None, *, streaming: bool = False, batch_size: int = 256
    ) -> None:
        self.streaming = streaming
        self.batch_size = batch_size
        self.template: Template | None = None
        self._parts: dict[str, Part] = {}
        self._lineage: dict[str, str | None] = {}
        if dataset_meta is not None:
            self.add_dataset(dataset_meta)

    # ---- sources -------------------------------------------------------------------------------
    def add_dataset(self, dataset_meta: DatasetMeta | str) -> Dataset:
        meta = DatasetMeta(dataset_meta) if isinstance(dataset_meta, str) else dataset_meta
        key = meta.key
        while key in self._parts:  # the same source twice (e.g. two slices) gets its own key
            key += "+"
        self._parts[key], self._lineage[key] = load_part(meta, self.streaming)
        return self

    @property
    def keys(self) -> list[str]:
        return list(self._parts)

    def _targets(self, dataset_meta: DatasetMeta | str | None) -> list[str]:
        if dataset_meta is None:
            return list(self._parts)
        key = dataset_meta if isinstance(dataset_meta, str) else dataset_meta.key
        if key not in self._parts:
            raise KeyError(f"no dataset {key!r} here; have: {', '.join(self._parts)}")
        return [key]

    def _apply(self, op: BatchOp, dataset_meta: DatasetMeta | str | None, describe: str | None) -> None:
        for key in self._targets(dataset_meta):
            part = self._parts[key]
            if isinstance(part, RowStream):
                self._parts[key] = part.with_op(op)
            else:
                self._parts[key] = apply_rows(part, op, self.batch_size)
            lineage = self._lineage[key]
            self._lineage[key] = lineage_hash(lineage, describe) if lineage and describe else None

    # ---- ops -----------------------------------------------------------------------------------
    def map(
        self,
        preprocessor: Preprocessor | type[Preprocessor] | str | Callable[[dict], dict | list[dict] | None],
        dataset_meta: DatasetMeta | str | None = None,
        init_args: dict[str, Any] | None = None,
        *,
        batched: bool = True,  # noqa: ARG002 - twinkle-kit's keyword, see the docstring
        load_from_cache_file: bool = True,  # noqa: ARG002 - twinkle-kit's keyword, see the docstring
        **kwargs: Any,
    ) -> Dataset:
        """Apply a Preprocessor (instance, class, registered name or plain ``row -> row`` function);
        a class or name is built with ``init_args`` or ``kwargs``. Rows are always processed in
        batches and a map is never read from a cache, so ``batched`` and ``load_from_cache_file``
        (twinkle-kit's names) change nothing."""
        preprocessor = build_preprocessor(preprocessor, init_args, kwargs)
        self._apply(preprocessor, dataset_meta, preprocessor.cache_key())
        return self

    def filter(
        self,
        filter_: Filter | type[Filter] | str | Callable[[dict], bool],
        dataset_meta: DatasetMeta | str | None = None,
        **kwargs: Any,
    ) -> Dataset:
        """Keep rows a Filter (instance, class, name or ``row -> bool`` function) accepts."""
        from twinkle.preprocessor.base import FILTERS, Filter, FunctionFilter

        if isinstance(filter_, (str, Filter, type)) or not callable(filter_):
            # a name, class or instance; the registry refuses anything else by name
            filter_ = FILTERS.create(cast("str | type[Filter] | Filter", filter_), **kwargs)
        else:
            filter_ = FunctionFilter(filter_)
        filter_.reset()
        self._apply(filter_, dataset_meta, filter_.cache_key())
        return self

    def set_template(
        self,
        template: Template | type[Template] | str,
        model_id: str | None = None,
        max_length: int | None = None,
        **kwargs: Any,
    ) -> Dataset:
        """Choose the Template (instance, class or registered name) that ``encode`` uses."""
        from twinkle.template import TEMPLATES, Template

        if isinstance(template, Template):
            self.template = template
        else:
            self.template = TEMPLATES.get(template)(model_id=model_id, max_length=max_length, **kwargs)
        return self

    def encode(
        self,
        add_generation_prompt: bool = False,
        cache: bool = True,
        num_proc: int = 1,
        *,
        batched: bool = True,  # noqa: ARG002 - twinkle-kit's keyword: rows are encoded in batches
        load_from_cache_file: bool | None = None,
    ) -> Dataset:
        """Tokenize every row with the template: ``input_ids`` and ``labels`` (or, with
        ``add_generation_prompt``, prompts for sampling). Arrow data is encoded chunk by chunk into an
        Arrow file (``num_proc`` worker processes; memory bounded whatever the row count), cached on
        disk by lineage and memory-mapped; streamed data is encoded lazily as it is read.
        ``load_from_cache_file`` (twinkle-kit's name) is ``cache`` when given; rows are always encoded
        in batches, so ``batched`` changes nothing."""
        if load_from_cache_file is not None:
            cache = load_from_cache_file
        if self.template is None:
            raise DataError("encode() needs a template: call dataset.set_template(...) first")
        template = self.template
        for key, part in list(self._parts.items()):
            if isinstance(part, RowStream):
                self._parts[key] = part.with_op(lazy_encoder(template, add_generation_prompt, key))
                self._lineage[key] = None
                continue
            lineage = self._lineage[key] if cache else None
            self._parts[key], self._lineage[key] = encode_cached(
                part, lineage, template, add_generation_prompt, self.batch_size, key, num_proc
            )
        return self

    def mix_dataset(
        self,
        strategy: str = "concat",
        probabilities: Sequence[float] | None = None,
        seed: int = 0,
        stopping_strategy: str = "first_exhausted",
        num_samples: int | None = None,
    ) -> Dataset:
        """Combine all parts into one: ``concat``, ``interleave`` (round robin) or ``weighted``
        (random choice by ``probabilities``, reproducible with ``seed``)."""
        if len(self._parts) < 2:
            return self
        parts = list(self._parts.values())
        tables = [p for p in parts if isinstance(p, datasets.Dataset)]
        if len(tables) < len(parts):
            streams = parts
            mixed: Part = RowStream(
                lambda: mix_streams(streams, strategy, probabilities, seed, stopping_strategy),
                batch_size=self.batch_size,
            )
            lineage = None
        else:
            order = list(
                mix_order([len(p) for p in tables], strategy, probabilities, seed, stopping_strategy, num_samples)
            )
            try:
                combined = datasets.concatenate_datasets(tables)
            except ValueError:  # features differ in detail (e.g. optional struct fields): unify via rows
                combined = rows_to_dataset([row for p in tables for row in p.to_list()])
            offsets = [0]
            for p in tables[:-1]:
                offsets.append(offsets[-1] + len(p))
            mixed = combined.select([offsets[part] + row for part, row in order])
            lineages = list(self._lineage.values())
            lineage = (
                lineage_hash(lineages, strategy, probabilities, seed, stopping_strategy, num_samples)
                if all(lineages)
                else None
            )
        name = f"mixed({strategy})"
        self._parts, self._lineage = {name: mixed}, {name: lineage}
        return self

    # ---- reading -------------------------------------------------------------------------------
    @property
    def data(self) -> Part:
        """The single combined part (several unmixed parts are concatenated here)."""
        if not self._parts:
            raise DataError("this Dataset has no data: pass a DatasetMeta or call add_dataset")
        if len(self._parts) > 1:
            self.mix_dataset("concat")
        return next(iter(self._parts.values()))

    def __len__(self) -> int:
        data = self.data
        if isinstance(data, RowStream):
            raise TypeError("a streamed Dataset has no length; iterate it instead")
        return len(data)

    def __getitem__(self, index: int) -> dict:
        data = self.data
        if isinstance(data, RowStream):
            raise TypeError("a streamed Dataset has no random access; iterate it instead")
        return data[int(index)]

    def __iter__(self) -> Iterator[dict]:
        return iter(self.data)

    @property
    def column_names(self) -> list[str]:
        data = self.data
        return [] if isinstance(data, RowStream) else list(data.column_names)

    def __repr__(self) -> str:
        sizes = {k: ("stream" if isinstance(p, RowStream) else len(p)) for k, p in self._parts.items()}
        return f"Dataset({sizes}, template={type(self.template).__name__ if self.template else None})"


def build_preprocessor(
    preprocessor: Preprocessor | type[Preprocessor] | str | Callable[[dict], dict | list[dict] | None],
    init_args: dict[str, Any] | None = None,
    kwargs: dict[str, Any] | None = None,
) -> Preprocessor:
    """A Preprocessor from an instance, class, registered name or plain ``row -> row`` function; a class
    or name is built with ``init_args`` or ``kwargs`` (not both)."""
    from twinkle.preprocessor.base import PREPROCESSORS, FunctionPreprocessor, Preprocessor

    kwargs = kwargs or {}
    if init_args is not None:
        if kwargs:
            raise TypeError(f"map() got both init_args and keyword arguments {sorted(kwargs)}: pass one of them")
        kwargs = dict(init_args)
    if isinstance(preprocessor, (str, Preprocessor, type)) or not callable(preprocessor):
        # a name, class or instance; the registry refuses anything else by name
        return PREPROCESSORS.create(cast("str | type[Preprocessor] | Preprocessor", preprocessor), **kwargs)
    return FunctionPreprocessor(preprocessor)


def lazy_encoder(template: Template, add_generation_prompt: bool, key: str) -> BatchOp:
    """Encode a streamed batch; a row that fails is kept with its reason so the DataLoader can skip
    and log it instead of the stream dying mid-epoch."""

    def op(rows: list[dict], first: int) -> list[dict]:
        out = []
        for i, row in enumerate(rows):
            try:
                encoded = template.encode_prompt(row) if add_generation_prompt else template.encode(row)
            except DataError as e:
                out.append({ERROR_KEY: f"{key} row {first + i}: {e}"})
                continue
            if encoded is not None:
                out.append(encoded)
        return out

    return op
