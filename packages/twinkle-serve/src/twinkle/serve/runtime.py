"""The server's parts wired together: store, keys, futures, limits, and one backend + worker per base model."""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from twinkle.serve.backend import Backend, create_backend
from twinkle.serve.config import ModelEntry, ServeConfig
from twinkle.serve.core.adapter_memory import AdapterMemory
from twinkle.serve.core.futures import FutureHub
from twinkle.serve.core.live import LiveAdapters
from twinkle.serve.core.scheduler import Scheduler
from twinkle.serve.core.store import Store
from twinkle.serve.core.throughput import Throughput
from twinkle.serve.errors import BadRequest, ServiceUnavailable
from twinkle.serve.keys import KeyStore
from twinkle.serve.limits import TenantLimits
from twinkle.serve.prometheus import ServerMetrics
from twinkle.serve.run_trackers import RunTrackers

log = logging.getLogger("twinkle.serve")


@dataclass
class Engine:
    entry: ModelEntry
    backend: Backend
    scheduler: Scheduler


def _load_failure(entry: ModelEntry, path, error: Exception) -> str:
    """The operator-facing reason a base model did not load (custom model code refused, named as such)."""
    text = str(error)
    if "trust_remote_code" in text and not entry.trust_remote_code:
        return (
            f"base model {entry.name!r} ({path}) ships its own code (config.json auto_map), which this server "
            "does not run unless the operator opts in: set `trust_remote_code: true` on that model's entry in "
            f"the server config if you trust it. transformers said: {text}"
        )
    return f"loading base model {entry.name!r} from {path} failed: {type(error).__name__}: {text}"


