"""A Linear layer carrying any number of LoRA adapters, each row of a batch routed to its own.

One shared base GEMM runs over the whole batch (all tenants' rows at once); then each contiguous
run of rows gets its own adapter's low-rank update, `B(A(dropout(x))) * scaling`, at that adapter's
own rank. Autograd sees ordinary ops (split / two small matmuls / cat), so training works and each
adapter's gradient comes only from its own rows. Parameter names follow peft's in-memory layout
(`<layer>.lora_A.<adapter>.weight`), so saving to a peft folder is a rename.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from twinkle.model.multi_lora import one_adapter


class RoutingState(NamedTuple):
    names: tuple[str | None, ...]
    sizes: tuple[int, ...]
    lengths: tuple[int, ...]
    training: bool


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

    def state(self) -> RoutingState:
        """What this pass is routed as, to reinstate later (an activation-checkpoint recompute)."""
        return RoutingState(self.names, self.sizes, self.lengths, self.training)

    def load(self, state: RoutingState) -> None:
        self.names, self.sizes, self.lengths, self.training = state


def factor_dtype(base_weight: torch.Tensor) -> torch.dtype:
    """LoRA factors (and so their optimizer state) never in half precision: fp32 on a bf16 or fp16
    base, as peft keeps them; the base's own dtype when that is fp32 or fp64."""
    return base_weight.dtype if base_weight.dtype in (torch.float32, torch.float64) else torch.float32


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
        dtype = factor_dtype(weight)
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
        length = min(length, x_seg.shape[1]) if x_seg.dim() == 3 else length  # a chunk of the time axis
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
        name = segments[0][2]
        if (  # one adapter over every row, inference: the few-op path (a served decode step)
            len(segments) == 1
            and segments[0][1] - segments[0][0] == x.shape[0]
            and not torch.is_grad_enabled()
            and not (self.routing.training and self.dropout[name])
        ):
            a, b = self.lora_A[name].weight, self.lora_B[name].weight
            one_adapter.add_update(x, out, a, b, self.scaling[name])  # ty: ignore[invalid-argument-type]
            return out
        plan = self._plan(x, segments)
        weights = [w for _, _, name, _ in segments for w in (self.lora_A[name].weight, self.lora_B[name].weight)]
        if not torch.is_grad_enabled():
            _add_low_rank(x, out, plan, weights)
            return out
        return _MultiLoraAdd.apply(x, out, plan, *weights)

    def _plan(self, x: torch.Tensor, segments: list[tuple[int, int, str, int]]) -> list[_Group]:
        """Consecutive segments of equal size and equal rank form one group, one batched matmul.
        Tenants of different ranks are never padded to a common rank: on CPU the padded products
        cost more than the separate calls they save (ranks 8/16/32/8 do twice the work at 32)."""
        groups: list[_Group] = []
        for start, end, name, length in segments:
            keep = self._keep_mask(name, x[start:end], length)
            rank = int(self.lora_A[name].weight.shape[0])  # ty: ignore[not-subscriptable]
            last = groups[-1] if groups else None
            if last is not None and last.end == start and last.size == end - start and last.rank == rank:
                last.add(end, self.scaling[name], keep)
            else:
                groups.append(_Group(start, end, rank, [self.scaling[name]], [keep]))
        return groups


