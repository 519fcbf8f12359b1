"""A multi-LoRA backend's side of adapter residency: the engine lock and the hooks the server's
adapter-memory policy (twinkle.serve.core.adapter_memory) drives.

Every engine operation holds the backend's lock (`exclusive`), so the residency sweeper, which
runs on its own thread, parks or spills adapters only between two operations, never inside one.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any


class EngineLock:
    """A re-entrant lock that the thread holding it can let go of whole while its pass waits for its
    next turn (twinkle.model.preemption), however deeply it holds it, and take back as it was."""

    def __init__(self):
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._depth = 0  # how deeply the owner holds it; changed only by the owner

    def __enter__(self) -> EngineLock:
        self._lock.acquire()
        self._owner = threading.get_ident()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if not self._depth:
            self._owner = None
        self._lock.release()

    def let_go(self) -> Callable[[], None]:
        """Release it entirely if this thread holds it; -> what takes it back to the same depth."""
        if self._owner != threading.get_ident():
            return lambda: None
        depth, self._depth, self._owner = self._depth, 0, None
        for _ in range(depth):
            self._lock.release()

        def take_back() -> None:
            for _ in range(depth):
                self._lock.acquire()
            self._owner, self._depth = threading.get_ident(), depth

        return take_back


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

    @property
    def engine_lock(self):
        """The lock every engine call holds (`exclusive`): a caller that runs several calls as one unit
        (a pass split into micro-batches) holds it across them."""
        return self._engine_lock

    def enable_residency(self, spill_dir, make_room) -> bool:
        """`make_room(residency, name, pinned)` runs before an adapter is built or brought back."""
        self.engine.enable_spill(spill_dir)
        self.engine.residency.make_room = functools.partial(make_room, self.engine.residency)
        return True

    @exclusive
    def with_residency(self, fn) -> None:
        fn(self.engine.residency)

    def residency_report(self) -> tuple[dict, dict]:
        """(adapters per tier, swap counters), read without the lock: numbers at most one pass old."""
        residency = self.engine.residency
        return residency.counts(), residency.stats.as_dict()
