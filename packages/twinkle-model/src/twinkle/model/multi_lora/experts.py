"""LoRA on MoE experts' 3-D weights for many tenants at once: per-expert A/B factors, grouped matmuls.

transformers holds a MoE layer's experts as one module with 3-D parameters (`gate_up_proj` /
`down_proj`, `[experts, out, in]`, or `[experts, in, out]` where the class says `is_transposed`)
and describes its maths with the attributes its `use_experts_implementation` decorator sets
(`has_gate`, `has_bias`, `_apply_gate`). `MultiLoraExperts` replaces that module and computes the
same thing: each (token, chosen expert) pair goes through its expert's weights, plus its tenant's
low-rank update for that expert, `(x @ A[e].T) @ B[e].T * scaling`. Every product is one grouped
matmul over the (tenant, expert) groups the pairs fall in (`grouped_mm` below), not a Python loop
over experts; tenants of equal rank share one grouped matmul.

Held and saved in the layout of peft's `target_parameters` (`lora.ParamWrapper`): `lora_A.weight`
is `[experts * r, in]` (expert-major), `lora_B.weight` is `[out, r * experts]` (expert-minor), and
the k targeted parameters of one module nest as peft nests them, the first-registered innermost
(`<module>.base_layer.lora_A.weight`). peft refuses dropout on such weights, and so does this.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from twinkle.model.multi_lora.layer import Routing, factor_dtype


def grouped_mm(x_S_I: torch.Tensor, w_G_I_O: torch.Tensor, group_S: torch.Tensor) -> torch.Tensor:
    """Row s of the result is x[s] @ w[group[s]], for any order of rows: the rows of each group are
    packed into a [groups, capacity, in] buffer (capacity = the largest group) and multiplied by one
    `bmm`. Only the groups that occur are multiplied. Differentiable in x and w."""
    used, local_S = torch.unique(group_S, return_inverse=True)
    counts = torch.bincount(local_S, minlength=used.numel())
    order = torch.argsort(local_S, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    pos_S = torch.empty_like(local_S)
    pos_S[order] = torch.arange(local_S.numel(), device=x_S_I.device) - starts[local_S[order]]
    capacity = int(counts.max()) if counts.numel() else 0
    buf = x_S_I.new_zeros(used.numel(), capacity, x_S_I.shape[-1]).index_put((local_S, pos_S), x_S_I)
    w = w_G_I_O if used.numel() == w_G_I_O.shape[0] else w_G_I_O[used]
    return torch.bmm(buf, w)[local_S, pos_S]


class ExpertFactors(nn.Module):
    """One adapter's factors for one 3-D expert weight, stored in peft's ParamWrapper layout
    (`a` [experts * r, in], `b` [out, r * experts]) so saving and loading copy no tensors; the
    per-expert views the pass multiplies are A [experts, r, in] and B [experts, out, r]."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, experts: int, scaling: float, trainable: bool = True):
        super().__init__()
        self.experts, self.scaling = experts, scaling
        self.a = nn.Parameter(a, requires_grad=trainable)
        self.b = nn.Parameter(b, requires_grad=trainable)

    @property
    def rank(self) -> int:
        return self.a.shape[0] // self.experts

    def per_expert(self) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.a.view(self.experts, self.rank, self.a.shape[1])
        b = self.b.view(self.b.shape[0], self.rank, self.experts).permute(2, 0, 1)
        return a, b


