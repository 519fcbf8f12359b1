"""`target_tokens` of shape [N, K] on the Tinker path (tinker-cookbook's sdft and decisions send them): a
forward answers log p of each of the K ids at each position, [N, K] per datum (K may differ between
datums); cross_entropy is -Σ_t Σ_k weights[t, k] · log p(target_tokens[t, k]). Checked on the real
backend against the engine's own full logits (log_softmax, gather), in both head paths (whole logits
and the chunked head, with and without a LoRA on the unembedding), and through the unmodified SDK:
forward, forward_backward, the SDK's client-side forward_backward_custom and a server-side custom loss
with rank-2 logprobs. What the server cannot mean is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.serve.backend import AdamParams, LoraSpec, UserError
from twinkle.serve.tinker.datums import MAX_TARGET_IDS, Datum, train

SEQS = [[3 + (7 * i + k) % 60 for i in range(n)] for k, n in enumerate((11, 9))]
WIDTHS = (3, 2)  # K per datum: ragged, as a request may send


def _ids_weights(tokens, k, seed):
    rng = np.random.default_rng(seed)
    n = len(tokens) - 1
    ids = rng.integers(0, 200, size=(n, k)).astype(np.int64)
    ids[:, 0] = tokens[1:]  # the next token among them
    weights = rng.uniform(-0.5, 1.0, size=(n, k)).astype(np.float32)
    weights[:2] = 0.0  # the prompt's positions
    return ids, weights


def _topk_data(with_weights=True):
    out = []
    for j, (tokens, k) in enumerate(zip(SEQS, WIDTHS)):
        ids, weights = _ids_weights(tokens, k, j)
        inputs = {"target_tokens": ids, **({"weights": weights} if with_weights else {})}
        out.append(Datum(np.asarray(tokens[:-1], np.int64), inputs))
    return out


def _reference(backend, adapter, data):
    """log p(id) [N, K] per datum from the engine's whole logits of the same adapter, gathered by hand."""
    out = []
    for d in data:
        logits = backend.engine.logits([{"input_ids": list(d.tokens)}], adapter_name=adapter)[0].float()
        logp_N_V = torch.log_softmax(logits, -1)
        out.append(logp_N_V.gather(-1, torch.as_tensor(d.inputs["target_tokens"])).numpy())
    return out


@pytest.fixture(scope="module")
def backend():
    from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend

    b = MultiLoraBackend(TEST_MODEL, str(resolve_model_path(TEST_MODEL)))
    plain = [Datum(np.asarray(s[:-1], np.int64), {"target_tokens": np.asarray(s[1:], np.int64)}) for s in SEQS]
    for name, unembed in (("head", True), ("plain", False)):
        b.create_adapter(name, LoraSpec(rank=4, seed=3, train_unembed=unembed))
        for _ in range(2):  # away from the base model (a fresh LoRA B is zero)
            train(b, name, plain, "cross_entropy", {}, False)
            b.optim_step(name, AdamParams(learning_rate=5e-2))
    return b


@pytest.fixture(params=["whole", "chunked"])
def budget(backend, request):
    """Whole logits, or every pass over the logits budget: the chunked head (ChunkedHead without a LoRA
    on the unembedding, ProjectedHead with one)."""
    kept = backend.engine.logits_budget_bytes
    backend.engine.logits_budget_bytes = kept if request.param == "whole" else 1
    yield request.param
    backend.engine.logits_budget_bytes = kept


def _grads(backend, adapter, passes):
    """The adapter's gradients after `passes` (data, loss_fn) accumulated, then put back as they were."""
    state = backend.engine.adapter_state(adapter)
    before = state.snapshot()
    results = [train(backend, adapter, data, "cross_entropy", {}, False) for data in passes]
    grads = [p.grad.clone() for p in state.params if p.grad is not None]
    state.restore(before)
    return grads, results


