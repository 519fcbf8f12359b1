"""Filters: drop rows by token length, drop empty rows, drop exact duplicates."""

from __future__ import annotations

import hashlib
import json

from twinkle.dataset.errors import DataError
from twinkle.preprocessor.base import Filter


class LengthFilter(Filter):
    """Keep encoded rows with ``min_length <= len(input_ids) <= max_length``."""

    def __init__(self, max_length: int | None = None, min_length: int = 1) -> None:
        self.max_length = max_length
        self.min_length = min_length

    def keep(self, row: dict) -> bool:
        if "input_ids" not in row:
            raise DataError("LengthFilter counts tokens: call dataset.encode() before filtering by length")
        n = len(row["input_ids"])
        return n >= self.min_length and (self.max_length is None or n <= self.max_length)


class EmptyFilter(Filter):
    """Drop rows with nothing to learn: an empty conversation, a user or assistant turn with no text
    (and no tool calls), empty ``text``, or encoded labels that are all -100."""

    def keep(self, row: dict) -> bool:
        if "labels" in row and row["labels"] is not None:
            return any(t != -100 for t in row["labels"])
        if "messages" in row:
            messages = row["messages"] or []
            if not messages:
                return False
            for m in messages:
                if (
                    m.get("role") in ("user", "assistant")
                    and not (m.get("content") or "").strip()
                    and not m.get("tool_calls")
                ):
                    return False
            return True
        if "text" in row:
            return bool((row["text"] or "").strip())
        return any(v not in (None, "", [], {}) for v in row.values())


class DedupFilter(Filter):
    """Drop exact duplicates of ``columns`` (default: the whole row), keeping the first occurrence."""

    def __init__(self, columns: list[str] | None = None) -> None:
        self.columns = list(columns) if columns else None
        self._seen: set[bytes] = set()

    def reset(self) -> None:
        self._seen = set()

    def keep(self, row: dict) -> bool:
        key = {c: row.get(c) for c in self.columns} if self.columns else row
        digest = hashlib.blake2b(json.dumps(key, sort_keys=True, default=str).encode(), digest_size=16).digest()
        if digest in self._seen:
            return False
        self._seen.add(digest)
        return True
