"""Refuse, by name, a peft adapter that would silently cover less than its config names.

On transformers 5, peft rewrites the LoraConfig of MoE families whose v4 checkpoints it converts
(`convert_peft_config_for_transformers`; DeepSeek-V3 and Qwen2-MoE patterns): every target named
`gate_proj` / `up_proj` / `down_proj` becomes the fused experts' `target_parameters`, so a dense MLP
and the shared experts, which are still `nn.Linear` layers of those names, lose their LoRA without a
word. TransformersModel runs the same rewrite on a copy first and refuses when it would drop a
Linear the config names; MultiLoraModel (its own layers, no rewrite) trains those families whole.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from peft import LoraConfig


def _matched(model: nn.Module, config: LoraConfig) -> set[str]:
    from peft.tuners.tuners_utils import check_target_module_exists

    return {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and check_target_module_exists(config, name)
    }


def dropped_by_peft(model: nn.Module, config: LoraConfig) -> list[str]:
    """The Linear layers `config` names that peft's v5 MoE rewrite would leave without LoRA."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a peft without the rewrite drops nothing
        return []
    if not isinstance(getattr(config, "target_modules", None), (list, set, tuple)):
        return []  # 'all-linear' is spelled out before this (structure.with_explicit_targets)
    rewritten = copy.deepcopy(config)
    convert_peft_config_for_transformers(rewritten, model=model, conversions=None)
    return sorted(_matched(model, config) - _matched(model, rewritten))


def refuse_peft_holes(model: nn.Module, config: LoraConfig) -> None:
    dropped = dropped_by_peft(model, config)
    if dropped:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(
            f"peft would silently leave {len(dropped)} targeted Linear layers of this {model_type} model "
            f"without LoRA ({', '.join(dropped[:3])}{' ...' if len(dropped) > 3 else ''}): its transformers-5 "
            "MoE rewrite maps every gate_proj/up_proj/down_proj target to the experts. Use MultiLoraModel, "
            "which adapts them, or target only attention and the experts (target_parameters)"
        )