class MultiLoraExperts(nn.Module):
    def __init__(self, base_layer: nn.Module, routing: Routing):
        super().__init__()
        for attr in ("has_gate", "has_bias", "is_transposed", "num_experts"):
            if not hasattr(base_layer, attr):
                raise TypeError(
                    f"{type(base_layer).__name__} does not describe its experts (no {attr!r}; transformers' "
                    "use_experts_implementation sets it): LoRA on its expert weights is not supported"
                )
        if getattr(base_layer, "has_post_expert_norm", False):
            raise TypeError(f"{type(base_layer).__name__}: experts with a post-expert norm are not supported")
        # transformers' decorator names its hooks with a leading underscore; they are its experts interface
        if getattr(base_layer, "_is_expert_parallel", False):
            raise TypeError("expert-parallel experts: LoRA on sharded experts needs MegatronModel")
        self.base_layer = base_layer
        self.num_experts: int = getattr(base_layer, "num_experts")
        self.has_gate: bool = getattr(base_layer, "has_gate")
        self.has_bias: bool = getattr(base_layer, "has_bias")
        self.is_transposed: bool = getattr(base_layer, "is_transposed")
        # the gating every transformers experts implementation calls (GPT-OSS clamps and interleaves)
        self.gate_fn = getattr(base_layer, "_apply_gate", None) if self.has_gate else None
        self.routing = routing
        self.lora_experts = nn.ModuleDict()  # parameter name -> {adapter: ExpertFactors}

    def _slot(self, param: str) -> nn.ModuleDict:
        """The adapters on one expert weight (an empty dict, not yet registered, when none)."""
        if param not in self.lora_experts:
            return nn.ModuleDict()
        slot = self.lora_experts[param]
        assert isinstance(slot, nn.ModuleDict)  # what add_adapter and load_adapter register
        return slot

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.has_gate else "up_proj"

    def dims(self, param: str) -> tuple[int, int, int]:
        """(experts, in, out) of one 3-D expert weight."""
        e, d1, d2 = getattr(self.base_layer, param).shape
        return (e, d1, d2) if self.is_transposed else (e, d2, d1)

    def add_adapter(self, name: str, params: list[str], rank: int, scaling: float, generator) -> None:
        for param in params:
            if param not in (self.up_name, "down_proj"):
                raise ValueError(f"{param!r} is not an expert projection of {type(self.base_layer).__name__}")
            slot = self._slot(param)
            if name in slot:
                raise ValueError(f"adapter {name!r} already exists on {param}")
            experts, d_in, d_out = self.dims(param)
            weight = getattr(self.base_layer, param)
            a = torch.empty(experts * rank, d_in, device=weight.device, dtype=factor_dtype(weight))
            with torch.no_grad():  # peft's ParamWrapper init: A as an nn.Linear(in, r * experts), B zero
                nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            b = torch.zeros(d_out, rank * experts, device=weight.device, dtype=a.dtype)
            slot[name] = ExpertFactors(a, b, experts, scaling)
            self.lora_experts[param] = slot

    def load_adapter(self, name: str, param: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """An inference-only adapter on one expert weight from peft-layout factors (A [experts * r, in],
        B [out, r * experts]), sharing their storage (a sampler's adapters)."""
        if param not in (self.up_name, "down_proj"):
            raise KeyError(f"{param!r} is not an expert projection of {type(self.base_layer).__name__}")
        experts, d_in, d_out = self.dims(param)
        if a.dim() != 2 or a.shape[0] % experts or a.shape[1] != d_in or tuple(b.shape) != (d_out, a.shape[0]):
            raise ValueError(
                f"A {tuple(a.shape)} / B {tuple(b.shape)} do not fit {experts} experts of "
                f"{param} ({d_in} -> {d_out}) in peft's layout"
            )
        slot = self._slot(param)
        slot[name] = ExpertFactors(a, b, experts, scaling, trainable=False)
        self.lora_experts[param] = slot

    def adapter_names(self) -> set[str]:
        return {n for param in self.lora_experts for n in self._slot(param)}

    def remove_adapter(self, name: str) -> None:
        for param in list(self.lora_experts):
            slot = self._slot(param)
            if name in slot:
                del slot[name]
            if not len(slot):
                del self.lora_experts[param]

    def has_adapters(self) -> bool:
        return len(self.lora_experts) > 0

    def factors(self, name: str, param: str) -> ExpertFactors:
        f = self._slot(param)[name]
        assert isinstance(f, ExpertFactors)  # what add_adapter puts there
        return f

    def targeted(self, name: str) -> list[str]:
        """The parameters this adapter adapts, in the module's registration order (peft's nesting order)."""
        order = [n for n, _ in self.base_layer.named_parameters(recurse=False)]
        return [p for p in order if name in self._slot(p)]

    def peft_tensors(self, name: str, prefix: str) -> dict[str, torch.Tensor]:
        """This adapter's factors (the parameters themselves) under peft's saved names: the k
        targeted weights of one module nest as peft nests them, the first-registered innermost."""
        params, out = self.targeted(name), {}
        for i, param in enumerate(params):
            f = self.factors(name, param)
            where = prefix + ".base_layer" * (len(params) - 1 - i)
            out[f"{where}.lora_A.weight"], out[f"{where}.lora_B.weight"] = f.a, f.b
        return out

    # ---- the pass -------------------------------------------------------------------------------
    def _slots(self, tokens: int, device) -> tuple[torch.Tensor, list[str | None]] | None:
        """Each token's segment index and the segments' adapter names; None when no segment has an
        adapter here (the base module runs as it is)."""
        names, sizes = self.routing.names, self.routing.sizes
        here = self.adapter_names()
        if not any(n is not None and n in here for n in names):
            return None
        if len(names) == 1:
            return torch.zeros(tokens, dtype=torch.long, device=device), list(names)
        rows = sum(sizes)
        if tokens % rows:
            raise RuntimeError(f"routing covers {rows} rows but the experts got {tokens} tokens")
        per_row = tokens // rows  # tokens are the flattened [rows, time] batch
        counts = torch.tensor(sizes, device=device) * per_row
        return torch.repeat_interleave(torch.arange(len(sizes), device=device), counts), list(names)

    def _low_rank(self, x_S_I, param: str, expert_S, slot_S, names) -> torch.Tensor | None:
        """Every pair's tenant's update for `param`: one pair of grouped matmuls per distinct rank,
        grouped by (tenant, expert)."""
        if param not in self.lora_experts:
            return None
        on = self._slot(param)
        by_rank: dict[int, list[int]] = {}
        for i, n in enumerate(names):
            if n is not None and n in on:
                by_rank.setdefault(self.factors(n, param).rank, []).append(i)
        out = None
        experts = self.num_experts
        for slots in by_rank.values():
            local = torch.full((len(names),), -1, dtype=torch.long, device=x_S_I.device)
            local[slots] = torch.arange(len(slots), device=x_S_I.device)
            pair_local = local[slot_S]
            idx = (pair_local >= 0).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            group = pair_local[idx] * experts + expert_S[idx]
            pairs = [self.factors(names[s], param).per_expert() for s in slots]
            a = torch.cat([p[0] for p in pairs])  # [n * E, r, in]
            b = torch.cat([p[1] for p in pairs])  # [n * E, out, r]
            scalings = [self.factors(names[s], param).scaling for s in slots]
            scale = torch.tensor(scalings, dtype=a.dtype, device=x_S_I.device)
            low = grouped_mm(x_S_I[idx].to(a.dtype), a.transpose(-1, -2), group)
            delta = grouped_mm(low, b.transpose(-1, -2), group) * scale[pair_local[idx]].unsqueeze(1)
            update = torch.zeros(x_S_I.shape[0], delta.shape[1], dtype=delta.dtype, device=delta.device)
            update = update.index_add(0, idx, delta)
            out = update if out is None else out + update
        return out

    def _project(self, x_S_I, param: str, expert_S, slot_S, names) -> torch.Tensor:
        base = self.base_layer
        weight = getattr(base, param)
        w = weight if self.is_transposed else weight.transpose(-1, -2)  # [E, in, out]
        y = grouped_mm(x_S_I, w, expert_S)
        if self.has_bias:
            y = y + getattr(base, f"{param}_bias")[expert_S]
        delta = self._low_rank(x_S_I, param, expert_S, slot_S, names)
        return y if delta is None else (y + delta).to(y.dtype)  # added in the factors' fp32, rounded once

    def forward(self, hidden_states, top_k_index, top_k_weights):
        tokens = hidden_states.shape[0]
        routed = self._slots(tokens, hidden_states.device)
        if routed is None:
            return self.base_layer(hidden_states, top_k_index, top_k_weights)
        slot_T, names = routed
        k = top_k_index.shape[-1]
        token_S = torch.arange(tokens, device=hidden_states.device).repeat_interleave(k)
        expert_S = top_k_index.reshape(-1)
        slot_S = slot_T[token_S]
        h = self._project(hidden_states[token_S], self.up_name, expert_S, slot_S, names)
        h = self.gate_fn(h) if self.gate_fn is not None else getattr(self.base_layer, "act_fn")(h)
        y = self._project(h, "down_proj", expert_S, slot_S, names)
        y = y * top_k_weights.reshape(-1, 1).to(y.dtype)
        return y.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def wrap_experts(model: nn.Module, module_name: str, routing: Routing) -> MultiLoraExperts:
    module = model.get_submodule(module_name)
    if isinstance(module, MultiLoraExperts):
        return module
    parent_name, _, child = module_name.rpartition(".")
    wrapper = MultiLoraExperts(module, routing)
    setattr(model.get_submodule(parent_name) if parent_name else model, child, wrapper)
    return wrapper


def unwrap_empty(model: nn.Module, module_name: str) -> None:
    module = model.get_submodule(module_name)
    if isinstance(module, MultiLoraExperts) and not module.has_adapters():
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module.base_layer)


def by_module(param_names: list[str]) -> dict[str, list[str]]:
    """{experts module: [its targeted parameter names]} from full parameter names."""
    out: dict[str, list[str]] = {}
    for full in param_names:
        module, _, param = full.rpartition(".")
        out.setdefault(module, []).append(param)
    return out
