"""LoRA adapter weights as plain tensors, independent of peft's module classes.

A sampler never holds a peft model: it holds one base model and, per adapter, the two LoRA factors of
every targeted Linear plus its scaling. That is all a trainer→sampler sync has to move (adapter-only,
never a merged base), and it lets one batch route each row through its own adapter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

# How peft prefixes module paths: PeftModel -> LoraModel -> the wrapped transformers model.
_PEFT_PREFIXES = ("base_model.model.",)


@dataclass
class AdapterWeights:
    """LoRA factors keyed by the *base model's* module path (e.g. `model.layers.0.self_attn.q_proj`).

    `lora_A[path]` is [r, in_features], `lora_B[path]` is [out_features, r]; the layer computes
    `base(x) + scaling[path] * (x @ A.T) @ B.T`. A MoE expert weight is keyed by the parameter's
    path (`model.layers.0.mlp.experts.gate_up_proj`) with peft's ParamWrapper layout: A
    [experts * r, in], B [out, r * experts] (the router splits them per expert). Read from a peft
    folder, expert factors are keyed as peft nests them (`...experts.base_layer`) and
    `meta["target_parameters"]` says which weights they are; the router resolves them on the model.
    """

    lora_A: dict[str, torch.Tensor]
    lora_B: dict[str, torch.Tensor]
    scaling: dict[str, float]
    version: int = 0
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if set(self.lora_A) != set(self.lora_B) or set(self.lora_A) != set(self.scaling):
            raise ValueError("AdapterWeights: lora_A, lora_B and scaling must name the same modules")
        for path, a in self.lora_A.items():
            b = self.lora_B[path]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise ValueError(
                    f"AdapterWeights: {path}: lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)} are not [r, in] and [out, r]"
                )

    @property
    def modules(self) -> list[str]:
        return sorted(self.lora_A)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.lora_A, self.lora_B) for t in d.values())

    def to(self, device=None, dtype=None) -> AdapterWeights:
        """Same tensors when device and dtype already match (no copy), converted ones otherwise."""

        def move(t):
            return t.detach().to(device=device or t.device, dtype=dtype or t.dtype)

        return AdapterWeights(
            {k: move(v) for k, v in self.lora_A.items()},
            {k: move(v) for k, v in self.lora_B.items()},
            dict(self.scaling),
            self.version,
            dict(self.meta),
        )

    def clone(self) -> AdapterWeights:
        return AdapterWeights(
            {k: v.detach().clone() for k, v in self.lora_A.items()},
            {k: v.detach().clone() for k, v in self.lora_B.items()},
            dict(self.scaling),
            self.version,
            dict(self.meta),
        )


def _strip_prefix(path: str) -> str:
    for prefix in _PEFT_PREFIXES:
        if path.startswith(prefix):
            return path[len(prefix) :]
    return path


def find_torch_module(model) -> nn.Module:
    """The nn.Module inside `model`: itself, or the module a wrapper (TransformersModel) holds."""
    if isinstance(model, nn.Module):
        return model
    # TransformersModel keeps its peft wrapper in `peft_model` and the bare model in `hf_model`.
    for attr in ("peft_model", "hf_model", "model", "module", "_model"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module):
            return inner
    raise TypeError(
        f"cannot find a torch module inside {type(model).__name__}: pass an nn.Module, "
        "a peft model, or an object with a `.model` nn.Module"
    )


def extract_adapter(model, adapter_name: str = "default", version: int = 0) -> AdapterWeights:
    """The LoRA factors of `adapter_name` in a peft-wrapped model, *sharing storage* with it (no copy)."""
    module = find_torch_module(model)
    lora_A, lora_B, scaling = {}, {}, {}
    known: set[str] = set()
    experts: set[str] = set()  # 3-D expert weights (peft's ParamWrapper)
    for path, sub in module.named_modules():
        a_dict = getattr(sub, "lora_A", None)
        if not isinstance(a_dict, nn.ModuleDict):
            continue
        known.update(a_dict.keys())
        if adapter_name not in a_dict:
            continue
        if getattr(sub, "use_dora", {}).get(adapter_name, False):
            raise NotImplementedError(f"adapter {adapter_name!r} uses DoRA at {path}: samplers serve plain LoRA only")
        base = sub.get_base_layer() if hasattr(sub, "get_base_layer") else getattr(sub, "base_layer", None)
        weight_name = getattr(sub, "parameter_name", None)  # peft's ParamWrapper: LoRA on a 3-D expert weight
        if weight_name is not None and not isinstance(base, nn.Linear):
            key = f"{_strip_prefix(_strip_nesting(path))}.{weight_name}"
            experts.add(key)
            lora_A[key] = a_dict[adapter_name].weight.detach()
            lora_B[key] = sub.lora_B[adapter_name].weight.detach()
            scaling[key] = float(sub.scaling[adapter_name])
            continue
        if not isinstance(base, nn.Linear):
            raise NotImplementedError(
                f"adapter {adapter_name!r} targets {type(base).__name__} at {path}: "
                "samplers serve LoRA on nn.Linear layers only"
            )
        key = _strip_prefix(path)
        lora_A[key] = a_dict[adapter_name].weight.detach()
        lora_B[key] = sub.lora_B[adapter_name].weight.detach()
        scaling[key] = float(sub.scaling[adapter_name])
    if not lora_A:
        raise KeyError(f"no LoRA adapter named {adapter_name!r} in the model; adapters present: {sorted(known)}")
    meta = {"adapter_name": adapter_name, "target_parameters": sorted(experts)}
    return AdapterWeights(lora_A, lora_B, scaling, version=version, meta=meta)


def _strip_nesting(path: str) -> str:
    """The module a chain of peft wrappers (`x.base_layer.base_layer`) stands for."""
    while path.endswith(".base_layer"):
        path = path[: -len(".base_layer")]
    return path


def _names_expert_weight(module: str, targets) -> bool:
    """Whether some target_parameters entry names a weight of `module` (peft's suffix rule)."""
    for target in targets:
        full = f"{module}.{target.rsplit('.', 1)[-1]}"
        if full == target or full.endswith("." + target):
            return True
    return False


def _pattern_value(pattern: dict, path: str, default):
    # peft matches rank/alpha pattern keys against the end of the module path.
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?{key}$", path):
            return value
    return default


def load_adapter_folder(path: str | Path, version: int = 0) -> AdapterWeights:
    """Read a saved peft LoRA folder (`twinkle.model.checkpoint.load_adapter`) as plain factors."""
    from twinkle.model import checkpoint

    folder = Path(path)
    config, tensors = checkpoint.load_adapter(folder)
    if config.use_dora:
        raise NotImplementedError(f"{folder}: DoRA adapters are not served by samplers")
    lora_A, lora_B, scaling = {}, {}, {}
    for key, tensor in tensors.items():
        m = re.match(r"(.*)\.lora_([AB])(?:\.[^.]+)?\.weight$", key)
        if not m:
            raise NotImplementedError(f"{folder}: unsupported tensor {key!r} (plain LoRA on Linear only)")
        module, which = _strip_prefix(m.group(1)), m.group(2)
        (lora_A if which == "A" else lora_B)[module] = tensor
    targets = config.target_parameters or ()
    for module, a in lora_A.items():
        # an expert weight's A is [experts * r, in]: its rank is the config's, not A's first dim
        r = config.r if _names_expert_weight(_strip_nesting(module), targets) else a.shape[0]
        alpha = _pattern_value(config.alpha_pattern or {}, module, config.lora_alpha)
        scaling[module] = alpha / math.sqrt(r) if config.use_rslora else alpha / r
    meta = {"source": str(folder), "target_parameters": sorted(config.target_parameters or ())}
    return AdapterWeights(lora_A, lora_B, scaling, version=version, meta=meta)


def save_adapter_folder(weights: AdapterWeights, path: str | Path, base_model_path: str | None = None) -> Path:
    """Write `weights` as a peft LoRA folder (what vLLM's LoRARequest loads), in the one checkpoint
    format of `twinkle.model.checkpoint`. Needs one rank and one scaling."""
    from peft import LoraConfig

    from twinkle.model import checkpoint

    ranks = {a.shape[0] for a in weights.lora_A.values()}
    scalings = set(weights.scaling.values())
    if len(ranks) != 1 or len(scalings) != 1:
        raise ValueError(
            f"cannot write a single-rank adapter folder: ranks {sorted(ranks)}, scalings {sorted(scalings)}"
        )
    r, s = ranks.pop(), scalings.pop()
    tensors = {}
    for module in weights.modules:
        tensors[f"base_model.model.{module}.lora_A.weight"] = weights.lora_A[module]
        tensors[f"base_model.model.{module}.lora_B.weight"] = weights.lora_B[module]
    alpha = s * r
    # peft annotates lora_alpha as int, but scales by alpha / r for any number: a fractional one is kept
    config = LoraConfig(
        r=r,
        lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,  # ty: ignore[invalid-argument-type]
        lora_dropout=0.0,
        target_modules=sorted({m.rsplit(".", 1)[-1] for m in weights.modules}),
        bias="none",
    )
    checkpoint.save_adapter(path, config, tensors, base_model_path)
    return Path(path)
