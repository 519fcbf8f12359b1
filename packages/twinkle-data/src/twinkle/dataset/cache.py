"""The encode cache: encoded Arrow data saved under ``<twinkle cache>/encoded/<key>``.

The key hashes the data's lineage (source files with sizes and mtimes, slices, every preprocessor
and filter with its settings) and the template's signature (tokenizer, chat template, limits), so a
changed file, op or tokenizer misses the cache instead of serving stale tokens.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import datasets
from tqdm import tqdm

from twinkle.dataset.loading import _hash
from twinkle.hub import cache_root

logger = logging.getLogger(__name__)


def encode_rows(part: datasets.Dataset, template, add_generation_prompt: bool, batch_size: int,
                key: str) -> datasets.Dataset:
    from twinkle.dataset.dataset import apply_rows

    dropped = 0
    # On stderr only when it is a terminal (disable=None): logs and CI output stay clean.
    bar = tqdm(total=len(part), desc=f"encode {key}", unit="row", disable=None)

    def op(rows, first):
        nonlocal dropped
        encoded = template.batch_encode(rows, add_generation_prompt=add_generation_prompt, first_index=first)
        kept = [e for e in encoded if e is not None]
        dropped += len(encoded) - len(kept)
        bar.update(len(rows))
        return kept

    with bar:
        result = apply_rows(part, op, batch_size)
    if dropped:
        logger.warning("%s: %d rows longer than max_length=%s were deleted (truncation_strategy='delete')",
                       key, dropped, template.max_length)
    return result


def _quiet_save(data: datasets.Dataset, folder: str) -> None:
    from datasets import utils as hf_tqdm

    was_disabled = hf_tqdm.are_progress_bars_disabled()
    hf_tqdm.disable_progress_bars()  # a cache write is not worth a progress bar in the user's log
    try:
        data.save_to_disk(folder)
    finally:
        if not was_disabled:
            hf_tqdm.enable_progress_bars()


def encode_cached(part: datasets.Dataset, lineage: str | None, template, add_generation_prompt: bool,
                  batch_size: int, key: str) -> tuple[datasets.Dataset, str | None]:
    if lineage is None:
        return encode_rows(part, template, add_generation_prompt, batch_size, key), None
    new_lineage = _hash(lineage, template.signature(), add_generation_prompt)
    folder = cache_root() / "encoded" / new_lineage
    if (folder / "dataset_info.json").exists():
        cached = datasets.load_from_disk(str(folder))
        if isinstance(cached, datasets.Dataset):  # anything else there is not ours: encode again
            logger.info("%s: encoded rows loaded from cache %s", key, folder)
            return cached, new_lineage
    encoded = encode_rows(part, template, add_generation_prompt, batch_size, key)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".encoding-", dir=folder.parent)
    try:
        _quiet_save(encoded, staging)
        os.rename(staging, folder)  # atomic: a concurrent writer of the same key simply loses the race
    except OSError:
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return encoded, new_lineage
