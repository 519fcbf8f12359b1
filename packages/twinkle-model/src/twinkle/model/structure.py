"""One description of a causal LM's trainable structure: which weights are attention, MLP, experts,
router and unembedding, and how each splits under tensor parallelism.

Every reader of "which modules does this flag mean" (the server's train_attn / train_mlp /
train_unembed, LoRA target selection, the tp planner) asks `describe(model)` instead of keeping
its own list of module names. The roles are derived from the loaded modules: a decoder layer's
attention child, its MLP child, the 3-D parameters whose first dim is the config's expert count,
the Linear (or weight) that scores experts, and `get_output_embeddings()`. Only how a projection
splits under tp needs names, because the module cannot say it; that is the `TP_LAYOUT` table below.
An architecture whose layers do not look like this falls back to discovering Linear layers and
lists, in `unplaced`, the weights it could not give a role.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import PretrainedConfig

ROLES = ("attention", "mlp", "experts", "router", "unembedding")

# How a projection splits over tp ranks, by its leaf name; anything else is "unknown" (refused).
# "fused" and "low_rank" name layouts the planner cannot split yet, so tp refuses them by name.
TP_LAYOUT = {
    "q_proj": "col",
    "k_proj": "col",
    "v_proj": "col",
    "gate_proj": "col",
    "up_proj": "col",
    "o_proj": "row",
    "down_proj": "row",
    "qkv_proj": "fused",  # Phi-3: q, k and v stacked on the output dim
    "gate_up_proj": "fused",  # Phi-3: gate and up stacked
    "q_a_proj": "low_rank",  # DeepSeek MLA: down-projection to the latent rank, then a norm
    "q_b_proj": "low_rank",
    "kv_a_proj_with_mqa": "low_rank",
    "kv_b_proj": "low_rank",
}
_ATTENTION_CHILDREN = ("self_attn", "attention", "attn")
_MLP_CHILDREN = ("mlp", "feed_forward", "block_sparse_moe")
_ROUTER_NAMES = ("gate", "router")
# parameters owned by an attention module itself (not a projection): split with the heads
_HEAD_PARAMS = ("sinks",)


@dataclass(frozen=True)
class Part:
    """One trainable weight: a Linear module (`param` None) or a 3-D expert parameter."""

    module: str  # the module's full name in the model
    role: str
    tp: str  # col | row | fused | low_rank | experts | replicate | unknown
    param: str | None = None  # the parameter's name on `module` for 3-D expert weights
    experts: int | None = None  # expert count (the first dim) of an expert weight

    @property
    def leaf(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}" if self.param else self.module


@dataclass
class Structure:
    model_type: str | None
    parts: list[Part] = field(default_factory=list)
    head_params: list[str] = field(default_factory=list)  # e.g. GPT-OSS sinks: per-head, non-Linear
    unplaced: list[str] = field(default_factory=list)  # trainable weights no role was found for

    def of(self, *roles: str) -> list[Part]:
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown role(s) {sorted(unknown)}; roles are {ROLES}")
        return [p for p in self.parts if p.role in roles]

    def linear_targets(self, *roles: str) -> list[str]:
        """peft `target_modules` naming exactly the Linear parts of these roles: their leaf names when
        no module of another role shares one, else full module names."""
        return self._names([p.module for p in self.of(*roles) if p.param is None])

    def all_linear(self) -> list[str]:
        """What peft's 'all-linear' means, without its holes: every attention and MLP Linear (dense,
        shared-expert, fused, MLA) and any Linear no role was found for; not the router or the head."""
        return self._names([p.module for p in self.of("attention", "mlp") if p.param is None] + self.unplaced)

    def _names(self, chosen: list[str]) -> list[str]:
        leaves = {m.rsplit(".", 1)[-1] for m in chosen}
        others = {p.leaf for p in self.parts if p.param is None and p.module not in chosen}
        return sorted(chosen) if leaves & others else sorted(leaves)

    def expert_parameters(self, *roles: str) -> list[str]:
        """peft `target_parameters` naming the 3-D expert weights of these roles (by full name)."""
        return sorted(p.name for p in self.of(*roles) if p.param is not None)


def _expert_count(config: PretrainedConfig | None) -> int | None:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(config, key, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def decoder_layer_list(model: nn.Module) -> list[nn.Module]:
    """The language model's decoder layers as transformers exposes them (`get_decoder().layers`; a
    vision-language model's text decoder); empty when the model has no such list."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    # the decoder blocks: the longest ModuleList of modules that own an attention child
    best: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            blocks = [(f"{name}.{i}", b) for i, b in enumerate(module)]
            if blocks and all(any(hasattr(b, c) for c in _ATTENTION_CHILDREN) for _, b in blocks):
                best = blocks if len(blocks) > len(best) else best
    return best


