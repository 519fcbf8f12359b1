"""Long sequences without [tokens x vocab] logits: the chunked unembedding of a fused multi-LoRA pass
equals the whole-logits pass (losses, log-probs, every gradient, a LoRA on the unembedding included),
and both engines train an 8K-token row on the embedded model, whose context is now Qwen3's 32,768."""

import json

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.loss import ChunkedHead, ProjectedHead
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.multi_lora.batch import collate
from twinkle.model.multi_lora.heads import wants_chunks

torch.set_num_threads(2)
LONG = 8192

CONFIGS = {
    "ada": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"]),
    "ben": LoraConfig(r=8, lora_alpha=8, target_modules="all-linear"),
}


def rows(seed, n, length):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 800, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * 5 + ids[5:]})
    return out


def make_model(budget: int | None = None) -> MultiLoraModel:
    model = MultiLoraModel(TEST_MODEL)
    if budget is not None:
        model.logits_budget_bytes = budget
    for name, config in CONFIGS.items():
        model.add_adapter_to_model(name, config)
        with torch.no_grad():  # B starts at zero: make every factor matter, the unembedding's too
            g = torch.Generator().manual_seed(len(name))
            for p in model.adapters[name].params:
                p.normal_(0, 0.05, generator=g)
    return model


def grads(model):
    return {n: [p.grad.clone() for p in s.params] for n, s in model.adapters.items()}


def test_embedded_presets_advertise_qwen3_context():
    with open(resolve_model_path(TEST_MODEL) + "/config.json") as f:
        config = json.load(f)
    assert config["max_position_embeddings"] == 32768


def test_chunked_pass_equals_whole_logits_pass():
    data = {"ada": rows(1, 2, 300), "ben": rows(2, 1, 420)}
    whole, chunked = make_model(), make_model(budget=1)  # budget 1 byte: every pass is chunked
    chunked_heads = []
    original = chunked._heads

    def spy(segments, train, task="causal_lm"):
        out = original(segments, train, task)
        chunked_heads.extend(out)
        return out

    chunked._heads = spy
    want = whole.forward_backward_fused(data, return_logprobs=True)
    got = chunked.forward_backward_fused(data, return_logprobs=True)
    # ada trains a LoRA on the unembedding (projected per chunk); ben does not (the one-sweep chunked head)
    assert {type(h) for h in chunked_heads} == {ChunkedHead, ProjectedHead}
    for name in data:
        assert got[name]["loss"] == pytest.approx(want[name]["loss"], rel=1e-5)
        for g_row, w_row in zip(got[name]["logprobs"], want[name]["logprobs"]):
            torch.testing.assert_close(torch.tensor(g_row), torch.tensor(w_row), rtol=1e-5, atol=1e-5)
    g_whole, g_chunked = grads(whole), grads(chunked)
    for name in data:
        for a, b in zip(g_chunked[name], g_whole[name]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert "lm_head" in chunked.adapters["ada"].module_names
    a, b = chunked.lora_layer("lm_head").factors("ada")
    assert a.grad.abs().sum() > 0 and b.grad.abs().sum() > 0  # the unembedding's LoRA trained through chunks


def test_multi_lora_trains_an_8k_row_in_chunks():
    model = make_model(budget=16 << 20)  # 8K x 850 fp32 logits are 27 MiB: over it, so chunked
    assert wants_chunks(model, [("ben", collate(rows(3, 1, LONG), 0))], True, model.logits_budget_bytes)
    out = model.forward_backward_fused({"ben": rows(3, 1, LONG)}, return_logprobs=True)["ben"]
    assert out["loss_tokens"] == LONG - 5 and len(out["logprobs"][0]) == LONG - 1
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.adapters["ben"].params)


def test_transformers_model_trains_an_8k_row_checkpointed_and_chunked():
    from twinkle.model import TransformersModel

    model = TransformersModel(TEST_MODEL)
    model.add_adapter_to_model("long", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=1e-3)
    row = rows(4, 1, LONG)
    plain = model.forward_only(row)
    model.apply_patch("GradientCheckpointing")
    model.apply_patch("ChunkedCrossEntropy", chunk_size=1024)
    assert model.hf_model.config._attn_implementation == "sdpa"  # no [T x T] score matrix
    patched = model.forward_only(row)
    assert patched["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    torch.testing.assert_close(
        torch.tensor(patched["logprobs"][0]), torch.tensor(plain["logprobs"][0]), rtol=1e-5, atol=1e-5
    )
    before = [p.detach().clone() for p in model.states["long"].params]
    out = model.forward_backward(row)
    model.clip_grad_and_step()
    assert out["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert any((p.detach() - b).abs().max() > 0 for p, b in zip(model.states["long"].params, before))
