"""Preprocessor (row ETL into the standard format) and Filter (keep / drop a row): base classes + registries.

The standard format is ``{"messages": [{"role", "content"}, ...]}`` plus optional ``tools`` (JSON
string), ``ground_truth`` (RL), ``rejected_messages`` (preference pairs) and anything carried along.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, ClassVar

from twinkle.dataset.errors import DataError
from twinkle.registry import Registry


def _describable(value: Any) -> bool:
    if isinstance(value, (str, int, float, bool, type(None))):
        return True
    if isinstance(value, (list, tuple)):
        return all(_describable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _describable(v) for k, v in value.items())
    return False


def config_key(obj: Any) -> str | None:
    """A stable description of an op (class + public settings), or None if it cannot be described
    (then results downstream of it are not cached)."""
    settings = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    if not _describable(settings):
        return None
    text = json.dumps([type(obj).__module__, type(obj).__qualname__, settings], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Preprocessor:
    """Turns one raw row into standard-format rows.

    Subclasses implement ``process(row) -> dict | list[dict] | None`` (None drops the row) and declare
    ``required_columns`` (checked before ``process`` so a missing column is reported by name) and
    ``output_columns`` (so an error about a missing column can name the preprocessors that make it).
    """

    required_columns: ClassVar[tuple[str, ...]] = ()
    output_columns: ClassVar[tuple[str, ...]] = ("messages",)

    def process(self, row: dict) -> dict | list[dict] | None:
        raise NotImplementedError

    def check_columns(self, row: dict, index: int | None = None) -> None:
        missing = [c for c in self.required_columns if c not in row]
        if missing:
            where = f"row {index}" if index is not None else "a row"
            raise DataError(
                f"{where} has no column {missing[0]!r}, which {type(self).__name__} reads "
                f"(needs {', '.join(self.required_columns)}; the row has "
                f"{', '.join(row) or 'no columns'})"
            )

    def __call__(self, rows: list[dict], first_index: int = 0) -> list[dict]:
        out: list[dict] = []
        for offset, row in enumerate(rows):
            self.check_columns(row, first_index + offset)
            result = self.process(row)
            if result is None:
                continue
            out.extend(result if isinstance(result, list) else [result])
        return out

    def cache_key(self) -> str | None:
        return config_key(self)


class FunctionPreprocessor(Preprocessor):
    """A plain ``row -> row`` callable used as a preprocessor (never cached: its code is opaque)."""

    def __init__(self, fn: Callable[[dict], dict | list[dict] | None]) -> None:
        self._fn = fn

    def process(self, row: dict) -> dict | list[dict] | None:
        return self._fn(row)

    def cache_key(self) -> None:
        return None


class Filter:
    """Keeps a row when ``keep(row)`` is true. Stateful filters (dedup) reset per pass via ``reset``."""

    def keep(self, row: dict) -> bool:
        raise NotImplementedError

    def reset(self) -> None:
        pass

    # ARG002: Preprocessor's signature; a filter keeps no index
    def __call__(self, rows: list[dict], first_index: int = 0) -> list[dict]:  # noqa: ARG002
        return [row for row in rows if self.keep(row)]

    def cache_key(self) -> str | None:
        return config_key(self)


class FunctionFilter(Filter):
    def __init__(self, fn: Callable[[dict], object]) -> None:
        self._fn = fn

    def keep(self, row: dict) -> bool:
        return bool(self._fn(row))

    def cache_key(self) -> None:
        return None


PREPROCESSORS: Registry[Preprocessor] = Registry("preprocessor", "twinkle.preprocessor", Preprocessor)
FILTERS: Registry[Filter] = Registry("filter", "twinkle.filter", Filter)


def producers_of(column: str) -> list[str]:
    """Names of registered preprocessors whose output has ``column``."""
    return [name for name in PREPROCESSORS.names() if column in getattr(PREPROCESSORS.get(name), "output_columns", ())]