class _Group:
    """A run of consecutive, equally sized segments whose adapters share one rank: `count`
    tenants of `size` rows each. One tenant: plain matmuls. Several: their factors stacked and one
    `bmm` per product over the tenants, the segmented LoRA matmul of punica/S-LoRA done with a
    stock kernel."""

    def __init__(self, start: int, end: int, rank: int, scalings: list[float], keeps: list[torch.Tensor | None]):
        self.start, self.end, self.size, self.rank = start, end, end - start, rank
        self.scalings, self.keeps, self.count = scalings, keeps, 1
        self.masked: list[bool] = []  # which tenants' masks release_masks took out
        self.drops = keeps[0] is not None

    def add(self, end: int, scaling: float, keep) -> None:
        self.end = end
        self.scalings.append(scaling)
        self.keeps.append(keep)
        self.count += 1
        self.drops |= keep is not None

    def release_masks(self) -> list[torch.Tensor]:
        """This group's dropout masks, taken out of the plan: the caller saves them as autograd saved
        tensors, which an activation checkpoint frees with the other activations (a mask on the plan
        would stay alive until backward); `restore_masks` puts them back."""
        masks = [k for k in self.keeps if k is not None]
        self.masked = [k is not None for k in self.keeps]
        self.keeps = [None] * len(self.keeps)
        return masks

    def restore_masks(self, masks: Iterator[torch.Tensor]) -> None:
        self.keeps = [next(masks) if masked else None for masked in self.masked]

    def scale(self, like: torch.Tensor) -> float | torch.Tensor:
        """The scalings as one number when the tenants agree (most do), else [count, 1, 1]."""
        first = self.scalings[0]
        if all(s == first for s in self.scalings):
            return first
        return torch.tensor(self.scalings, dtype=like.dtype, device=like.device).view(-1, 1, 1)

    def dropped(self, t: torch.Tensor) -> torch.Tensor:
        """t (this group's rows) times each tenant's dropout mask; t itself when no tenant drops."""
        if not self.drops:
            return t
        return t * torch.cat([torch.ones_like(t[: self.size]) if k is None else k for k in self.keeps])

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This group's rows of t (an input or a gradient) as [count, tokens, features], or
        [tokens, features] for one tenant: a view of t when t is contiguous, else a copy."""
        return self.shaped(t[self.start : self.end])

    def into(self, t: torch.Tensor) -> torch.Tensor:
        """Like `rows`, but always a view (raises otherwise): for tensors written in place."""
        part = t[self.start : self.end]
        return part.view(self.count, -1, part.shape[-1]) if self.count > 1 else part.view(-1, part.shape[-1])

    def shaped(self, part: torch.Tensor) -> torch.Tensor:
        return part.reshape(self.count, -1, part.shape[-1]) if self.count > 1 else part.reshape(-1, part.shape[-1])

    def x(self, x: torch.Tensor, dtype, x_in: torch.Tensor | None = None) -> torch.Tensor:
        """This group's rows of x, dropout applied, in the adapters' dtype: a view of `x_in` (x already
        in that dtype, `_in_dtype`) where no tenant of the group drops; a mask applies to x as given."""
        if x_in is not None and not self.drops:
            return self.shaped(x_in[self.start : self.end])
        part = self.dropped(x[self.start : self.end])
        return self.shaped(part if part.dtype == dtype else part.to(dtype))

    def factors(self, weights, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of this group: [r, in] and [out, r] for one tenant, stacked [count, ...] for several."""
        a = weights[2 * offset : 2 * (offset + self.count) : 2]
        b = weights[2 * offset + 1 : 2 * (offset + self.count) : 2]
        return (a[0], b[0]) if self.count == 1 else (torch.stack(a), torch.stack(b))


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b) if a.dim() == 2 else torch.bmm(a, b)


def _t(t: torch.Tensor) -> torch.Tensor:
    """The last two dims swapped (a view: the GEMM reads it transposed, nothing is copied)."""
    return t.transpose(-1, -2)


def _in_dtype(t: torch.Tensor, plan: list[_Group], dtype: torch.dtype) -> torch.Tensor:
    """t's routed rows in `dtype`, in one conversion for every group (rows outside them left unset:
    never read); t itself when it is in `dtype` already. One op, not one per group: on a shared
    machine each op is a parallel region, whose threads spin while one of them waits for a core."""
    if t.dtype == dtype:
        return t
    span = slice(plan[0].start, plan[-1].end)
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    out[span].copy_(t[span])
    return out


def _buffer(like: torch.Tensor, plan: list[_Group], dtype: torch.dtype, whole: bool) -> torch.Tensor:
    """A tensor shaped like `like` in `dtype` that the groups write their rows into; the rows no group
    writes are zero: those between the groups, and with `whole` those before and after them too."""
    rows = like.shape[0] if whole else plan[-1].end - plan[0].start
    covered = sum(g.size for g in plan) == rows
    return (torch.empty if covered else torch.zeros)(like.shape, dtype=dtype, device=like.device)


def _x_in(x: torch.Tensor, plan: list[_Group], dtype: torch.dtype) -> torch.Tensor | None:
    """x in the factors' dtype for the groups that draw no dropout (`_Group.x`; a mask applies to x
    as given, so those groups convert their own rows); None when every group draws."""
    return None if all(g.drops for g in plan) else _in_dtype(x, plan, dtype)


