"""twinkle-kit's DPO conventions on the Tinker routes (tinker/kit_dpo.py), on the real backends: a forward
with `disable_lora` answers the base model's log-probs (checked against transformers' own forward of the
base checkpoint) after the adapter has trained away from it; 'importance_sampling' with `ref_logps` is
DPO over consecutive pairs, its loss equal to a hand computation from the policy's log-probs and the sent
reference; what these conventions cannot honour is refused by name, and Tinker's own requests are as before."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.serve.backend import AdamParams, LoraSpec, UserError
from twinkle.serve.tinker.datums import Datum, train

SEQS = [[3 + (7 * i + k) % 60 for i in range(n)] for k, n in enumerate((11, 9, 12, 8))]
PROMPT = 4  # the first targets are the prompt's: weight 0


def datum(tokens, **extra):
    n = len(tokens) - 1
    weights = np.array([0.0] * PROMPT + [1.0] * (n - PROMPT), dtype=np.float32)
    inputs = {"target_tokens": np.array(tokens[1:], dtype=np.int64), "weights": weights}
    return Datum(tokens[:-1], {**inputs, **{k: np.asarray(v, dtype=np.float32) for k, v in extra.items()}})


@pytest.fixture(scope="module", params=["multi_lora", "remote"])
def backend(request):
    from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend
    from twinkle.serve.backend.remote import RemoteBackend

    path = str(resolve_model_path(TEST_MODEL))
    b = (MultiLoraBackend if request.param == "multi_lora" else RemoteBackend)(TEST_MODEL, path)
    b.create_adapter("policy", LoraSpec(rank=4, seed=5))
    for _ in range(3):  # away from the base model
        train(b, "policy", [datum(s) for s in SEQS], "cross_entropy", {}, False)
        b.optim_step("policy", AdamParams(learning_rate=5e-2))
    return b


@pytest.fixture(scope="module")
def base_logprobs():
    """log p(target) per datum from transformers' forward of the base checkpoint, nothing of ours."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(TEST_MODEL))).eval()
    out = []
    with torch.no_grad():
        for s in SEQS:
            logp = torch.log_softmax(model(torch.tensor([s[:-1]])).logits[0].float(), -1)
            out.append(logp.gather(-1, torch.tensor(s[1:])[:, None])[:, 0].numpy())
    return out


def test_disable_lora_forward_answers_the_base_models_logprobs(backend, base_logprobs):
    data = [datum(s) for s in SEQS]
    base = train(backend, "policy", data, "cross_entropy", {"disable_lora": 1.0}, True)
    policy = train(backend, "policy", data, "cross_entropy", {}, True)
    for got, want, trained in zip(base.logprobs, base_logprobs, policy.logprobs):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert np.abs(trained - want).max() > 1e-3  # the adapter did move: the answer is not the policy's
    weighted = -sum(float((lp * d.inputs["weights"]).sum()) for lp, d in zip(base_logprobs, data))
    assert base.metrics["loss:sum"] == pytest.approx(weighted, rel=1e-5)


def test_importance_sampling_with_ref_logps_is_dpo_over_pairs(backend):
    rng = np.random.default_rng(0)
    refs = [-rng.uniform(0.5, 3.0, len(s) - 1) for s in SEQS]  # any reference: it must be the one used
    data = [datum(s) for s in SEQS]
    policy = train(backend, "policy", data, "cross_entropy", {}, True).logprobs
    beta, sft = 0.5, 0.25
    dpo_data = [datum(s, ref_logps=r) for s, r in zip(SEQS, refs)]
    out = train(backend, "policy", dpo_data, "importance_sampling", {"dpo_beta": beta, "dpo_sft_weight": sft}, True)
    expected = 0.0
    for c, r in ((0, 1), (2, 3)):  # consecutive (chosen, rejected) datums
        w_c, w_r = data[c].inputs["weights"], data[r].inputs["weights"]
        h = ((policy[c] - refs[c]) * w_c).sum() - ((policy[r] - refs[r]) * w_r).sum()
        expected += math.log1p(math.exp(-beta * h)) + sft * -float((policy[c] * w_c).sum() / w_c.sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert 0.0 <= out.metrics["reward_accuracy:mean"] <= 1.0


def test_what_the_conventions_cannot_honour_is_refused_by_name(backend):
    pair = [datum(SEQS[0], ref_logps=np.zeros(10)), datum(SEQS[1], ref_logps=np.zeros(8))]
    with pytest.raises(UserError, match="disable_lora .* served on forward with 'cross_entropy'"):
        train(backend, "policy", [datum(SEQS[0])], "cross_entropy", {"disable_lora": 1.0}, False)
    with pytest.raises(UserError, match=r"keys \['temperature'\] are not honoured by the base-model forward"):
        train(backend, "policy", [datum(SEQS[0])], "cross_entropy", {"disable_lora": 1.0, "temperature": 2.0}, True)
    with pytest.raises(UserError, match=r"keys \['epsilon'\] are not honoured by DPO"):
        train(backend, "policy", pair, "importance_sampling", {"epsilon": 0.2}, True)
    with pytest.raises(UserError, match="unknown DPO loss_type 'kto'"):
        train(backend, "policy", pair, "importance_sampling", {"dpo_loss_type": "kto"}, True)
    with pytest.raises(UserError, match="consecutive pairs; got 1 datums"):
        train(backend, "policy", pair[:1], "importance_sampling", {}, True)
    with pytest.raises(UserError, match=r"ref_logps'\] has 3 values for a model input of 10 tokens"):
        train(backend, "policy", [datum(SEQS[0], ref_logps=np.zeros(3)), pair[1]], "importance_sampling", {}, True)
    # Tinker's own importance_sampling is untouched: without ref_logps it still needs its inputs
    with pytest.raises(UserError, match=r"needs loss_fn_inputs\['logprobs'\]"):
        train(backend, "policy", [datum(SEQS[0])], "importance_sampling", {}, True)
