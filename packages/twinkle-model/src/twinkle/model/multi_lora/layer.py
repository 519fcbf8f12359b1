"""A Linear layer carrying any number of LoRA adapters, each row of a batch routed to its own.

One shared base GEMM runs over the whole batch (all tenants' rows at once); then each contiguous
run of rows gets its own adapter's low-rank update, `B(A(dropout(x))) * scaling`, at that adapter's
own rank. Autograd sees ordinary ops (split / two small matmuls / cat), so training works and each
adapter's gradient comes only from its own rows. Parameter names follow peft's in-memory layout
(`<layer>.lora_A.<adapter>.weight`), so saving to a peft folder is a rename.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Routing:
    """Which adapter each run of batch rows belongs to, for the forward pass in progress.

    One object is shared by every MultiLoraLinear of a model and set once per pass; `None` as a
    name means "base model only" for those rows (reference log-probs, plain inference)."""

    def __init__(self):
        self.names: tuple[str | None, ...] = ()
        self.sizes: tuple[int, ...] = ()
        self.training = False

    def set(self, segments: list[tuple[str | None, int]], training: bool) -> None:
        self.names = tuple(name for name, _ in segments)
        self.sizes = tuple(rows for _, rows in segments)
        self.training = training

    def clear(self) -> None:
        self.names, self.sizes = (), ()


class LoraWeight(nn.Module):
    """One bare weight matrix (no bias, no default init: the caller initialises it)."""

    def __init__(self, out_features: int, in_features: int, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))


class MultiLoraLinear(nn.Module):
    def __init__(self, base_layer: nn.Linear, routing: Routing):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.dropout: dict[str, float] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.routing = routing

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> torch.Tensor:  # code that inspects `.weight` (dtype checks, tied heads) still works
        return self.base_layer.weight

    def add_adapter(self, name: str, rank: int, scaling: float, dropout: float,
                    dropout_generator: torch.Generator, init_generator: torch.Generator) -> None:
        if name in self.lora_A:
            raise ValueError(f"adapter {name!r} already exists on this layer")
        weight = self.base_layer.weight
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        a = LoraWeight(rank, self.in_features, weight.device, dtype)
        b = LoraWeight(self.out_features, rank, weight.device, dtype)
        with torch.no_grad():  # peft's default init: A like nn.Linear, B zero (the adapter starts as a no-op)
            nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5), generator=init_generator)
            nn.init.zeros_(b.weight)
        self.lora_A[name], self.lora_B[name] = a, b
        self.scaling[name], self.dropout[name] = scaling, dropout
        self.generators[name] = dropout_generator

    def remove_adapter(self, name: str) -> None:
        del self.lora_A[name], self.lora_B[name]
        del self.scaling[name], self.dropout[name], self.generators[name]

    def _delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        p = self.dropout[name]
        if p and self.routing.training:
            # the adapter's own generator: its dropout masks do not depend on who else is in the batch
            keep = torch.rand(x.shape, generator=self.generators[name], device=x.device) >= p
            x = x * keep.to(x.dtype) / (1.0 - p)
        low_rank = F.linear(x, self.lora_A[name].weight)
        return F.linear(low_rank, self.lora_B[name].weight) * self.scaling[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        names = self.routing.names
        if len(names) == 1:
            return out + self._delta(names[0], x) if names[0] in self.lora_A else out
        if not any(name in self.lora_A for name in names):
            return out
        sizes = self.routing.sizes
        if x.shape[0] != sum(sizes):
            raise RuntimeError(f"routing covers {sum(sizes)} rows but the layer got a batch of {x.shape[0]}")
        pieces = [o + self._delta(name, xs) if name in self.lora_A else o
                  for name, o, xs in zip(names, out.split(sizes), x.split(sizes))]
        return torch.cat(pieces)


def wrap_linear_layers(model: nn.Module, names: list[str], routing: Routing) -> list[MultiLoraLinear]:
    """Replace each named nn.Linear by a MultiLoraLinear around it (once); return the wrappers."""
    wrappers = []
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, MultiLoraLinear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            module = MultiLoraLinear(module, routing)
            setattr(parent, child, module)
        wrappers.append(module)
    return wrappers