def _add_low_rank(x, out, plan, weights) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """out[rows] += (scaling * (x[rows] * keep) @ A.T) @ B.T for every group, in place; returns
    per group what backward needs: its (A, B), stacked for several tenants, and the scaled
    rank-r activations. fp32 adapters on a bf16 base: x converted once, every group's product
    written into one fp32 buffer, added and rounded to the base's dtype once (as peft does)."""
    saved, offset = [], 0
    dtype = weights[0].dtype
    x_in = _x_in(x, plan, dtype)
    acc = None if out.dtype == dtype else _buffer(out, plan, dtype, whole=False)
    for group in plan:
        a, b = group.factors(weights, offset)
        low = _mm(group.x(x, dtype, x_in), _t(a)).mul_(group.scale(a))
        if acc is None:
            out_g = group.into(out)
            (out_g.addmm_ if group.count == 1 else out_g.baddbmm_)(low, _t(b))
        else:
            (torch.mm if group.count == 1 else torch.bmm)(low, _t(b), out=group.into(acc))
        saved.append((a, b, low))
        offset += group.count
    if acc is not None:
        span = slice(plan[0].start, plan[-1].end)
        out[span].add_(acc[span])
    return saved


class _MultiLoraAdd(torch.autograd.Function):
    """Adds every segment's low-rank update into the base output in place: one autograd node per
    layer however many tenants share the batch, no split/cat copies of the activations. Backward
    hands the output gradient through unchanged (the base path) and adds the adapters' parts:
    per group four GEMMs that read their operands transposed in place (no transposed copies),
    each weight gradient in its weight's own layout, the input gradient written straight into
    its rows."""

    @staticmethod
    def forward(ctx, x, out, plan, *weights):
        saved = _add_low_rank(x, out, plan, weights)
        ctx.mark_dirty(out)
        ctx.plan = plan
        # a tenant's own factors are saved as inputs (autograd checks them); stacks are fresh copies
        ctx.stacks = [(a, b) if group.count > 1 else None for group, (a, b, _) in zip(plan, saved)]
        masks = [m for group in plan for m in group.release_masks()]
        ctx.save_for_backward(x, *weights, *(low for _, _, low in saved), *masks)
        ctx.n_weights = len(weights)
        return out

    @staticmethod
    def backward(ctx, *grad_outputs):
        (grad_out,) = grad_outputs  # forward has one output
        plan = ctx.plan
        # unpacked once: a non-reentrant checkpoint hands each recomputed tensor out a single time
        saved = ctx.saved_tensors
        x, weights = saved[0], saved[1 : 1 + ctx.n_weights]
        lows = saved[1 + ctx.n_weights : 1 + ctx.n_weights + len(plan)]
        masks = iter(saved[1 + ctx.n_weights + len(plan) :])
        for group in plan:
            group.restore_masks(masks)
        dtype = weights[0].dtype
        # one conversion of the output gradient and of x for all groups (not one per group)
        g_all = _in_dtype(grad_out, plan, dtype)
        x_in = _x_in(x, plan, dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:  # written in the factors' dtype, converted to x's once at the end
            grad_x = _buffer(x, plan, dtype, whole=True)
        grad_weights, offset = [], 0
        for group, low, stack in zip(plan, lows, ctx.stacks):
            a, b = stack or (weights[2 * offset], weights[2 * offset + 1])
            g = group.rows(g_all)
            grad_b = _mm(_t(g), low)  # [(count,) out, r]
            g_low = _mm(g, b).mul_(group.scale(low))
            grad_a = _mm(_t(g_low), group.x(x, dtype, x_in))  # [(count,) r, in]
            if group.count == 1:
                grad_weights += [grad_a, grad_b]
            else:
                grad_weights += [w for pair in zip(grad_a.unbind(), grad_b.unbind()) for w in pair]
            if grad_x is not None:
                rows = group.into(grad_x)
                (torch.mm if group.count == 1 else torch.bmm)(g_low, a, out=rows)
                if group.drops:
                    part = grad_x[group.start : group.end]
                    part.copy_(group.dropped(part))
            offset += group.count
        if grad_x is not None and grad_x.dtype != x.dtype:
            grad_x = grad_x.to(x.dtype)
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
