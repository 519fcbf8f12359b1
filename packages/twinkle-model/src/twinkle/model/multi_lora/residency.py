"""Where each adapter of a MultiLoraModel lives: live (in the model's layers), parked (host memory,
detached from every layer) or spilled (a safetensors file + JSON in a spill folder).

A parked or spilled adapter costs nothing in a forward pass and no device memory; its next use
brings it back. What moves is everything per adapter that is a tensor: the LoRA factors, their
pending gradients (an accumulation window survives) and the optimizer's state (Adam moments, step
counts). The AdapterState shell (scheduler, loss, metrics, counters: a few Python numbers) stays.
Moving is copying, so training after a round trip is bit-exact with never having moved.

Restoring builds fresh factors through the layer's own `add_adapter` and copies the saved values
in; the optimizer keeps its identity (the scheduler is bound to it) and is pointed at the new
parameters. `make_room(name, pinned)`, when set, runs before an adapter becomes live: the caller's
memory policy parks others there (never the `pinned` ones, which the pass in progress needs).
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from twinkle.model.multi_lora import experts as expert_lora
from twinkle.model.multi_lora.layer import unwrap_empty_layers, wrap_linear_layers

LIVE, PARKED, SPILLED = "live", "parked", "spilled"
_META = "residency.json"
_TENSORS = "tensors.safetensors"


@dataclass
class SwapStats:
    """Moves and the seconds they took, since the model was built."""

    parked: int = 0  # live -> host memory
    spilled: int = 0  # host memory -> disk
    restored: int = 0  # back to live, from either
    restored_from_disk: int = 0
    park_s: float = 0.0
    spill_s: float = 0.0
    restore_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Away:
    """A parked or spilled adapter's tensors ({} once spilled) and what is not a tensor."""

    tensors: dict[str, torch.Tensor]
    meta: dict  # "moved": keys that were on the model's device; "opt_scalars", "opt_order": {i: ...}
    bytes: int
    folder: Path | None = None
    since: float = field(default_factory=time.monotonic)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = t.detach().to("cpu", copy=t.is_cuda)
    return host.pin_memory() if t.is_cuda else host  # pinned: the copy back is a plain DMA


