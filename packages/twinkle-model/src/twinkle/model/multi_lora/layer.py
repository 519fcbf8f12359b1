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
from torch.nn.utils.rnn import pad_sequence


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
        self.generators: dict[str, torch.Generator | None] = {}
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

    def add_adapter(
        self,
        name: str,
        rank: int,
        scaling: float,
        dropout: float,
        dropout_generator: torch.Generator,
        init_generator: torch.Generator,
    ) -> None:
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

    def load_adapter(self, name: str, a_R_I: torch.Tensor, b_O_R: torch.Tensor, scaling: float) -> None:
        """An inference-only adapter from given factors, sharing their storage (a sampler's adapters)."""
        if (
            a_R_I.shape[1] != self.in_features
            or b_O_R.shape[0] != self.out_features
            or a_R_I.shape[0] != b_O_R.shape[1]
        ):
            raise ValueError(
                f"A {tuple(a_R_I.shape)} / B {tuple(b_O_R.shape)} do not fit "
                f"Linear({self.in_features}, {self.out_features})"
            )
        a, b = nn.Module(), nn.Module()
        a.weight, b.weight = nn.Parameter(a_R_I, requires_grad=False), nn.Parameter(b_O_R, requires_grad=False)
        self.lora_A[name], self.lora_B[name] = a, b
        self.scaling[name], self.dropout[name], self.generators[name] = scaling, 0.0, None

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
        plan = self._plan(x, segments)
        weights = [w for _, _, name, _ in segments for w in (self.lora_A[name].weight, self.lora_B[name].weight)]
        if not torch.is_grad_enabled():
            _add_low_rank(x, out, plan, weights)
            return out
        return _MultiLoraAdd.apply(x, out, plan, *weights)

    def _plan(self, x: torch.Tensor, segments: list[tuple[int, int, str, int]]) -> list[_Group]:
        """Consecutive segments of equal size form one group, computed as one batched matmul."""
        groups: list[_Group] = []
        for start, end, name, length in segments:
            keep = self._keep_mask(name, x[start:end], length)
            last = groups[-1] if groups else None
            if last is not None and last.end == start and last.size == end - start:
                last.add(end, self.scaling[name], keep)
            else:
                groups.append(_Group(start, end, [self.scaling[name]], [keep]))
        return groups


class _Group:
    """A run of consecutive, equally sized segments: `count` tenants of `size` rows each.

    One tenant: two plain matmuls at its own rank. Several: their factors stacked (ranks
    zero-padded to the largest) and one `bmm` per product over the tenants, the segmented LoRA
    matmul of punica/S-LoRA done with a stock kernel. Zero rows of A give zero columns of the
    rank-r activation, so padding changes no result, and the padded parts' gradients are dropped."""

    def __init__(self, start: int, end: int, scalings: list[float], keeps: list):
        self.start, self.end, self.size = start, end, end - start
        self.scalings, self.keeps = scalings, keeps

    def add(self, end: int, scaling: float, keep) -> None:
        self.end = end
        self.scalings.append(scaling)
        self.keeps.append(keep)

    @property
    def count(self) -> int:
        return len(self.scalings)

    def dropped(self, t: torch.Tensor) -> torch.Tensor:
        """t (this group's rows) times each tenant's dropout mask; t itself when no tenant drops."""
        if all(k is None for k in self.keeps):
            return t
        return t * torch.cat([torch.ones_like(t[: self.size]) if k is None else k for k in self.keeps])

    def x(self, x: torch.Tensor, dtype) -> torch.Tensor:
        """This group's rows of x, dropout applied, as [count, tokens, in] (one tenant: [tokens, in])."""
        rows = self.dropped(x[self.start : self.end]).to(dtype)
        return rows.reshape(self.count, -1, x.shape[-1]) if self.count > 1 else rows.reshape(-1, x.shape[-1])


def _stack(weights, group: _Group, offset: int):
    """(A [count, r, in], B.T [count, r, out], scalings [count, 1, 1]) of a group, ranks zero-padded."""
    a = [weights[2 * (offset + i)] for i in range(group.count)]
    b_t = [weights[2 * (offset + i) + 1].t() for i in range(group.count)]
    scale = torch.tensor(group.scalings, dtype=a[0].dtype, device=a[0].device).view(-1, 1, 1)
    return pad_sequence(a, batch_first=True), pad_sequence(b_t, batch_first=True), scale


