"""A multi-LoRA backend's side of adapter residency: the engine lock and the hooks the server's
adapter-memory policy (twinkle.serve.core.adapter_memory) drives.

Every engine operation holds the backend's lock (`exclusive`), so the residency sweeper, which
runs on its own thread, parks or spills adapters only between two operations, never inside one.
"""

from __future__ import annotations

import functools
from typing import Any


def exclusive(method):
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._engine_lock:
            return method(self, *args, **kwargs)

    return locked


class ResidentAdapters:
    """Mixin for a backend with an in-process `engine` (a MultiLoraModel) and an `_engine_lock`."""

    engine: Any
    _engine_lock: Any
    holds_adapters_here = True

    @property
    def engine_lock(self):
        """The lock every engine call holds (`exclusive`): a caller that runs several calls as one unit
        (a pass split into micro-batches) holds it across them."""
        return self._engine_lock

    def enable_residency(self, spill_dir, make_room) -> None:
        """`make_room(residency, name, pinned)` runs before an adapter is built or brought back."""
        self.engine.enable_spill(spill_dir)
        self.engine.residency.make_room = functools.partial(make_room, self.engine.residency)

    @exclusive
    def with_residency(self, fn) -> None:
        fn(self.engine.residency)

    def residency_report(self) -> tuple[dict, dict]:
        """(adapters per tier, swap counters), read without the lock: numbers at most one pass old."""
        residency = self.engine.residency
        return residency.counts(), residency.stats.as_dict()
