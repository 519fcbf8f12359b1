"""task='embedding' over HTTP (twinkle-kit's InfonceLoss recipe through the native client): the server's
multi-LoRA engine pools each row's last real token from its final hidden states, equal to the base model's
own (a fresh LoRA adds nothing); InfonceLoss trains; a task the server does not offer is a 400 naming it,
a token loss on an embedding pass fails its request by name, and a log-prob pass after them has its
output projection back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from twinkle.hub import TEST_MODEL

TENANT = "embed"
# twinkle-kit's embedding rows, as its client sends them: an anchor (label 1), then its positive (label 0)
QUERIES = [([60, 61, 62], [60, 63, 64, 65]), ([70, 71, 72, 73, 74], [75, 71]), ([80, 81], [80, 82, 83])]
PAIRS = [{"input_ids": ids, "labels": [mark]} for group in QUERIES for ids, mark in zip(group, (1, 0))]


def _base_embeddings() -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL), dtype=torch.float32)
    with torch.no_grad():
        last = [model.model(input_ids=torch.tensor([r["input_ids"]])).last_hidden_state[0, -1] for r in PAIRS]
    return F.normalize(torch.stack(last), dim=-1)


@pytest.fixture(scope="module")
def model(server, tenant_key):
    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel

    proxy = TransformersModel(model_id=TEST_MODEL, client=TwinkleClient(server.url, tenant_key))
    proxy.add_adapter_to_model("emb", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}).result()
    proxy.set_loss("InfonceLoss", temperature=0.5).result()
    proxy.set_optimizer("AdamW", lr=1e-2).result()
    proxy.add_metric("EmbeddingMetric", is_training=True).result()
    return proxy


def test_embeddings_are_the_base_models_and_infonce_trains_over_http(model):
    from twinkle.loss import EmbeddingHead, InfonceLoss, LossContext

    first = model.forward_only(PAIRS, task="embedding").result()
    embeddings = torch.tensor(first["embeddings"])
    torch.testing.assert_close(embeddings, _base_embeddings(), rtol=1e-5, atol=1e-6)
    marks = {"group_start": torch.tensor([1, 0] * 3)}
    want = InfonceLoss(temperature=0.5)(LossContext(EmbeddingHead(embeddings), torch.full((6, 1), -100), marks))
    assert first["loss"] == pytest.approx(float(want.loss), rel=1e-5)
    losses = []
    for _ in range(3):
        losses.append(model.forward_backward(PAIRS, task="embedding").result()["loss"])
        assert model.clip_grad_and_step().result()["stepped"]
    assert losses[0] == pytest.approx(first["loss"], rel=1e-5)
    assert model.forward_only(PAIRS, task="embedding").result()["loss"] < 0.8 * first["loss"]
    metrics = model.calculate_metric(is_training=True).result()
    assert metrics["pos_sim_min"] <= metrics["pos_sim"] <= metrics["pos_sim_max"] <= 1.0 + 1e-6


def test_a_task_not_offered_and_a_token_loss_are_refused_by_name(model, server, tenant_key):
    from twinkle.client import TwinkleAPIError, TwinkleRequestFailed

    with pytest.raises(TwinkleAPIError, match="task='fused_lm_ce' is not offered") as err:
        model.forward_only(PAIRS, task="fused_lm_ce")
    assert err.value.status == 400
    with pytest.raises(TwinkleRequestFailed, match="embedding row 0: its `labels` must be one number"):
        model.forward_backward([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}], task="embedding").result()
    model.set_loss("CrossEntropyLoss").result()
    try:
        with pytest.raises(TwinkleRequestFailed, match="an embedding pass has no next-token distribution"):
            model.forward_backward(PAIRS, task="embedding").result()
        # after embedding passes a log-prob pass has its output projection back
        out = model.forward_only([{"input_ids": [1, 2, 3]}]).result()
        assert len(out["logprobs"][0]) == 3 and all(lp < 0 for lp in out["logprobs"][0][1:]) and out["loss"] > 0
    finally:
        model.set_loss("InfonceLoss", temperature=0.5).result()