class ServerRuntime:
    """One server's state, shared by every API: its config, store, keys, futures, limits, adapter
    memory, and an engine (backend + scheduler) per base model. (twinkle.mesh's Runtime is the
    library's placement of ranks; this is the server's.)"""

    def __init__(self, config: ServeConfig, data_dir: str | Path):
        self.config = config
        self.data_dir = Path(data_dir)
        self.store = Store(self.data_dir)
        self.trackers = None
        if config.report_to:
            self.trackers = RunTrackers(config.report_to, self.data_dir / "runs")
            self.store.curves.on_add = self.trackers.log
        self.keys = KeyStore(self.store)
        self.hub = FutureHub(self.store, config.futures_keep_hours * 3600)
        self.limits = TenantLimits(config.limits, config.tenant_limits)
        self.engines: dict[str, Engine] = {}
        self.ready = threading.Event()
        self.live = LiveAdapters()  # training runs with an adapter in this process
        self.adapter_memory = AdapterMemory.from_config(config, self.data_dir)  # one account for both APIs
        self.throughput = Throughput()
        self.metrics = ServerMetrics()
        self.metrics.watch(self)
        self._retain()
        self.load_error: str | None = None  # why load_models failed, for the routes that answer 503
        self._ray_started = self._owns_ray = False
        self.draining = False  # set by the first SIGTERM: submissions answer 503 (server.py)

    def _retain(self) -> None:
        """What every long-lived structure holds, on /metrics: each is bounded (a cap, a retention window,
        or the keys and adapters that exist), so none may climb with the request count (the soak checks)."""
        engines = self.engines.values
        for structure, count in {
            "futures": self.store.futures.count,
            "future waiters": self.hub.waiting,
            "idempotency answers": self.store.idempotency.count,
            "curve points": self.store.curves.rows,
            "rate buckets": self.limits.buckets,
            "live adapters": lambda: len(self.live.run_ids()),
            "adapter reservations": self.adapter_memory.reservations,
            "scheduler queues": lambda: sum(e.scheduler.queues() for e in engines()),
            "sampler adapters": lambda: sum(e.backend.sampler_adapters() for e in engines()),
        }.items():
            self.metrics.retain(structure, count)

    def load_models(self) -> None:
        """Load every configured base model (slow: done once, before /healthz says ok)."""
        from twinkle.hub import resolve_model_path

        for entry in self.config.model_entries():
            path = entry.path or resolve_model_path(entry.name)
            remote = {}
            if entry.remote_group or entry.sampler_remote_group:
                # a configured path is every node's; a hub id each rank resolves on its own node
                remote = dict(
                    remote_group=entry.remote_group,
                    sampler_remote_group=entry.sampler_remote_group,
                    shard_model_path=entry.path,
                    call_timeout_s=self.config.ray.call_timeout_s if self.config.ray else None,
                )
            try:
                backend = create_backend(
                    entry.name,
                    str(path),
                    entry.backend,
                    dtype=entry.dtype,
                    max_batch_size=entry.max_sampler_batch,
                    trust_remote_code=entry.trust_remote_code,
                    activation_checkpointing=entry.activation_checkpointing,
                    **remote,
                )
            except Exception as e:
                reason = _load_failure(entry, path, e)
                log.error("%s", reason)  # logged before it is published: whoever reads the 503 finds it here too
                self.load_error = reason
                raise RuntimeError(reason) from e
            scheduler = Scheduler(
                self.hub,
                name=entry.name,
                fuse_runner=backend.forward_backward_many,
                planner=self.config.fusion.planner(),
                on_pass=functools.partial(self.metrics.observe_pass, entry.name),
                slice_runner=backend.forward_backward_sliced,
            )
            self.engines[entry.name] = Engine(entry, backend, scheduler)
            self.adapter_memory.manage(backend)  # residency: idle adapters off the model, LRU under the cap
            log.info(
                "serving base model %s from %s (multi-LoRA%s)",
                entry.name,
                path,
                f", training on Ray group {entry.remote_group!r}, sampling on {entry.sampler_remote_group!r}"
                if remote
                else "",
            )
        self.ready.set()

    def start_cluster(self) -> None:
        """With a `ray` section: `twinkle.mesh.initialize(mode='ray')` over its groups (joining the Ray
        at `address`, a Ray this process already runs, or starting a local one); models then place
        their training model / sampler on those groups as remote groups."""
        if self.config.ray is None:
            return
        import twinkle.mesh as mesh
        from twinkle.mesh.runtime import require_ray

        self._owns_ray = not require_ray().is_initialized()
        groups = [
            mesh.DeviceGroup(
                g.name, g.ranks, g.device_type, {"CPU": g.cpus_per_rank} if g.cpus_per_rank else {}, g.placement
            )
            for g in self.config.ray.groups
        ]
        mesh.initialize(mode="ray", groups=groups, address=self.config.ray.address)
        self._ray_started = True
        log.info("Ray mode: groups %s", ", ".join(f"{g.name}={g.ranks}x{g.device_type}" for g in groups))

    def _stop_cluster(self) -> None:
        if not self._ray_started:
            return
        import twinkle.mesh as mesh

        rt = mesh.get_runtime()
        if self._owns_ray:
            mesh.shutdown()  # our actors, then the Ray we started
        elif rt is not None and rt.mode == "ray":  # a Ray someone else runs: release only what we took
            from ray.util.placement_group import remove_placement_group

            for pg in rt.placements.values():
                remove_placement_group(pg)
            rt.placements.clear()
        self._ray_started = False

    def begin_drain(self) -> None:
        self.draining = True

    def drain(self, timeout: float) -> int:
        """Wait until every worker's queue is empty (the passes running finish in stop()), at most
        `timeout` s; -> requests still queued."""
        deadline = time.monotonic() + timeout
        while (left := sum(e.scheduler.depth() for e in self.engines.values())) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def require_ready(self) -> None:
        """503 unless the models are loaded: a failed load says why (no Retry-After: it will not fix
        itself, the operator must), a load in progress asks the client to come back."""
        if self.draining:
            raise ServiceUnavailable(
                "the server is shutting down: it finishes the requests it already accepted and takes no new "
                "ones; send this again once it has restarted",
                {"Retry-After": "5"},
            )
        if self.load_error is not None:
            raise ServiceUnavailable(f"this server could not load its models: {self.load_error}")
        if not self.ready.is_set():
            raise ServiceUnavailable("the server is still loading its models", {"Retry-After": "2"})

    def engine(self, base_model: str | None) -> Engine:
        if base_model is None and len(self.engines) == 1:
            return next(iter(self.engines.values()))
        if base_model not in self.engines:
            raise BadRequest(f"base model {base_model!r} is not served here; available: {sorted(self.engines)}")
        return self.engines[base_model]

    def close(self) -> None:
        self.draining = True
        self.drain(self.config.drain_s)  # what was accepted on connections uvicorn let finish
        for engine in self.engines.values():
            engine.scheduler.stop()
            engine.backend.close()
        self._stop_cluster()
        if self.trackers is not None:
            self.trackers.close()
        self.store.close()