def _linear(module: nn.Module) -> nn.Module:
    return getattr(module, "base_layer", module)  # a peft-wrapped layer counts as its base Linear


def _walk(prefix: str, module: nn.Module, role: str, n_experts: int | None, out: Structure) -> None:
    for name, sub in module.named_modules(prefix=prefix):
        if name.endswith(".base_layer") or ".lora_" in name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        lin = _linear(sub)
        if role == "mlp" and leaf in _ROUTER_NAMES and n_experts:
            weight = getattr(lin, "weight", None)
            if weight is not None and weight.dim() == 2 and weight.shape[0] == n_experts:
                out.parts.append(Part(name, "router", "replicate"))
                continue
        if isinstance(lin, nn.Linear):
            out.parts.append(Part(name, role, TP_LAYOUT.get(leaf, "unknown")))
            continue
        for pname, p in lin.named_parameters(recurse=False):  # a wrapped experts module: its base's
            if n_experts and p.dim() == 3 and p.shape[0] == n_experts:
                out.parts.append(Part(name, "experts", "experts", pname, n_experts))
            elif role == "attention" and pname in _HEAD_PARAMS:
                out.head_params.append(f"{name}.{pname}")


def describe(model: nn.Module) -> Structure:
    """The structure of a transformers causal LM (or any module with decoder-layer-like blocks)."""
    config = getattr(model, "config", None)
    out = Structure(getattr(config, "model_type", None))
    n_experts = _expert_count(config)
    for prefix, block in _layers(model):
        for child in _ATTENTION_CHILDREN:
            if hasattr(block, child):
                _walk(f"{prefix}.{child}", getattr(block, child), "attention", n_experts, out)
                break
        for child in _MLP_CHILDREN:
            if hasattr(block, child):
                _walk(f"{prefix}.{child}", getattr(block, child), "mlp", n_experts, out)
                break
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if get_output is not None else None
    placed = {id(_linear(m)) for n, m in model.named_modules() if n in {p.module for p in out.parts}}
    for name, module in model.named_modules():
        if head is not None and module is head:
            out.parts.append(Part(name, "unembedding", "replicate"))
            placed.add(id(_linear(module)))
    if not out.parts:  # an architecture this does not know: every Linear, no roles
        out.unplaced = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        return out
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module) not in placed and not _inside_adapter(name):
            out.unplaced.append(name)
    return out


def _inside_adapter(name: str) -> bool:
    return ".lora_" in name or name.endswith(".base_layer")


def with_explicit_targets(model: nn.Module, config: LoraConfig) -> LoraConfig:
    """A copy of a peft LoraConfig whose 'all-linear' is spelled out from the model's structure, so
    peft wraps what `Structure.all_linear` names; any other config is returned as it is."""
    import copy

    if getattr(config, "target_modules", None) != "all-linear":
        return config
    config = copy.deepcopy(config)
    # a set, as LoraConfig.__post_init__ keeps it (its annotation says list)
    config.target_modules = set(describe(model).all_linear())  # ty: ignore[invalid-assignment]
    return config
