"""MegatronModel: the TwinkleModel API on megatron-core's GPTModel (extra `twinkle-model[megatron]`).

`convert` (HF Qwen3 <-> Megatron names, config translation, TP/PP shards) is pure torch and
imports without the extra; `MegatronModel` imports megatron-core only when built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinkle.model.megatron.model import MegatronModel


def __getattr__(name: str) -> type[MegatronModel]:
    if name == "MegatronModel":
        from twinkle.model.megatron.model import MegatronModel

        return MegatronModel
    raise AttributeError(f"module 'twinkle.model.megatron' has no attribute {name!r}")
