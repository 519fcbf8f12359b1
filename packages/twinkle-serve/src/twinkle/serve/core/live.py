"""The adapters alive in this server process, by training run (model_id): the runtime's one registry.

The store says which runs exist; this says which of them hold an adapter on a backend right now (a
restart empties it: a run must then be resumed from a checkpoint).
"""

from __future__ import annotations

import threading

from twinkle.serve.core.records import LiveAdapter


class LiveAdapters:
    def __init__(self):
        self._by_run: dict[str, LiveAdapter] = {}
        self._lock = threading.Lock()

    def get(self, model_id: str) -> LiveAdapter | None:
        with self._lock:
            return self._by_run.get(model_id)

    def put(self, model_id: str, live: LiveAdapter, replace: bool = True) -> None:
        with self._lock:
            if replace or model_id not in self._by_run:
                self._by_run[model_id] = live

    def pop(self, model_id: str) -> LiveAdapter | None:
        with self._lock:
            return self._by_run.pop(model_id, None)

    def run_ids(self) -> list[str]:
        with self._lock:
            return list(self._by_run)

    def count_on(self, base_model: str) -> int:
        with self._lock:
            return sum(1 for live in self._by_run.values() if live.base_model == base_model)
