"""What one adapter is: its rank, scaling, dropout and which base Linear layers it adapts.

Built from an ordinary `peft.LoraConfig`, so a tenant describes its adapter exactly as it would
for peft, and the saved folder loads back with peft. Features of LoraConfig that this engine does
not implement are refused by name instead of being silently ignored.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from peft import LoraConfig
from torch import nn

from twinkle.model.patterns import compile_pattern

_NAME_RE = re.compile(r"^[A-Za-z0-9_\-]+$")

# LoraConfig fields whose non-default value changes the adapter's maths or its layout: refused.
_UNSUPPORTED = {
    "use_dora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "layers_pattern": None,
    "modules_to_save": None,
    "fan_in_fan_out": False,
    "lora_bias": False,
    "trainable_token_indices": None,
    "layer_replication": None,
    "exclude_modules": None,
}


def check_adapter_name(name: str) -> str:
    # Names become module keys (nn.ModuleDict) and folder names: no dots or slashes.
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"adapter name {name!r} must be non-empty letters, digits, '_' or '-'")
    return name


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    dropout: float
    use_rslora: bool
    target_modules: str | tuple[str, ...]
    config: LoraConfig
    target_parameters: tuple[
        str, ...
    ] = ()  # 3-D expert weights (peft's target_parameters)  # kept to write adapter_config.json

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_lora_config(cls, config: LoraConfig) -> AdapterSpec:
        if not isinstance(config, LoraConfig):
            raise TypeError(f"expected a peft.LoraConfig, got {type(config).__name__}")
        for field, default in _UNSUPPORTED.items():
            value = getattr(config, field, default)
            if value not in (default, None, {}, False):
                raise ValueError(f"LoraConfig.{field}={value!r} is not supported by the multi-LoRA engine")
        if config.bias != "none":
            raise ValueError(f"LoraConfig.bias={config.bias!r} is not supported; use bias='none'")
        if config.init_lora_weights is not True:
            raise ValueError(
                f"LoraConfig.init_lora_weights={config.init_lora_weights!r} is not supported; "
                "only the default (A Kaiming-uniform, B zero)"
            )
        if not isinstance(config.r, int) or config.r <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {config.r!r}")
        if not 0.0 <= config.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {config.lora_dropout!r}")
        params = tuple(sorted(config.target_parameters or ()))
        if params and config.lora_dropout:  # as peft's ParamWrapper: x cannot be factored out of B(A(drop(x)))
            raise ValueError("lora_dropout != 0 does not work with target_parameters (expert weights); use 0")
        targets = config.target_modules
        if targets is None and not params:
            raise ValueError("LoraConfig.target_modules is required (a list of module names, a regex, or 'all-linear')")
        targets = () if targets is None else targets if isinstance(targets, str) else tuple(sorted(targets))
        if isinstance(targets, str) and targets != "all-linear":
            compile_pattern(targets)  # refused here (a ValueError naming the construct), not mid-selection
        return cls(
            config.r,
            float(config.lora_alpha),
            float(config.lora_dropout),
            bool(config.use_rslora),
            targets,
            config,
            params,
        )

    def matches(self, module_name: str) -> bool:
        """peft's rule: a string is a full-match regex, a list matches a name or a dotted suffix. The
        regex runs on twinkle.model.patterns' linear-time matcher (same answers as peft's re.fullmatch)."""
        if isinstance(self.target_modules, str):
            return compile_pattern(self.target_modules).fullmatch(module_name)
        return any(module_name == t or module_name.endswith("." + t) for t in self.target_modules)

    def select(self, model: nn.Module) -> list[str]:
        """Names of the base model's Linear layers this adapter targets; an error if none."""
        from twinkle.model.structure import describe

        structure = describe(model) if self.target_modules == "all-linear" else None
        return self.select_from(linear_names(model), structure)

    def select_from(self, names: list[str], structure=None) -> list[str]:
        """`select` over a list of the base model's Linear names (`linear_names`); 'all-linear' reads
        `structure` (twinkle.model.structure: no router, no output head)."""
        if self.target_modules == "all-linear":
            if structure is None:
                raise TypeError("target_modules='all-linear' is read from the model's structure: pass it")
            every = set(structure.all_linear())
            chosen = [n for n in names if n in every or n.rsplit(".", 1)[-1] in every]
        else:
            chosen = [n for n in names if self.matches(n)]
        if not chosen and not (self.target_parameters and not self.target_modules):
            raise ValueError(f"target_modules={self.target_modules!r} matches no Linear layer of the base model")
        return chosen

    def select_parameters(self, model: nn.Module) -> list[str]:
        """Full names of the 3-D expert weights `target_parameters` names (peft's rule: a name or a
        dotted suffix); an error if one matches nothing or is not an expert weight."""
        from twinkle.model.structure import describe

        return self.select_parameters_from({p.name for p in describe(model).of("experts")})

    def select_parameters_from(self, experts: set[str]) -> list[str]:
        chosen = []
        for target in self.target_parameters:
            hits = [n for n in experts if n == target or n.endswith("." + target)]
            if not hits:
                raise ValueError(
                    f"target_parameters entry {target!r} names no expert weight of the base model "
                    f"(expert weights: {sorted(experts)[:4]}{' ...' if len(experts) > 4 else ''})"
                )
            chosen += hits
        return sorted(set(chosen))


def linear_names(model: nn.Module) -> list[str]:
    """The base model's Linear layers by name, in module order; a layer an adapter already wraps
    counts as its Linear, its inner copy does not."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(getattr(module, "base_layer", module), nn.Linear) and not name.endswith(".base_layer")
    ]
