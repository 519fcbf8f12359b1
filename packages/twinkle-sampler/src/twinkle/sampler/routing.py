"""Per-row LoRA routing: one batched forward where each row goes through its own adapter (or none).

Forward hooks on the base model's Linear layers add `scaling * (x[rows] @ A.T) @ B.T` for the rows
routed to each adapter. No peft wrapper and no `adapter_names=` argument: the base model stays a
plain transformers model, adapters are just tensors (so a sync swaps tensors, never modules), and
rows of a batch may name different adapters. When issue 6's fused multi-adapter LoRA layer lands,
this is the one module to swap for it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from twinkle.sampler.adapters import AdapterWeights


class LoRARouter:
    """Owns the adapters of one sampler and applies them per row during a `route(...)` block."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapters: dict[str, AdapterWeights] = {}
        self._linears = {path: m for path, m in model.named_modules() if isinstance(m, nn.Linear)}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        # path -> list of (adapter name, row index tensor or None for "all rows"); set by route().
        self._plan: dict[str, list[tuple[AdapterWeights, torch.Tensor | None]]] = {}

    def set_adapter(self, name: str, weights: AdapterWeights) -> None:
        missing = [p for p in weights.modules if p not in self._linears]
        if missing:
            raise KeyError(f"adapter {name!r} targets modules the sampler's model lacks: {missing[:3]}"
                           f"{' ...' if len(missing) > 3 else ''}")
        for path in weights.modules:
            lin = self._linears[path]
            a, b = weights.lora_A[path], weights.lora_B[path]
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise ValueError(f"adapter {name!r} at {path}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                                 f"Linear({lin.in_features}, {lin.out_features})")
            if path not in self._hooks:
                self._hooks[path] = lin.register_forward_hook(self._make_hook(path))
        self.adapters[name] = weights

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(f"no adapter named {name!r}; loaded: {sorted(self.adapters)}")
        del self.adapters[name]

    def _make_hook(self, path: str):
        def hook(module, args, output):
            for weights, rows in self._plan.get(path, ()):
                a, b, s = weights.lora_A[path], weights.lora_B[path], weights.scaling[path]
                x = args[0] if rows is None else args[0].index_select(0, rows)
                # Same op order as peft (B(A(x)) * scaling), so an adapter served here matches training.
                delta = (F.linear(F.linear(x.to(a.dtype), a), b) * s).to(output.dtype)
                if rows is None:
                    output = output + delta
                else:
                    output = output.index_add(0, rows, delta)
            return output
        return hook

    def _build_plan(self, row_adapters: list[str | None], device) -> None:
        self._plan = {}
        names = {r for r in row_adapters if r is not None}
        unknown = names - set(self.adapters)
        if unknown:
            raise KeyError(f"unknown adapter(s) {sorted(unknown)}; loaded: {sorted(self.adapters)}")
        for name in sorted(names):
            weights = self.adapters[name]
            if all(r == name for r in row_adapters):
                rows = None  # the whole batch: skip the gather/scatter
            else:
                rows = torch.tensor([i for i, r in enumerate(row_adapters) if r == name], device=device)
            for path in weights.modules:
                self._plan.setdefault(path, []).append((weights, rows))

    @contextmanager
    def route(self, row_adapters: list[str | None], device=None):
        """Inside the block, row i of every forward uses adapter `row_adapters[i]` (None: base)."""
        self._build_plan(list(row_adapters), device)
        try:
            yield self
        finally:
            self._plan = {}

    def reroute(self, row_adapters: list[str | None], device=None) -> None:
        """Change the row assignment mid-block (after finished rows leave the batch)."""
        self._build_plan(list(row_adapters), device)
