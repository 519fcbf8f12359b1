"""The benchmark preset `twinkle://qwen3-small`: ~51M parameters, pinned, never built by unit tests."""

import torch

from twinkle.hub.embedded import PINNED_WEIGHTS, PRESETS, SMALL_MODEL, build_model, build_tokenizer


def test_small_preset_shape_and_parameter_count_without_building_weights():
    with torch.device("meta"):  # the architecture only: no init, no bytes, no cache folder
        model = build_model("qwen3-small", build_tokenizer())
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (512, 1536, 16)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 64)
    assert config.vocab_size == 850 and config.tie_word_embeddings  # the same tokenizer as the other presets
    assert sum(p.numel() for p in model.parameters()) == 50_785_792
    assert SMALL_MODEL == "twinkle://qwen3-small" and set(PINNED_WEIGHTS) == set(PRESETS)
    assert len(PINNED_WEIGHTS["qwen3-small"]) == 64
