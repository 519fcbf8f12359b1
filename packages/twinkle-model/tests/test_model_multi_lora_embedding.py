"""task='embedding' on the multi-LoRA engine (what the server runs): each tenant's rows pooled from one fused
pass with the output projection skipped, equal to the base model's own last hidden states and to each
tenant alone; InfonceLoss trains one tenant's adapter and leaves the other's; a token loss and an unknown
task are refused by name; the next log-prob pass has its projection back."""

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.loss import EmbeddingHead, InfonceLoss, LossContext
from twinkle.model.multi_lora import MultiLoraModel

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
GROUPS = [([21, 22, 23, 24], [21, 22, 25]), ([31, 32], [31, 33, 34, 35, 36]), ([41, 42, 43], [44, 42, 43])]
# twinkle-kit's embedding rows: an anchor (label 1), then its positive (label 0)
PAIRS = [{"input_ids": ids, "labels": [mark]} for group in GROUPS for ids, mark in zip(group, (1, 0))]
OTHER = [{"input_ids": [50, 51, 52, 53, 54, 55, 56], "labels": [1]}, {"input_ids": [50, 57], "labels": [0]}]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    model = MultiLoraModel(TEST_MODEL)
    for name in ("a", "b"):
        model.add_adapter_to_model(name, LORA)
        model.set_loss("InfonceLoss", adapter_name=name, temperature=0.5)
        model.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
    return model


def _base_embeddings(model, rows):
    """The base model's last hidden state at each row's last token, each row alone (no padding)."""
    out = []
    with torch.no_grad():
        for r in rows:
            model.routing.set([(None, 1, len(r["input_ids"]))], training=False)  # the base: no adapter
            try:
                hidden = model.base.get_decoder()(input_ids=torch.tensor([r["input_ids"]])).last_hidden_state
            finally:
                model.routing.clear()
            out.append(F.normalize(hidden[0, -1], dim=-1))
    return torch.stack(out)


def test_a_fused_embedding_pass_pools_each_tenants_rows_as_alone(engine):
    fused = engine.forward_fused({"a": PAIRS, "b": OTHER}, task="embedding")
    alone = engine.forward_fused({"a": PAIRS}, task="embedding")["a"]
    a, b = torch.tensor(fused["a"]["embeddings"]), torch.tensor(fused["b"]["embeddings"])
    assert a.shape == (6, engine.base.config.hidden_size) and b.shape[0] == 2
    torch.testing.assert_close(a, torch.tensor(alone["embeddings"]), rtol=1e-5, atol=1e-6)
    # a fresh LoRA adds nothing (B = 0): the base model's own states, padding and the other tenant aside
    torch.testing.assert_close(a, _base_embeddings(engine, PAIRS), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, _base_embeddings(engine, OTHER), rtol=1e-5, atol=1e-6)
    marks = {"group_start": torch.tensor([1, 0] * 3)}
    want = InfonceLoss(temperature=0.5)(LossContext(EmbeddingHead(a), torch.full((6, 1), -100), marks)).loss
    assert fused["a"]["loss"] == pytest.approx(float(want), rel=1e-5)
    assert fused["a"]["finite"] and "pos_sim" in fused["a"]["metrics"]


def test_infonce_trains_one_tenant_and_refusals_name_the_problem(engine):
    before_b = {k: v.clone() for k, v in engine.adapter_state_dict("b").items()}
    first = engine.forward_only(PAIRS, "a", task="embedding")["loss"]
    for _ in range(3):
        out = engine.forward_backward_fused({"a": PAIRS}, task="embedding")["a"]
        assert "embeddings" not in out and "logprobs" not in out
        assert engine.clip_grad_and_step(adapter_name="a")["stepped"]
    assert engine.forward_only(PAIRS, "a", task="embedding")["loss"] < 0.8 * first
    assert all(torch.equal(v, engine.adapter_state_dict("b")[k]) for k, v in before_b.items())
    # the projection is back: a token pass has its log-probs
    engine.set_loss("CrossEntropyLoss", adapter_name="b")
    out = engine.forward_only([{"input_ids": [1, 2, 3]}], "b")
    assert len(out["logprobs"][0]) == 3 and all(lp < 0 for lp in out["logprobs"][0][1:]) and out["loss"] > 0
    with pytest.raises(ValueError, match="tenant 'b': an embedding pass has no next-token distribution"):
        engine.forward_backward_fused({"b": OTHER}, task="embedding")
    with pytest.raises(ValueError, match="embedding row 0: its `labels` must be one number"):
        engine.forward_backward_fused({"a": [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]}, task="embedding")
    with pytest.raises(NotImplementedError, match="task='fused_lm_ce' is not offered"):
        engine.forward_fused({"a": PAIRS}, task="fused_lm_ce")