@pytest.mark.parametrize("adapter", ["plain", "head"])
def test_a_forward_answers_each_of_k_ids_log_prob(backend, budget, adapter):
    data = _topk_data()
    got = train(backend, adapter, data, "cross_entropy", {}, True)
    want = _reference(backend, adapter, data)
    for lp, ref, k in zip(got.logprobs, want, WIDTHS):
        assert lp.shape == (ref.shape[0], k)
        np.testing.assert_allclose(lp, ref, rtol=1e-5, atol=1e-6)
    loss = -sum(float((ref * d.inputs["weights"]).sum()) for ref, d in zip(want, data))
    assert got.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("adapter", ["plain", "head"])
def test_k_ids_train_as_k_weighted_single_target_passes(backend, budget, adapter):
    data = _topk_data()
    columns = [
        [Datum(d.tokens, {"target_tokens": d.inputs["target_tokens"][:, c], "weights": d.inputs["weights"][:, c]})]
        for d in data
        for c in range(d.inputs["target_tokens"].shape[1])
    ]
    together, (result,) = _grads(backend, adapter, [data])
    apart, results = _grads(backend, adapter, columns)
    assert len(together) == len(apart) > 0 and any(float(g.abs().max()) > 0 for g in together)
    for a, b in zip(together, apart):  # summed in another order: relative to the tensor's scale
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
    assert result.metrics["loss:sum"] == pytest.approx(sum(r.metrics["loss:sum"] for r in results), rel=1e-5)


def test_without_weights_every_id_counts_once(backend):
    data = _topk_data(with_weights=False)
    got = train(backend, "plain", data, "cross_entropy", {}, True)
    want = _reference(backend, "plain", data)
    assert got.metrics["loss:sum"] == pytest.approx(-sum(float(r.sum()) for r in want), rel=1e-5)


def _refused(backend, data, loss_fn="cross_entropy") -> str:
    with pytest.raises(UserError) as e:
        train(backend, "plain", data, loss_fn, {}, True)
    return str(e.value)


def test_what_k_ids_cannot_mean_is_refused_by_name(backend):
    tokens = np.asarray(SEQS[0][:-1], np.int64)
    n = len(tokens)
    wide = np.zeros((n, MAX_TARGET_IDS + 1), np.int64)
    assert f"K = {MAX_TARGET_IDS + 1} ids per position, outside [1, MAX_TARGET_IDS = {MAX_TARGET_IDS}]" in _refused(
        backend, [Datum(tokens, {"target_tokens": wide})]
    )
    ids = np.zeros((n, 2), np.int64)
    assert "loss_fn_inputs['weights'] has shape [10]; with target_tokens of shape [10, 2] it needs that shape" in (
        _refused(backend, [Datum(tokens, {"target_tokens": ids, "weights": np.ones(n, np.float32)})])
    )
    assert "has shape [9, 2] for a model input of 10 tokens" in _refused(
        backend, [Datum(tokens, {"target_tokens": ids[1:]})]
    )
    outside = ids.copy()
    outside[4, 1] = backend.vocab_size
    assert f"target_tokens token {backend.vocab_size} is outside the vocabulary" in _refused(
        backend, [Datum(tokens, {"target_tokens": outside})]
    )
    policy = {"target_tokens": ids, "logprobs": np.zeros(n, np.float32), "advantages": np.ones(n, np.float32)}
    assert "loss 'ppo' is defined per sampled token and takes target_tokens of shape [10], got [10, 2]" in (
        _refused(backend, [Datum(tokens, policy)], "ppo")
    )
    # a policy loss's [N, 1] targets are its [N] (the log-probs keep the targets' shape, as the SDK reads them)
    one = {**policy, "target_tokens": np.asarray(SEQS[0][1:], np.int64)}
    flat = train(backend, "plain", [Datum(tokens, one)], "ppo", {}, True)
    column = train(
        backend, "plain", [Datum(tokens, {**one, "target_tokens": one["target_tokens"][:, None]})], "ppo", {}, True
    )
    assert column.logprobs[0].shape == (n, 1)
    np.testing.assert_array_equal(column.logprobs[0][:, 0], flat.logprobs[0])
    assert column.metrics["loss:sum"] == flat.metrics["loss:sum"]