class Residency:
    def __init__(self, model):
        self.model = model
        self.spill_dir: Path | None = None
        self.make_room = None  # (name, pinned: set[str]) -> None, before an adapter becomes live
        self.stats = SwapStats()
        self._used: OrderedDict[str, float] = OrderedDict()  # live adapters, least recently used first
        self._away: dict[str, _Away] = {}
        # adapters of a pass paused mid-way (twinkle.model.preemption): its graph holds their tensors
        self.in_use: Counter[str] = Counter()

    # ---- queries ------------------------------------------------------------------------------------
    def hold(self, names: list[str]):
        """Keep `names` from being parked (a pass paused mid-way uses them); -> what lets them go."""
        self.in_use.update(names)

        def release() -> None:
            self.in_use.subtract(names)
            for name in names:
                if self.in_use[name] <= 0:
                    del self.in_use[name]

        return release

    def tier(self, name: str) -> str:
        away = self._away.get(name)
        return LIVE if away is None else (PARKED if away.folder is None else SPILLED)

    def counts(self) -> dict[str, int]:
        """Adapters per tier (safe to read from another thread: it copies before it counts)."""
        away = list(self._away.values())
        spilled = sum(1 for a in away if a.folder is not None)
        return {LIVE: len(self.model.adapters) - len(away), PARKED: len(away) - spilled, SPILLED: spilled}

    def parked_bytes(self) -> int:
        return sum(a.bytes for a in self._away.values() if a.folder is None)

    def least_recent(self, tier: str = LIVE) -> list[str]:
        """Adapters in `tier`, least recently used first."""
        if tier == LIVE:  # not those a paused pass is using: never offered to be parked
            return [n for n in self._used if n not in self._away and n not in self.in_use]
        return sorted((n for n in self._away if self.tier(n) == tier), key=lambda n: self._away[n].since)

    def idle_for(self, name: str) -> float:
        away = self._away.get(name)
        return time.monotonic() - (away.since if away is not None else self._used.get(name, time.monotonic()))

    # ---- bookkeeping the model calls ----------------------------------------------------------------
    def touch(self, name: str) -> None:
        self._used[name] = time.monotonic()
        self._used.move_to_end(name)

    def admit(self, name: str, pinned: set[str]) -> None:
        """Before `name` is built or restored: let the memory policy make room."""
        if self.make_room is not None:
            self.make_room(name, pinned | {name})
        self.touch(name)

    def forget(self, name: str) -> None:
        """The adapter is gone: drop its parked copy or spill folder."""
        self._used.pop(name, None)
        if name in self._away:
            self._forget_away(name)

    # ---- moves --------------------------------------------------------------------------------------
    def park(self, name: str) -> None:
        """Live -> host memory, detached from every layer (a no-op for one already away)."""
        if name in self._away:
            return
        start, model = time.perf_counter(), self.model
        state = model.adapters[name]
        opt = state.optimizer
        tensors, moved, scalars, order = {}, [], {}, {}
        for i, p in enumerate(state.params):
            opt_state = opt.state.get(p, {}) if opt is not None else {}
            order[str(i)] = list(opt_state)  # a checkpoint's optimizer entries keep their order
            entries = {"w": p, "g": p.grad, **{f"o.{k}": v for k, v in opt_state.items()}}
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{i}.{key}"] = _to_host(value)
                    if value.device == model.device:
                        moved.append(f"{i}.{key}")
                elif key.startswith("o."):
                    scalars.setdefault(str(i), {})[key[2:]] = value
            if opt is not None:
                opt.state.pop(p, None)
            p.grad = None
            p.data = torch.empty(0, device=p.device, dtype=p.dtype)  # the host copy holds the values now
        for module_name in state.module_names:
            model.lora_layer(module_name).remove_adapter(name)
        unwrap_empty_layers(model.base, state.module_names)
        for module_name in model.expert_targets(name):
            model.base.get_submodule(module_name).remove_adapter(name)
            expert_lora.unwrap_empty(model.base, module_name)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        self._away[name] = _Away(tensors, {"moved": moved, "opt_scalars": scalars, "opt_order": order}, size)
        self.stats.parked += 1
        self.stats.park_s += time.perf_counter() - start

    def spill(self, name: str) -> None:
        """Parked (or live) -> a safetensors file and JSON under spill_dir; frees the host copy."""
        if self.spill_dir is None:
            raise RuntimeError("no spill folder: call MultiLoraModel.enable_spill(folder) first")
        self.park(name)
        away = self._away[name]
        if away.folder is not None:
            return
        start = time.perf_counter()
        folder = self.spill_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in away.tensors.items()}, str(folder / _TENSORS))
        (folder / _META).write_text(json.dumps(away.meta))  # a non-JSON optimizer scalar fails here, loudly
        away.tensors, away.folder = {}, folder
        self.stats.spilled += 1
        self.stats.spill_s += time.perf_counter() - start

    def restore(self, name: str, pinned: set[str] | frozenset[str] = frozenset()) -> None:
        """Parked or spilled -> live, exactly as it was."""
        away = self._away.get(name)
        if away is None:
            return
        self.admit(name, set(pinned))
        start, model = time.perf_counter(), self.model
        tensors, meta = away.tensors, away.meta
        if away.folder is not None:
            tensors = load_file(str(away.folder / _TENSORS))
            meta = json.loads((away.folder / _META).read_text())
        moved = set(meta["moved"])

        def back(key: str) -> torch.Tensor:
            t = tensors[key]
            return t.to(model.device, non_blocking=True) if key in moved else t

        state = model.adapters[name]
        spec = state.spec
        throwaway = torch.Generator(device=model.device)  # the saved values overwrite this init
        new_params = []
        for layer in wrap_linear_layers(model.base, state.module_names, model.routing):
            layer.add_adapter(name, spec.rank, spec.scaling, spec.dropout, state.dropout_generator, throwaway)
            new_params += list(layer.factors(name))
        for module_name, weights in model.expert_targets(name).items():  # in add_adapter_to_model's order
            experts = expert_lora.wrap_experts(model.base, module_name, model.routing)
            experts.add_adapter(name, weights, spec.rank, spec.scaling, throwaway)
            new_params += list(experts.peft_tensors(name, module_name).values())
        opt = state.optimizer
        renamed = {}
        with torch.no_grad():
            for i, (old, new) in enumerate(zip(state.params, new_params)):
                new.copy_(back(f"{i}.w"))
                if f"{i}.g" in tensors:
                    new.grad = back(f"{i}.g")
                renamed[old] = new
                scalars = meta["opt_scalars"].get(str(i), {})
                entry = {k: scalars[k] if k in scalars else back(f"{i}.o.{k}") for k in meta["opt_order"][str(i)]}
                if opt is not None and entry:
                    opt.state[new] = entry
        if opt is not None:
            for group in opt.param_groups:
                group["params"] = [renamed.get(p, p) for p in group["params"]]
        state.params = new_params
        self._forget_away(name)
        self.stats.restored += 1
        self.stats.restored_from_disk += int(away.folder is not None)
        self.stats.restore_s += time.perf_counter() - start

    def _forget_away(self, name: str) -> None:
        away = self._away.pop(name)
        if away.folder is not None:
            shutil.rmtree(away.folder, ignore_errors=True)
