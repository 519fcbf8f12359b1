"""Tiny random models of the architecture families users train, built offline from transformers'
own config classes (hidden 64, 2 layers), for tests and the conformance matrix.

Each family sets only what the config class needs to be small and valid; the family's own
defaults (tied embeddings, sliding windows, softcapping, multipliers, MLA, experts) stay on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "gpt_oss",
    "deepseek_v3",
    "granite",
)

_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_EXTRA = {
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=None),
    "deepseek_v3": dict(
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        num_key_value_heads=4,  # MLA has no grouped kv heads (real DeepSeek-V3: 128 and 128)
        head_dim=8,  # the rotary part's width (qk_rope_head_dim): transformers builds the rope tables from it
        first_k_dense_replace=1,  # layer 0 dense MLP, layer 1 experts + shared experts
    ),
}


def tiny_config(family: str, vocab_size: int = 256) -> PretrainedConfig:
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return AutoConfig.for_model(family, vocab_size=vocab_size, **{**_COMMON, **_EXTRA.get(family, {})})


def tiny_model(family: str, vocab_size: int = 256, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised fp32 causal LM of this family (deterministic for a seed)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, vocab_size)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