# ---- through the unmodified SDK -------------------------------------------------------------------------


def _sdk_data():
    from tinker import types

    out = []
    for j, (tokens, k) in enumerate(zip(SEQS, WIDTHS)):
        ids, weights = _ids_weights(tokens, k, j)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(ids),
                    "weights": types.TensorData.from_numpy(weights),
                },
            )
        )
    return out


def _choice_loss(data, logprobs_list):
    """tinker-cookbook decisions' probability_loss shape: a squared error of softmax over the K ids."""
    losses = []
    for datum, logprobs_N_K in zip(data, logprobs_list):
        target_N_K = torch.softmax(datum.loss_fn_inputs["weights"].to_torch(), -1)
        losses.append(((torch.softmax(logprobs_N_K, -1) - target_N_K) ** 2).sum())
    loss = torch.stack(losses).sum()
    return loss, {"custom/choice:sum": loss.detach()}


def _choice_program(logprobs, weights):
    loss = ((torch.softmax(logprobs, -1) - torch.softmax(weights, -1)) ** 2).sum()
    return loss, {"custom/choice:sum": loss}


@pytest.fixture(scope="module")
def sdk(server):
    import tinker

    return tinker.ServiceClient(base_url=server.url, api_key=server.create_key("topk-targets"))


def test_the_sdk_gets_n_by_k_log_probs_and_trains_on_them(sdk):
    from tinker import types
    from transformers import AutoModelForCausalLM

    data = _sdk_data()
    on_server = sdk.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=7).result()
    on_client = sdk.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=7).result()
    got = [out["logprobs"] for out in on_server.forward(data, "cross_entropy").result().loss_fn_outputs]
    assert [g.shape for g in got] == [[len(s) - 1, k] for s, k in zip(SEQS, WIDTHS)]
    base = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(TEST_MODEL))).eval()  # a fresh LoRA is the base
    for g, tokens, d in zip(got, SEQS, data):
        with torch.no_grad():
            logp_N_V = torch.log_softmax(base(torch.tensor([tokens[:-1]])).logits[0].float(), -1)
        want = logp_N_V.gather(-1, d.loss_fn_inputs["target_tokens"].to_torch()).numpy()
        np.testing.assert_allclose(g.to_numpy(), want, rtol=1e-5, atol=1e-6)

    # decisions' path: the SDK's client-side custom loss (a forward, then cross_entropy with [N, K] weights
    # -dC/dlogp), and the same loss uploaded, run on the server with rank-2 logprobs
    handle = sdk.create_custom_loss(_choice_program, input_ranks={"logprobs": 2, "weights": 2}).result()
    outs, norms = [], []
    for tc, loss in ((on_server, handle), (on_client, _choice_loss)):
        outs.append(tc.forward_backward_custom(data, loss).result())
        norms.append(tc.optim_step(types.AdamParams(learning_rate=5e-2)).result().metrics["grad_norm:mean"])
    assert outs[0].metrics["loss:sum"] == pytest.approx(outs[1].metrics["loss:sum"], rel=1e-5)
    assert norms[0] == pytest.approx(norms[1], rel=1e-5) and norms[0] > 0
    for a, b in zip(outs[0].loss_fn_outputs, outs[1].loss_fn_outputs):
        assert a["logprobs"].shape == b["logprobs"].shape
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-5, atol=1e-6)
    after = on_server.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(after - got[0].to_numpy()).max() > 1e-4  # the step moved the adapter


def test_the_sdk_sees_refusals_by_name(sdk):
    from tinker import types

    tc = sdk.create_lora_training_client(base_model=TEST_MODEL, rank=4).result()
    tokens = SEQS[0][:-1]
    wide = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.zeros((len(tokens), 65), np.int64))},
    )
    with pytest.raises(Exception, match="MAX_TARGET_IDS = 64"):
        tc.forward([wide], "cross_entropy").result()
