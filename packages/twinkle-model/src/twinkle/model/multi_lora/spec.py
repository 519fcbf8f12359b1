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
    "target_parameters": None,
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
    config: LoraConfig  # kept to write adapter_config.json

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_lora_config(cls, config: LoraConfig) -> "AdapterSpec":
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
        targets = config.target_modules
        if targets is None:
            raise ValueError("LoraConfig.target_modules is required (a list of module names, a regex, or 'all-linear')")
        targets = targets if isinstance(targets, str) else tuple(sorted(targets))
        return cls(
            config.r, float(config.lora_alpha), float(config.lora_dropout), bool(config.use_rslora), targets, config
        )

    def matches(self, module_name: str) -> bool:
        """peft's rule: a string is a full-match regex, a list matches a name or a dotted suffix."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module_name) is not None
        return any(module_name == t or module_name.endswith("." + t) for t in self.target_modules)

    def select(self, model: nn.Module) -> list[str]:
        """Names of the base model's Linear layers this adapter targets; an error if none."""
        every: set[str] = set()
        if self.target_modules == "all-linear":  # read from the structure: no router, no output head
            from twinkle.model.structure import describe

            every = set(describe(model).all_linear())
        names = []
        for name, module in model.named_modules():
            # a layer another adapter already wrapped counts as its Linear; its inner copy does not
            linear = getattr(module, "base_layer", module)
            if not isinstance(linear, nn.Linear) or name.endswith(".base_layer"):
                continue
            if self.target_modules == "all-linear":
                if name in every or name.rsplit(".", 1)[-1] in every:
                    names.append(name)
            elif self.matches(name):
                names.append(name)
        if not names:
            raise ValueError(f"target_modules={self.target_modules!r} matches no Linear layer of the base model")
        return names
