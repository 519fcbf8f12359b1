"""DatasetMeta: which data to load: an id (hub, bundled, local path) or in-memory rows, plus a split and slice."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class DatasetMeta:
    """Where one dataset comes from.

    dataset_id: ``twinkle://self-cognition``, ``twinkle://arithmetic``, ``hf://org/name``, ``ms://org/name``,
        a local file or folder, or (with ``data``) just a name for the rows.
    subset_name: a configuration (hub) or sub-folder (local).
    split: ``train``, ``test``, ...
    data_slice: rows to keep: a ``range``, ``slice`` or list of row indices. ``range(N)`` longer than the
        data repeats it (row ``i % len``), as twinkle-kit does; any other index past the end is an error.
    data: in-memory rows (a list of dicts, a dict of columns or a ``datasets.Dataset``) instead of a path.
    """

    dataset_id: str | None = None
    subset_name: str | None = None
    split: str = "train"
    data_slice: range | slice | Sequence[int] | None = None
    data: Any = None

    def __post_init__(self) -> None:
        if self.dataset_id is None and self.data is None:
            raise ValueError("DatasetMeta needs a dataset_id or in-memory data")
        if self.dataset_id is None:
            self.dataset_id = "memory"

    @property
    def key(self) -> str:
        """A readable identity: ``id[:subset]/split``; names a part of a mixed Dataset."""
        subset = f":{self.subset_name}" if self.subset_name else ""
        return f"{self.dataset_id}{subset}/{self.split}"
