"""The adapters alive in this server process, by training run (model_id): the runtime's one registry.

The store says which runs exist; this says which of them hold adapters on a backend right now, and
under which names (a restart empties it: a run must then be resumed from a checkpoint). A Tinker run
holds one adapter; a native run holds any number, each under the name its client gave it
(`add_adapter_to_model`), the first of them being the run's adapter where one is meant.
"""

from __future__ import annotations

import threading

from twinkle.serve.core.records import LiveAdapter


class LiveAdapters:
    def __init__(self):
        self._by_run: dict[str, dict[str, LiveAdapter]] = {}  # run -> {name -> adapter}, in the order added
        self._lock = threading.Lock()

    def get(self, model_id: str) -> LiveAdapter | None:
        """The run's adapter: its only one, or the first of a native run's that it still holds."""
        with self._lock:
            named = self._by_run.get(model_id)
            return next(iter(named.values())) if named else None

    def named(self, model_id: str) -> dict[str, LiveAdapter]:
        """The run's adapters by the names its client gave them (a Tinker run's one is named "")."""
        with self._lock:
            return dict(self._by_run.get(model_id, {}))

    def put(self, model_id: str, live: LiveAdapter, name: str = "") -> None:
        """`live` as the run's adapter `name` (a Tinker run's one adapter is unnamed: put replaces it)."""
        with self._lock:
            self._by_run.setdefault(model_id, {})[name] = live

    def remove(self, model_id: str, name: str) -> None:
        """The run no longer holds adapter `name`; a run left with none is no longer live."""
        with self._lock:
            named = self._by_run.get(model_id, {})
            named.pop(name, None)
            if not named:
                self._by_run.pop(model_id, None)

    def pop(self, model_id: str) -> None:
        """The run holds no adapter any more."""
        with self._lock:
            self._by_run.pop(model_id, None)

    def run_ids(self) -> list[str]:
        with self._lock:
            return list(self._by_run)

    def count_on(self, base_model: str) -> int:
        """Live runs on `base_model`'s backend."""
        with self._lock:
            return sum(1 for named in self._by_run.values() if next(iter(named.values())).base_model == base_model)
