"""The pure half of the Megatron backend, on CPU: HF Qwen3 <-> megatron-core GPTModel names and
layouts, config translation, TP/PP shards, and the error without the extra."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle.model.megatron import convert


@pytest.fixture(scope="module")
def hf(tiny_path):
    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)


def test_hf_to_megatron_to_hf_round_trip_is_bit_exact(hf):
    state = hf.state_dict()
    mega = convert.hf_to_megatron(state, hf.config)
    assert "output_layer.weight" not in mega and hf.config.tie_word_embeddings  # tied: the output reads the embedding
    assert sum(1 for k in mega if ".layers.0." in k) == 8  # qkv, proj, fc1, fc2, 2 norms, q/k norms
    back = convert.megatron_to_hf(mega, hf.config)
    assert sorted(back) == sorted(k for k in state if k != "lm_head.weight")
    for k, v in back.items():
        assert torch.equal(v, state[k]), k


def test_megatron_reads_qkv_per_query_group_and_fc1_as_gate_then_up(hf):
    # What megatron's attention does with linear_qkv: view [.., groups, (heads/groups + 2) * d], split.
    heads, groups, d = convert.attention_shape(hf.config)
    assert (heads, groups, d) == (4, 2, 24)
    mega = convert.hf_to_megatron(hf.state_dict(), hf.config)
    layer = hf.model.layers[1]
    x_N_H = torch.randn(5, hf.config.hidden_size)
    mixed = (x_N_H @ mega["decoder.layers.1.self_attention.linear_qkv.weight"].T).view(
        5, groups, (heads // groups + 2) * d
    )
    q, k, v = mixed.split([heads // groups * d, d, d], dim=-1)
    torch.testing.assert_close(q.reshape(5, -1), layer.self_attn.q_proj(x_N_H), rtol=0, atol=1e-6)
    torch.testing.assert_close(k.reshape(5, -1), layer.self_attn.k_proj(x_N_H), rtol=0, atol=1e-6)
    torch.testing.assert_close(v.reshape(5, -1), layer.self_attn.v_proj(x_N_H), rtol=0, atol=1e-6)
    gate, up = (x_N_H @ mega["decoder.layers.1.mlp.linear_fc1.weight"].T).chunk(2, dim=-1)  # megatron's GLU
    torch.testing.assert_close(
        torch.nn.functional.silu(gate) * up,
        layer.mlp.act_fn(layer.mlp.gate_proj(x_N_H)) * layer.mlp.up_proj(x_N_H),
        rtol=0,
        atol=1e-6,
    )
    assert torch.equal(mega["decoder.layers.1.self_attention.q_layernorm.weight"], layer.self_attn.q_norm.weight)
    assert torch.equal(mega["decoder.layers.1.pre_mlp_layernorm.weight"], layer.post_attention_layernorm.weight)


def test_config_translation(hf):
    kw = convert.transformer_config_kwargs(hf.config)
    assert (kw["num_layers"], kw["hidden_size"], kw["ffn_hidden_size"]) == (2, 96, 192)
    assert (kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"]) == (4, 2, 24)
    assert kw["qk_layernorm"] and kw["gated_linear_unit"] and kw["normalization"] == "RMSNorm"
    assert kw["layernorm_epsilon"] == 1e-6 and not kw["add_bias_linear"] and not kw["add_qkv_bias"]
    gpt = convert.gpt_model_kwargs(hf.config)
    assert gpt == {
        "vocab_size": 850,
        "max_sequence_length": 32768,
        "share_embeddings_and_output_weights": True,
        "position_embedding_type": "rope",
        "rotary_base": 10000.0,
    }
    bad = hf.config.__class__(**{**hf.config.to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="SwiGLU"):
        convert.transformer_config_kwargs(bad)


def test_config_is_accepted_by_megatron_core_when_installed(hf):
    pytest.importorskip("megatron.core", reason="megatron-core not installed (extra twinkle-model[megatron])")
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(**convert.transformer_config_kwargs(hf.config), activation_func=torch.nn.functional.silu)
    assert cfg.num_query_groups == 2 and cfg.kv_channels == 24


def test_tensor_parallel_shards_cut_whole_groups_and_merge_back(hf):
    mega = convert.hf_to_megatron(hf.state_dict(), hf.config)
    for name, full in mega.items():
        shards = [convert.tp_shard(name, full, r, 2) for r in range(2)]
        assert torch.equal(convert.tp_merge(name, shards), full), name
    qkv = mega["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(
        convert.tp_shard("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 1, 2), qkv[qkv.shape[0] // 2 :]
    )  # rank 1: query group 1 with its k and v
    fc1 = mega["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    assert torch.equal(
        convert.tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 0, 2), torch.cat([gate[:96], up[:96]])
    )  # its half of gate, then its half of up
    assert convert.tp_shard(
        "decoder.layers.0.self_attention.linear_proj.weight",
        mega["decoder.layers.0.self_attention.linear_proj.weight"],
        0,
        2,
    ).shape == (96, 48)
    with pytest.raises(ValueError, match="not divisible by tp_size=5"):
        convert.tp_shard("embedding.word_embeddings.weight", mega["embedding.word_embeddings.weight"][:847], 0, 5)


def test_pipeline_stages_own_their_layers_with_local_numbers(hf):
    mega = convert.hf_to_megatron(hf.state_dict(), hf.config)
    first = convert.stage_state(mega, hf.config, pp_rank=0, pp_size=2)
    last = convert.stage_state(mega, hf.config, pp_rank=1, pp_size=2)
    assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" not in first
    assert {k.split(".")[2] for k in first if k.startswith("decoder.layers")} == {"0"}
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc2.weight"], mega["decoder.layers.1.mlp.linear_fc2.weight"])
    assert torch.equal(last["output_layer.weight"], mega["embedding.word_embeddings.weight"])  # tied copy
    assert "embedding.word_embeddings.weight" not in last
    rebuilt = {
        convert.global_layer_name(k, r, 2, 2): v
        for r, stage in enumerate((first, last))
        for k, v in stage.items()
        if k != "output_layer.weight"
    }
    assert rebuilt.keys() == mega.keys() and all(torch.equal(rebuilt[k], mega[k]) for k in mega)
    with pytest.raises(ValueError, match="not divisible by pp_size=3"):
        convert.stage_layers(2, 0, 3)


def test_without_the_extra_the_error_names_it(monkeypatch):
    from twinkle.model import MegatronModel

    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron -> ImportError
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImportError, match=r"pip install 'twinkle-model\[megatron\]'"):
        MegatronModel(model_id="twinkle://qwen3-tiny")
