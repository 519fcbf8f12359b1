"""The published-shape presets (issue 47) without building them (the 0.6B one is 1.2 GB): the config is
Qwen3-0.6B's, with its parameter count, the real tokenizer's special ids, and the weights' names, shapes
and dtype are what the checkpoint holds. Building and loading it is the `shape` session's job."""

from __future__ import annotations

import pytest
import torch

from twinkle.hub import shaped
from twinkle.hub.qwen_vocab import qwen_tokenizer
from twinkle.hub.tokenizer_assets import ASSETS


@pytest.fixture(scope="module")
def tokenizer(qwen_base_json):
    return qwen_tokenizer(qwen_base_json, (ASSETS / "chat_template.jinja").read_text())


def test_the_0_6b_config_is_qwen3_0_6b(tokenizer):
    from transformers import Qwen3ForCausalLM

    config = shaped.shape_config("qwen3-0.6b-shape", tokenizer)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (1024, 3072, 28)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (16, 8, 128)
    assert config.vocab_size == 151936 and config.tie_word_embeddings
    assert (config.eos_token_id, config.pad_token_id) == (151645, 151643)  # <|im_end|>, <|endoftext|>
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == 596_049_920  # Qwen3-0.6B's 0.6B (0.44B non-embedding)


def test_random_weights_are_bf16_with_unit_norms_and_seeded(tokenizer):
    config = shaped.shape_config("qwen3-0.6b-shape", tokenizer)
    config.num_hidden_layers, config.vocab_size, config.pad_token_id = 1, 1000, 0  # the same rule, a size to draw
    first, again = shaped.random_bf16_weights(config, 0), shaped.random_bf16_weights(config, 0)
    assert "lm_head.weight" not in first  # tied to the embedding, as the checkpoint stores it
    assert first["model.embed_tokens.weight"].shape == (1000, 1024)
    assert {t.dtype for t in first.values()} == {torch.bfloat16}
    assert bool((first["model.norm.weight"] == 1).all())
    assert all(torch.equal(first[k], again[k]) for k in first)
    std = float(first["model.layers.0.mlp.up_proj.weight"].float().std())
    assert std == pytest.approx(config.initializer_range, rel=0.05)


def test_unknown_names_list_the_shapes():
    from twinkle.hub import embedded_path

    with pytest.raises(ValueError, match="twinkle://qwen3-0.6b-shape"):
        embedded_path("twinkle://qwen3-0.7b-shape")
