"""twinkle.model: the one training contract (TwinkleModel) and its engines: TransformersModel (and its
value-model form, TransformersValueModel), MultiLoraModel, MegatronModel. `num_training_steps` gives a
scheduler the optimizer steps a run takes."""

from __future__ import annotations

from typing import Any

_LAZY = {
    "TwinkleModel": "twinkle.model.base",
    "num_training_steps": "twinkle.model.base",
    "MODELS": "twinkle.model.base",
    "MultiLoraModel": "twinkle.model.multi_lora.model",
    "TransformersModel": "twinkle.model.transformers_model",
    "TransformersValueModel": "twinkle.model.value_model",
    "MegatronModel": "twinkle.model.megatron.model",  # needs the megatron extra when built
    "AdapterState": "twinkle.model.state",
    "CosineWarmupScheduler": "twinkle.model.optim",
    "LinearWarmupScheduler": "twinkle.model.optim",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:  # a class or function of the submodule that owns `name`
    # Lazy: `import twinkle.model` must not pull in torch models (or megatron) until one is used.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'twinkle.model' has no attribute {name!r}")