def _add_low_rank(x, out, plan, weights) -> list[tuple]:
    """out[rows] += (scaling * (x[rows] * keep) @ A.T) @ B.T for every segment, in place; returns
    per group what backward needs: the stacked factors and scalings (None for one tenant) and the
    scaled rank-r activations."""
    saved, offset = [], 0
    for group in plan:
        xg = group.x(x, weights[2 * offset].dtype)
        out_g = out[group.start : group.end].view(*xg.shape[:-1], out.shape[-1])
        if group.count == 1:
            a_R_I, bt_R_O = weights[2 * offset], weights[2 * offset + 1].t()
            low = torch.mm(xg, a_R_I.t()).mul_(group.scalings[0])
            stacks, add = (None, None, None), (out_g.addmm_, torch.mm)
        else:
            a_C_R_I, bt_C_R_O, scale = _stack(weights, group, offset)
            low = torch.bmm(xg, a_C_R_I.transpose(1, 2)).mul_(scale)
            stacks, add, bt_R_O = (a_C_R_I, bt_C_R_O, scale), (out_g.baddbmm_, torch.bmm), bt_C_R_O
        if out.dtype == low.dtype:
            add[0](low, bt_R_O)
        else:  # adapters kept in another dtype than the base (a sampler's fp32 adapters on a bf16 base)
            out_g.add_(add[1](low, bt_R_O).to(out.dtype))
        saved.append((*stacks, low))
        offset += group.count
    return saved


class _MultiLoraAdd(torch.autograd.Function):
    """Adds every segment's low-rank update into the base output in place: one autograd node per
    layer however many tenants share the batch, no split/cat copies of the activations. Backward
    hands the output gradient through unchanged (the base path) and adds the adapters' parts."""

    @staticmethod
    def forward(ctx, x, out, plan, *weights):
        saved = _add_low_rank(x, out, plan, weights)
        ctx.mark_dirty(out)
        ctx.plan, ctx.ranks = plan, [w.shape[0] for w in weights[::2]]
        ctx.stacks = [stacks for *stacks, _ in saved]
        ctx.save_for_backward(x, *weights, *(low for *_, low in saved))
        return out

    @staticmethod
    def backward(ctx, *grad_outputs):
        (grad_out,) = grad_outputs  # forward has one output
        plan, ranks = ctx.plan, ctx.ranks
        x, rest = ctx.saved_tensors[0], ctx.saved_tensors[1:]
        weights, lows = rest[: 2 * len(ranks)], rest[2 * len(ranks) :]
        grad_x = None
        if ctx.needs_input_grad[0]:
            covered = sum(g.end - g.start for g in plan)
            grad_x = torch.empty_like(x) if covered == x.shape[0] else torch.zeros_like(x)
        grad_weights, offset = [], 0
        for group, low, (a_C_R_I, bt_C_R_O, scale) in zip(plan, lows, ctx.stacks):
            xg = group.x(x, low.dtype)
            g = grad_out[group.start : group.end].to(low.dtype)
            if group.count == 1:
                a_R_I, b_O_R = weights[2 * offset], weights[2 * offset + 1]
                g_N_O = g.reshape(-1, g.shape[-1])
                grad_b = torch.mm(g_N_O.t(), low)
                g_low = torch.mm(g_N_O, b_O_R).mul_(group.scalings[0])
                grad_weights += [torch.mm(g_low.t(), xg), grad_b]
                g_x = torch.mm(g_low, a_R_I) if grad_x is not None else None
            else:
                g_C_N_O = g.reshape(group.count, -1, g.shape[-1])
                grad_bt = torch.bmm(low.transpose(1, 2), g_C_N_O)
                g_low = torch.bmm(g_C_N_O, bt_C_R_O.transpose(1, 2)).mul_(scale)
                grad_a = torch.bmm(g_low.transpose(1, 2), xg)
                for i in range(group.count):
                    r = ranks[offset + i]
                    grad_weights += [grad_a[i, :r], grad_bt[i, :r].t()]
                g_x = torch.bmm(g_low, a_C_R_I) if grad_x is not None else None
            if g_x is not None and grad_x is not None:
                grad_x[group.start : group.end] = group.dropped(g_x.reshape(grad_x[group.start : group.end].shape))
            offset += group.count
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


def unwrap_empty_layers(model: nn.Module, names: list[str]) -> None:
    """Put the plain Linear back wherever a named MultiLoraLinear holds no adapter any more."""
    for name in names:
        layer = model.get_submodule(name)
        if isinstance(layer, MultiLoraLinear) and not layer.lora_A:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer.base_layer)
