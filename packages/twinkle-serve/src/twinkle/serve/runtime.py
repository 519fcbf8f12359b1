"""The server's parts wired together: store, keys, futures, limits, and one backend + worker per base model."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from twinkle.serve.backend import Backend, create_backend
from twinkle.serve.config import ModelEntry, ServeConfig
from twinkle.serve.errors import BadRequest
from twinkle.serve.futures import FutureHub
from twinkle.serve.keys import KeyStore
from twinkle.serve.limits import TenantLimits
from twinkle.serve.scheduler import Scheduler
from twinkle.serve.store import Store

log = logging.getLogger("twinkle.serve")


@dataclass
class Engine:
    entry: ModelEntry
    backend: Backend
    scheduler: Scheduler


class Runtime:
    def __init__(self, config: ServeConfig, data_dir: str | Path):
        self.config = config
        self.data_dir = Path(data_dir)
        self.store = Store(self.data_dir)
        self.keys = KeyStore(self.store)
        self.hub = FutureHub(self.store)
        self.limits = TenantLimits(config.limits, config.tenant_limits)
        self.engines: dict[str, Engine] = {}
        self.ready = threading.Event()
        # model_id -> (base model name, backend adapter name), for adapters alive in this process
        self.live: dict[str, tuple[str, str]] = {}
        self.live_lock = threading.Lock()

    def load_models(self) -> None:
        """Load every configured base model (slow: done once, before /healthz says ok)."""
        from twinkle.hub import resolve_model_path

        for entry in self.config.model_entries():
            path = entry.path or resolve_model_path(entry.name)
            backend = create_backend(entry.backend, entry.name, str(path), dtype=entry.dtype,
                                     max_batch_size=entry.max_sampler_batch)
            runner = backend.forward_backward_many if getattr(backend, "fuses", False) else None
            self.engines[entry.name] = Engine(entry, backend, Scheduler(self.hub, name=entry.name, fuse_runner=runner))
            log.info("serving base model %s from %s (backend %s)", entry.name, path, entry.backend)
        self.ready.set()

    def engine(self, base_model: str | None) -> Engine:
        if base_model is None and len(self.engines) == 1:
            return next(iter(self.engines.values()))
        if base_model not in self.engines:
            raise BadRequest(f"base model {base_model!r} is not served here; available: {sorted(self.engines)}")
        return self.engines[base_model]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.scheduler.stop()
        self.store.close()
