"""What a vision-language checkpoint changes for the engines: the class that loads it, and which of
its Linear layers are the language model's.

A Qwen-VL style checkpoint (its config has a ``vision_config``) is not mapped by
``AutoModelForCausalLM``; ``AutoModelForImageTextToText`` loads it with the same ``forward`` plus
image inputs. Its vision tower has Linear layers named like the language model's (``mlp.gate_proj``),
but they run on image patches, not on the batch's token rows, so the multi-LoRA engine, which routes
rows of ``[B, T, D]`` activations to tenants, keeps adapters on the language model only.
"""

from __future__ import annotations

VISION_PREFIXES = ("visual.", "vision_tower.", "vision_model.")


def is_vision_language(config) -> bool:
    return hasattr(config, "vision_config")


def auto_model_class(config):
    """The transformers Auto class that loads a checkpoint with this config."""
    import transformers

    if is_vision_language(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def load_pretrained(path: str, **kwargs):
    """A causal LM or a vision-language model from a local folder, whichever its config is."""
    from transformers import AutoConfig

    trust = {k: kwargs[k] for k in ("trust_remote_code",) if k in kwargs}
    return auto_model_class(AutoConfig.from_pretrained(path, **trust)).from_pretrained(path, **kwargs)


def in_vision_tower(module_name: str) -> bool:
    return any(module_name.startswith(p) or f".{p}" in module_name for p in VISION_PREFIXES)


def language_modules(names: list[str]) -> list[str]:
    """The module names outside the vision tower; an error if that leaves none."""
    kept = [n for n in names if not in_vision_tower(n)]
    if names and not kept:
        raise ValueError(
            f"target_modules match only vision-tower layers ({names[0]}, ...): the multi-LoRA engine "
            "trains adapters on the language model"
        )
    return kept
