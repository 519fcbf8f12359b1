"""Per-row LoRA routing for a sampler, on the training engine's fused multi-LoRA layer.

A Linear an adapter targets is wrapped in `twinkle.model.multi_lora.MultiLoraLinear` (the layer
MultiLoraModel trains with), holding every loaded adapter's factors as tensors that share storage
with what was synced in. One batched forward then routes each run of rows through its own adapter
(or none): equally long runs of different adapters share one batched matmul per layer, so a
sampled token gets the same arithmetic as the training pass that produced the adapter. The base
model stays a transformers model; no peft wrapper and no `adapter_names=` argument. MoE expert
weights (3-D) are served the same way through `twinkle.model.multi_lora.experts.MultiLoraExperts`.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import groupby

from torch import nn

from twinkle.model import preemption
from twinkle.model.multi_lora import experts as expert_lora
from twinkle.model.multi_lora.layer import MultiLoraLinear, Routing, unwrap_empty_layers, wrap_linear_layers
from twinkle.model.structure import describe
from twinkle.sampler.adapters import AdapterWeights


class LoRARouter:
    """Owns the adapters of one sampler and applies them per row during a `route(...)` block."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapters: dict[str, AdapterWeights] = {}
        self.routing = Routing()
        self._linears = {path: m for path, m in model.named_modules() if isinstance(m, nn.Linear)}
        # {expert weight's full name: (its experts module, the weight's name there)}
        self._experts = {p.name: (p.module, p.param) for p in describe(model).of("experts")}
        self._expert_paths: dict[str, list[str]] = {}  # adapter -> expert weights it adapts

    def _expert_keys(self, weights: AdapterWeights) -> AdapterWeights:
        """Expert factors keyed as peft nests them (`...experts.base_layer`, read from a folder) renamed
        to the weights they adapt: of a module's k targeted weights, in registration order, the first
        is nested deepest (peft's rule, twinkle.model.multi_lora.experts)."""
        targets = weights.meta.get("target_parameters") or ()
        owners = {module for module, _ in self._experts.values()}
        renamed = {}
        for path in weights.modules:
            module, depth = path, 0
            while module.endswith(".base_layer"):
                module, depth = module[: -len(".base_layer")], depth + 1
            renamed[path] = path
            if not targets or module not in owners:
                continue
            chosen = [
                full
                for full, (owner, _) in self._experts.items()  # describe() lists them in registration order
                if owner == module and any(full == t or full.endswith("." + t) for t in targets)
            ]
            if depth < len(chosen):
                renamed[path] = chosen[len(chosen) - 1 - depth]
        return AdapterWeights(
            {renamed[p]: t for p, t in weights.lora_A.items()},
            {renamed[p]: t for p, t in weights.lora_B.items()},
            {renamed[p]: v for p, v in weights.scaling.items()},
            weights.version,
            dict(weights.meta),
        )

    def set_adapter(self, name: str, weights: AdapterWeights) -> None:
        weights = self._expert_keys(weights)
        experts = [p for p in weights.modules if p in self._experts]
        linear = [p for p in weights.modules if p not in self._experts]
        missing = [p for p in linear if p not in self._linears]
        if missing:
            raise KeyError(
                f"adapter {name!r} targets modules the sampler's model lacks: {missing[:3]}"
                f"{' ...' if len(missing) > 3 else ''}"
            )
        for path in linear:
            lin, a, b = self._linears[path], weights.lora_A[path], weights.lora_B[path]
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise ValueError(
                    f"adapter {name!r} at {path}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                    f"Linear({lin.in_features}, {lin.out_features})"
                )
        if name in self.adapters:  # a sync replaces the adapter's tensors
            self.remove_adapter(name)
        for path, layer in zip(linear, wrap_linear_layers(self.model, linear, self.routing)):
            layer.load_adapter(name, weights.lora_A[path], weights.lora_B[path], weights.scaling[path])
        self.adapters[name] = AdapterWeights(
            {p: weights.lora_A[p] for p in linear},
            {p: weights.lora_B[p] for p in linear},
            {p: weights.scaling[p] for p in linear},
            weights.version,
            dict(weights.meta),
        )
        self._expert_paths[name] = []
        try:
            for path in experts:
                module, param = self._experts[path]
                assert param is not None  # _experts holds only 3-D expert weights
                wrapper = expert_lora.wrap_experts(self.model, module, self.routing)
                self._expert_paths[name].append(path)  # before loading: a misfit one is unwrapped again too
                wrapper.load_adapter(name, param, weights.lora_A[path], weights.lora_B[path], weights.scaling[path])
        except (KeyError, ValueError):
            self.remove_adapter(name)  # nothing of a misfit adapter stays loaded
            raise

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(f"no adapter named {name!r}; loaded: {sorted(self.adapters)}")
        modules = self.adapters.pop(name).modules
        for path in self._expert_paths.pop(name, []):
            module = self._experts[path][0]
            wrapper = self.model.get_submodule(module)
            if isinstance(wrapper, expert_lora.MultiLoraExperts):
                wrapper.remove_adapter(name)
                expert_lora.unwrap_empty(self.model, module)
        for path in modules:
            layer = self.model.get_submodule(path)
            assert isinstance(layer, MultiLoraLinear), path  # load_adapter wrapped every module it names
            layer.remove_adapter(name)
        unwrap_empty_layers(self.model, modules)

    def _build_plan(self, row_adapters: list[str | None]) -> None:
        unknown = {r for r in row_adapters if r is not None} - set(self.adapters)
        if unknown:
            raise KeyError(f"unknown adapter(s) {sorted(unknown)}; loaded: {sorted(self.adapters)}")
        # runs of rows with the same adapter; no dropout at inference, so no per-row length is needed
        self.routing.set([(name, len(list(run)), 0) for name, run in groupby(row_adapters)], training=False)

    @contextmanager
    def route(self, row_adapters: list[str | None], device=None):
        """Inside the block, row i of every forward uses adapter `row_adapters[i]` (None: base)."""
        self._build_plan(list(row_adapters))
        try:
            # another tenant's decode may run while a long prefill pauses (twinkle.model.preemption)
            with preemption.preserving(self._saved_routing):
                yield self
        finally:
            self.routing.clear()

    def _saved_routing(self):
        state = self.routing.state()
        return lambda: self.routing.load(state)

    def reroute(self, row_adapters: list[str | None], device=None) -> None:
        """Change the row assignment mid-block (after finished rows leave the batch)."""
        self._build_plan(list(row_adapters))
