"""The server-wide cap on LoRA adapter memory (`max_adapter_memory_mb`): estimate, reserve, and keep
the live adapters under it.

An adapter's cost is known before it is built: rank x (in + out) parameters for every targeted
Linear of the base model, each held four times (weights, gradients, two Adam moments).

With `adapter_offload` (the default) the cap counts only live adapters: before an adapter is built
or brought back, the least recently used live ones of that base model are parked (weights and
optimizer state to host memory, off the model; twinkle.model.multi_lora.residency), and past
`max_parked_adapter_memory_mb` the least recently parked go on to disk. Idle timers do the same
without pressure. Only an adapter larger than the whole cap is refused. With offload off, a new
adapter that would push the total past the cap is refused, as before residency existed.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from twinkle.model.multi_lora.residency import LIVE, PARKED, SPILLED
from twinkle.model.multi_lora.spec import linear_names
from twinkle.model.structure import Structure, describe
from twinkle.serve.backend import LoraSpec
from twinkle.serve.errors import ApiError

COPIES = 4  # weights, grads, Adam exp_avg, exp_avg_sq


class AdapterMemoryFull(ApiError):
    status = 409


@dataclass(frozen=True)
class _BaseShape:
    """A base model's LoRA-relevant shape: its structure, each Linear's in + out, and each 3-D expert
    weight's experts x (in + out) (its A is [experts * r, in], its B [out, r * experts])."""

    structure: Structure
    linears: dict[str, int]
    experts: dict[str, int]

    @classmethod
    def of(cls, base) -> _BaseShape:
        structure = describe(base)
        params = dict(base.named_parameters())
        linears = {}
        for name in linear_names(base):
            linear = base.get_submodule(name)
            linear = getattr(linear, "base_layer", linear)
            linears[name] = linear.in_features + linear.out_features
        experts = {}
        for part in structure.of("experts"):
            owner, _, param = part.name.rpartition(".")
            name = part.name if part.name in params else f"{owner}.base_layer.{param}"  # wrapped: its base_layer
            e, d1, d2 = params[name].shape
            experts[part.name] = e * (d1 + d2)
        return cls(structure, linears, experts)


