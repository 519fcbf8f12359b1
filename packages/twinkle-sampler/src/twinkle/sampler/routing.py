"""Per-row LoRA routing for a sampler, on the training engine's fused multi-LoRA layer.

A Linear an adapter targets is wrapped in `twinkle.model.multi_lora.MultiLoraLinear` (the layer
MultiLoraModel trains with), holding every loaded adapter's factors as tensors that share storage
with what was synced in. One batched forward then routes each run of rows through its own adapter
(or none): equally long runs of different adapters share one batched matmul per layer, so a
sampled token gets the same arithmetic as the training pass that produced the adapter. The base
model stays a transformers model; no peft wrapper and no `adapter_names=` argument.
"""

from __future__ import annotations

from contextlib import contextmanager
from itertools import groupby

from torch import nn

from twinkle.model.multi_lora.layer import MultiLoraLinear, Routing, unwrap_empty_layers, wrap_linear_layers
from twinkle.sampler.adapters import AdapterWeights


class LoRARouter:
    """Owns the adapters of one sampler and applies them per row during a `route(...)` block."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapters: dict[str, AdapterWeights] = {}
        self.routing = Routing()
        self._linears = {path: m for path, m in model.named_modules() if isinstance(m, nn.Linear)}

    def set_adapter(self, name: str, weights: AdapterWeights) -> None:
        missing = [p for p in weights.modules if p not in self._linears]
        if missing:
            raise KeyError(
                f"adapter {name!r} targets modules the sampler's model lacks: {missing[:3]}"
                f"{' ...' if len(missing) > 3 else ''}"
            )
        for path in weights.modules:
            lin, a, b = self._linears[path], weights.lora_A[path], weights.lora_B[path]
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise ValueError(
                    f"adapter {name!r} at {path}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                    f"Linear({lin.in_features}, {lin.out_features})"
                )
        if name in self.adapters:  # a sync replaces the adapter's tensors
            self.remove_adapter(name)
        for path, layer in zip(weights.modules, wrap_linear_layers(self.model, weights.modules, self.routing)):
            layer.load_adapter(name, weights.lora_A[path], weights.lora_B[path], weights.scaling[path])
        self.adapters[name] = weights

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(f"no adapter named {name!r}; loaded: {sorted(self.adapters)}")
        modules = self.adapters.pop(name).modules
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
            yield self
        finally:
            self.routing.clear()

    def reroute(self, row_adapters: list[str | None], device=None) -> None:
        """Change the row assignment mid-block (after finished rows leave the batch)."""
        self._build_plan(list(row_adapters))
