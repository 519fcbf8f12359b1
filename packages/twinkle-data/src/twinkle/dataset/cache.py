"""The encode cache: encoded Arrow data saved under ``<twinkle cache>/encoded/<key>``.

The key hashes the data's lineage (source files with sizes and mtimes, slices, every preprocessor
and filter with its settings) and the template's signature (tokenizer, chat template, limits), so a
changed file, op or tokenizer misses the cache instead of serving stale tokens.

Encoding streams into an Arrow file (twinkle.dataset.arrow_encode), so memory stays bounded however
many rows there are; a cached result is memory-mapped from its file.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import datasets

from twinkle.dataset.arrow_encode import encode_to_arrow
from twinkle.dataset.loading import lineage_hash
from twinkle.hub import cache_root

if TYPE_CHECKING:
    from twinkle.template.template import Template

logger = logging.getLogger(__name__)
ENCODED_FILE = "encoded.arrow"
FORMAT = "arrow-stream-1"  # part of the key: folders written in an earlier layout are simply missed


def iter_part_rows(part: datasets.Dataset, batch_size: int) -> Iterator[dict]:
    for columns in part.iter(batch_size=batch_size):
        yield from (dict(zip(columns, values)) for values in zip(*columns.values()))


def _encode_into(
    folder: Path,
    part: datasets.Dataset,
    template: Template,
    add_generation_prompt: bool,
    batch_size: int,
    key: str,
    num_proc: int,
) -> datasets.Dataset:
    encoded, report = encode_to_arrow(
        iter_part_rows(part, batch_size),
        template,
        folder / ENCODED_FILE,
        add_generation_prompt=add_generation_prompt,
        num_proc=num_proc,
        chunk_rows=batch_size,
        total=len(part),
        desc=f"encode {key}",
    )
    if report.dropped:
        logger.warning(
            "%s: %d rows longer than max_length=%s were deleted (truncation_strategy='delete')",
            key,
            report.dropped,
            template.max_length,
        )
    return encoded


def encode_cached(
    part: datasets.Dataset,
    lineage: str | None,
    template: Template,
    add_generation_prompt: bool,
    batch_size: int,
    key: str,
    num_proc: int = 1,
) -> tuple[datasets.Dataset, str | None]:
    root = cache_root() / "encoded"
    root.mkdir(parents=True, exist_ok=True)
    if lineage is None:  # nothing to key a cache on: encode through a scratch file, keep the result in memory
        with tempfile.TemporaryDirectory(prefix=".uncached-", dir=root) as scratch:
            encoded = _encode_into(Path(scratch), part, template, add_generation_prompt, batch_size, key, num_proc)
            return datasets.Dataset.from_file(encoded.cache_files[0]["filename"], in_memory=True), None
    new_lineage = lineage_hash(lineage, template.signature(), add_generation_prompt)
    folder = root / lineage_hash(new_lineage, FORMAT)
    if (folder / ENCODED_FILE).exists():
        logger.info("%s: encoded rows loaded from cache %s", key, folder)
        return datasets.Dataset.from_file(str(folder / ENCODED_FILE)), new_lineage
    staging = Path(tempfile.mkdtemp(prefix=".encoding-", dir=root))
    try:
        _encode_into(staging, part, template, add_generation_prompt, batch_size, key, num_proc)
        os.rename(staging, folder)  # atomic: a concurrent writer of the same key simply loses the race
    except OSError:
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return datasets.Dataset.from_file(str(folder / ENCODED_FILE)), new_lineage
