"""Loading a transformers model: the class for a model id or config, in the dtype asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def load_hf_model(
    model_id: str | None,
    model_cls: type[Any] | str | None,
    config: PretrainedConfig | None,
    torch_dtype: torch.dtype | str | None,
    **kwargs: Any,
) -> tuple[PreTrainedModel, str | None]:
    """(the model, its local path or None): `model_cls` (a class or a transformers class name;
    AutoModelForCausalLM when None) from `model_id`, or built from `config` alone."""
    import transformers

    if isinstance(model_cls, str):
        model_cls = getattr(transformers, model_cls)
    model_cls = model_cls or transformers.AutoModelForCausalLM
    if model_id is None:
        if config is None:
            raise ValueError("give model_id, or model_cls with config")
        if hasattr(model_cls, "from_config"):
            return model_cls.from_config(config, dtype=torch_dtype or torch.float32), None
        return model_cls(config), None
    from twinkle.hub import resolve_model_path

    path = resolve_model_path(model_id)
    if model_cls is transformers.AutoModelForCausalLM and hasattr(
        config or transformers.AutoConfig.from_pretrained(path), "vision_config"
    ):  # a vision-language checkpoint (Qwen2.5-VL...): AutoModelForCausalLM does not map it
        model_cls = transformers.AutoModelForImageTextToText
    # dtype 'auto': as stored (a bf16 checkpoint is never upcast only to be cast down again)
    return model_cls.from_pretrained(path, config=config, dtype=torch_dtype or "auto", **kwargs), path