class AdapterMemory:
    """One server-wide account: every route that builds an adapter (Tinker create_model, native
    add_adapter_to_model / load) reserves under its own key first and releases it when freed. The
    backends it `manage`s call `make_room` (on their worker) before an adapter becomes live."""

    def __init__(
        self,
        cap_mb: float | None,
        *,
        offload: bool = False,
        idle_park_s: float | None = None,
        idle_spill_s: float | None = None,
        parked_cap_mb: float | None = None,
        spill_dir: Path | None = None,
    ):
        self.cap = None if cap_mb is None else int(cap_mb * 2**20)
        self.offload, self.idle_park_s, self.idle_spill_s = offload, idle_park_s, idle_spill_s
        self.parked_cap = None if parked_cap_mb is None else int(parked_cap_mb * 2**20)
        self.spill_dir = spill_dir
        self._held: dict[str, int] = {}  # every reserved adapter, wherever it lives
        self._live: set[str] = set()  # the reserved adapters counted against the cap: live on their model
        self._lock = threading.Lock()
        self._backends: weakref.WeakSet = weakref.WeakSet()
        self._parkable: weakref.WeakSet = weakref.WeakSet()  # those whose adapters the policy parks (offload)
        self._sweeper: threading.Thread | None = None
        self._shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base module -> _BaseShape

    @classmethod
    def from_config(cls, config, data_dir: Path) -> AdapterMemory:
        return cls(
            config.max_adapter_memory_mb,
            offload=config.adapter_offload,
            idle_park_s=config.adapter_idle_offload_s,
            idle_spill_s=config.adapter_idle_spill_s,
            parked_cap_mb=config.max_parked_adapter_memory_mb,
            spill_dir=Path(config.adapter_spill_dir or Path(data_dir) / "adapter_spill"),
        )

    def estimate(self, backend, spec, element_bytes: int = 4) -> int | None:
        """Bytes for a Tinker `LoraSpec`, or for a peft `LoraConfig` (the native API's, which may name
        modules by list, regex or 'all-linear'; matched exactly as the multi-LoRA engine will)."""
        base = backend.base_module
        if base is None:  # a backend whose base model is not in this process: no estimate, no cap
            return None
        from peft import LoraConfig

        from twinkle.model.multi_lora.spec import AdapterSpec

        shape = self._shape(base)
        if isinstance(spec, LoraSpec):  # its flags name modules (and expert weights) through the structure
            spec = LoraConfig(
                r=spec.rank,
                target_modules=spec.target_modules(shape.structure),
                target_parameters=spec.target_parameters(shape.structure) or None,
            )
        adapter = AdapterSpec.from_lora_config(spec)
        chosen = adapter.select_from(list(shape.linears), shape.structure)  # ValueError: the caller's config
        width = sum(shape.linears[name] for name in chosen)
        width += sum(shape.experts[name] for name in adapter.select_parameters_from(set(shape.experts)))
        return width * spec.r * element_bytes * COPIES

    def _shape(self, base) -> _BaseShape:
        """What estimates read of a base model, taken once (`manage` takes it at load, before any
        adapter exists): request threads never walk the module tree the worker is wrapping."""
        with self._lock:
            shape = self._shapes.get(base)
        if shape is None:
            shape = _BaseShape.of(base)
            with self._lock:
                self._shapes[base] = shape
        return shape

    def reserve(self, key: str, backend, spec) -> None:
        if self.cap is None:
            return
        need = self.estimate(backend, spec)
        if need is None:
            return
        rank = spec.rank if isinstance(spec, LoraSpec) else spec.r
        # an adapter of a model whose adapters can be parked counts once it is live (make_room)
        resident = backend in self._parkable
        with self._lock:
            used = sum(self._held[k] for k in self._live if k != key and k in self._held)
            if need > self.cap if resident else used + need > self.cap:
                in_use = "" if resident else f"{used / 2**20:.2f} MiB of "
                raise AdapterMemoryFull(
                    f"adapter memory is full: this LoRA (rank {rank}) needs {need / 2**20:.2f} MiB, "
                    f"{in_use}the server's {self.cap / 2**20:.2f} MiB (max_adapter_memory_mb) "
                    + (
                        "cannot hold it even with every other adapter parked; use a smaller rank"
                        if resident
                        else "are in use; finish a session (or close a model) to free its adapters, or use a smaller rank"
                    )
                )
            self._held[key] = need
            if not resident:
                self._live.add(key)

    def used(self) -> int:
        """Bytes counted against the cap: the live adapters (every reserved one where none can be parked)."""
        with self._lock:
            return sum(self._held[k] for k in self._live)

    def reservations(self) -> int:
        with self._lock:
            return len(self._held)

    def release(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)
            self._live.discard(key)

    # ---- residency (with offload): called on a backend's worker, under its engine lock --------------
    def manage(self, backend) -> None:
        """Keep `backend`'s live adapters under the cap (those it holds in this process)."""
        self._backends.add(backend)  # reported on: its tiers (none where its adapters live on remote ranks)
        if backend.base_module is not None:
            self._shape(backend.base_module)  # read here, on the worker, before any adapter wraps it
        if not self.offload:
            return
        spill_dir = self.spill_dir or Path(tempfile.mkdtemp(prefix="twinkle-adapter-spill-"))
        folder = spill_dir / re.sub(r"[^A-Za-z0-9_.-]", "_", backend.base_model)
        shutil.rmtree(folder, ignore_errors=True)  # the server's own: nothing spilled outlives a restart
        if not backend.enable_residency(folder, self.make_room):
            return  # its adapters live on remote ranks: reserved against the cap, never parked
        self._parkable.add(backend)
        timers = [t for t in (self.idle_park_s, self.idle_spill_s) if t is not None]
        if timers and self._sweeper is None:
            period = min(max(min(timers) / 4, 0.05), 5.0)
            self._sweeper = threading.Thread(
                target=self._sweep_loop, args=(period,), name="twinkle-residency", daemon=True
            )
            self._sweeper.start()

    def make_room(self, residency, key: str, pinned: set[str]) -> None:
        """Park this model's least recently used live adapters (never `pinned`) until `key` fits."""
        with self._lock:
            need = self._held.get(key, 0)
            used = sum(self._held[k] for k in self._live if k != key and k in self._held)
        if self.cap is not None:
            for victim in residency.least_recent():
                if used + need <= self.cap:
                    break
                if victim in pinned:
                    continue
                residency.park(victim)
                with self._lock:
                    self._live.discard(victim)
                    used -= self._held.get(victim, 0)
        with self._lock:
            if key in self._held:
                self._live.add(key)
        self._spill_over(residency, pinned)

    def _spill_over(self, residency, pinned: set[str] | frozenset[str] = frozenset()) -> None:
        """Past the parked-memory cap, the least recently parked go to disk (not one coming back now)."""
        if self.parked_cap is None:
            return
        for victim in residency.least_recent(PARKED):
            if residency.parked_bytes() <= self.parked_cap:
                break
            if victim not in pinned:
                residency.spill(victim)

    def _sweep_loop(self, period: float) -> None:
        while True:
            time.sleep(period)
            for backend in list(self._parkable):
                backend.with_residency(self._sweep)

    def _sweep(self, residency) -> None:
        """Idle live adapters to host memory, long-parked ones to disk."""
        for name in residency.least_recent(LIVE) if self.idle_park_s is not None else ():
            if residency.idle_for(name) >= self.idle_park_s:
                residency.park(name)
                with self._lock:
                    self._live.discard(name)
        for name in residency.least_recent(PARKED) if self.idle_spill_s is not None else ():
            if residency.idle_for(name) >= self.idle_spill_s:
                residency.spill(name)
        self._spill_over(residency)

    # ---- what the capacity route and the metrics report ----------------------------------------------
    def report(self, backend=None, spec=None) -> dict:
        """Cap, use, adapters per tier and swap counters over the managed models; with `spec`, how many
        adapters like it fit now (beside the live ones) and at most (every other adapter parked)."""
        tiers, swaps = {LIVE: 0, PARKED: 0, SPILLED: 0}, {}
        for managed in list(self._backends):
            counts, stats = managed.residency_report()
            for tier, n in counts.items():
                tiers[tier] += n
            for k, v in stats.items():
                swaps[k] = swaps.get(k, 0) + v
        used = self.used()
        out = {"cap_bytes": self.cap, "used_bytes": used, "offload": self.offload, "adapters": tiers, "swaps": swaps}
        if spec is not None:
            need = self.estimate(backend, spec)
            out["adapter_bytes"] = need
            limited = self.cap is not None and need
            out["fit_now"] = max(self.cap - used, 0) // need if limited else None
            out["fit_max"] = (
                (self.cap // need if self.offload else max(self.cap - used, 0) // need) if limited else None
            )
        return out
