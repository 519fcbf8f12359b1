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
from torch import nn


class Routing:
    """Which adapter each run of batch rows belongs to, for the forward pass in progress.

    One object is shared by every MultiLoraLinear of a model and set once per pass; `None` as a
    name means "base model only" for those rows (reference log-probs, plain inference)."""

    def __init__(self):
        self.names: tuple[str | None, ...] = ()
        self.sizes: tuple[int, ...] = ()
        self.lengths: tuple[int, ...] = ()  # each segment's own (unpadded) time length
        self.training = False

    def set(self, segments: list[tuple[str | None, int, int]], training: bool) -> None:
        self.names = tuple(name for name, _, _ in segments)
        self.sizes = tuple(rows for _, rows, _ in segments)
        self.lengths = tuple(length for _, _, length in segments)
        self.training = training

    def clear(self) -> None:
        self.names, self.sizes, self.lengths = (), (), ()


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

    def factors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The (A, B) weights of adapter `name`."""
        a, b = self.lora_A[name], self.lora_B[name]
        assert isinstance(a, LoraWeight) and isinstance(b, LoraWeight)  # what add_adapter puts there
        return a.weight, b.weight

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

    def _segments(self, rows: int) -> list[tuple[int, int, str, int]]:
        """(start, end, adapter, own length) for each run of rows whose adapter is on this layer."""
        names, sizes, lengths = self.routing.names, self.routing.sizes, self.routing.lengths
        if len(names) == 1:
            only = names[0]
            return [(0, rows, only, lengths[0])] if only is not None and only in self.lora_A else []
        if rows != sum(sizes):
            raise RuntimeError(f"routing covers {sum(sizes)} rows but the layer got a batch of {rows}")
        out, start = [], 0
        for name, size, length in zip(names, sizes, lengths):
            if name is not None and name in self.lora_A:
                out.append((start, start + size, name, length))
            start += size
        return out

    def _keep_mask(self, name: str, x_seg: torch.Tensor, length: int) -> torch.Tensor | None:
        """Inverted-dropout multiplier for one adapter's rows, drawn from that adapter's own
        generator at the tenant's own (unpadded) shape: its masks do not depend on which other
        tenants share the batch or how far the batch is padded."""
        p = self.dropout[name]
        if not p or not self.routing.training:
            return None
        shape = (x_seg.shape[0], length, *x_seg.shape[2:]) if x_seg.dim() == 3 else x_seg.shape
        keep = (torch.rand(shape, generator=self.generators[name], device=x_seg.device) >= p).to(x_seg.dtype)
        if keep.shape != x_seg.shape:  # padded positions: whatever they get is masked out downstream
            keep = torch.nn.functional.pad(keep, (0, 0, 0, x_seg.shape[1] - length), value=1.0)
        return keep / (1.0 - p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        segments = self._segments(x.shape[0])
        if not segments:
            return out
        plan = [(start, end, self.scaling[name], self._keep_mask(name, x[start:end], length))
                for start, end, name, length in segments]
        weights = [w for _, _, name, _ in segments for w in (self.lora_A[name].weight, self.lora_B[name].weight)]
        if not torch.is_grad_enabled():
            _add_low_rank(x, out, plan, weights)
            return out
        return _MultiLoraAdd.apply(x, out, plan, *weights)


def _add_low_rank(x, out, plan, weights) -> list[torch.Tensor]:
    """out[rows] += scaling * (x[rows] * keep) @ A.T @ B.T for each segment, in place; returns the
    rank-r activations (what B's gradient needs)."""
    lows = []
    for i, (start, end, scaling, keep) in enumerate(plan):
        a_R_I, b_O_R = weights[2 * i], weights[2 * i + 1]
        x_seg = x[start:end] if keep is None else x[start:end] * keep
        low = x_seg.reshape(-1, x.shape[-1]) @ a_R_I.t()
        out[start:end].view(-1, out.shape[-1]).addmm_(low, b_O_R.t(), alpha=scaling)
        lows.append(low)
    return lows


class _MultiLoraAdd(torch.autograd.Function):
    """Adds every segment's low-rank update into the base output in place: one autograd node per
    layer however many tenants share the batch, no split/cat copies of the activations. Backward
    hands the output gradient through unchanged (the base path) and adds the adapters' parts."""

    @staticmethod
    def forward(ctx, x, out, plan, *weights):
        lows = _add_low_rank(x, out, plan, weights)
        ctx.mark_dirty(out)
        ctx.plan = plan
        ctx.save_for_backward(x, *weights, *lows)
        return out

    @staticmethod
    def backward(ctx, *grad_outputs):
        (grad_out,) = grad_outputs  # forward has one output
        plan = ctx.plan
        x, rest = ctx.saved_tensors[0], ctx.saved_tensors[1:]
        weights, lows = rest[:2 * len(plan)], rest[2 * len(plan):]
        in_features, out_features = x.shape[-1], grad_out.shape[-1]
        grad_x = None
        if ctx.needs_input_grad[0]:
            covered = sum(end - start for start, end, _, _ in plan)
            grad_x = torch.empty_like(x) if covered == x.shape[0] else torch.zeros_like(x)
        grad_weights = []
        for i, (start, end, scaling, keep) in enumerate(plan):
            a_R_I, b_O_R, low = weights[2 * i], weights[2 * i + 1], lows[i]
            g_N_O = grad_out[start:end].reshape(-1, out_features)
            x_seg = x[start:end] if keep is None else x[start:end] * keep
            grad_b = torch.mm(g_N_O.t(), low) * scaling
            g_low = torch.mm(g_N_O, b_O_R) * scaling
            grad_a = torch.mm(g_low.t(), x_seg.reshape(-1, in_features))
            if grad_x is not None:
                g_x = torch.mm(g_low, a_R_I).view(x_seg.shape)
                grad_x[start:end] = g_x if keep is None else g_x * keep
            grad_weights += [grad_a, grad_b]
        return grad_x, grad_out, None, *grad_weights


def wrap_linear_layers(model: nn.Module, names: list[str], routing: Routing) -> list[MultiLoraLinear]:
    """Replace each named nn.Linear by a MultiLoraLinear around it (once); return the wrappers."""
    wrappers = []
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module, MultiLoraLinear):
            if not isinstance(module, nn.Linear):
                raise TypeError(f"{name} is a {type(module).__name__}: multi-LoRA wraps nn.Linear layers only")
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            module = MultiLoraLinear(module, routing)
            setattr(parent, child, module)
        wrappers.append(module)
    return wrappers
