"""stable_reinforce through the unmodified tinker SDK: sample with record_stability_info, build datums with
provenance as the cookbook's rl_loop does, train; the loss equals the reference formula over the server's
recorded sampler log-probs, and every bad span is a 400 naming it."""

from __future__ import annotations

import dataclasses
import math

import pytest

from twinkle.hub import TEST_MODEL

TENANT = "stella"
PROMPT = [5 + (11 * i) % 50 for i in range(8)]
CAP = 1.05  # small, so that after one off-policy step some tokens are truncated and some are not


def params(seed):
    from tinker import types

    return types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed, stop=[])


def rl_datum(seq, advantage, client_logprobs=None):
    """rl_loop.py's datum for one sampled sequence, with provenance (with_sampled_provenance)."""
    from tinker import types

    prompt = types.ModelInput.from_ints(PROMPT)
    tokens, ob_len = list(seq.tokens), len(PROMPT) - 1
    lps = client_logprobs if client_logprobs is not None else list(seq.logprobs)
    datum = types.Datum(
        model_input=prompt.append(types.EncodedTextChunk(tokens=tokens[:-1])),
        loss_fn_inputs={
            "target_tokens": [0] * ob_len + tokens,
            "logprobs": [0.0] * ob_len + lps,
            "advantages": [0.0] * ob_len + [advantage] * len(tokens),
        },
    )
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=ob_len),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens)),
        ],
    )


def reference_loss(learner_lps, seqs, advantages, cap):
    """−Σ over sampled targets of min(exp(logp_θ − logq), C)·A, logq the sampler's (as it returned them)."""
    total, ob_len = 0.0, len(PROMPT) - 1
    for lps, seq, a in zip(learner_lps, seqs, advantages):
        for t, q in enumerate(seq.logprobs):
            total -= min(math.exp(lps[ob_len + t] - q), cap) * a
    return total


@pytest.fixture(scope="module")
def client(server, tenant_key):
    import tinker

    return tinker.ServiceClient(base_url=server.url, api_key=tenant_key)


@pytest.fixture(scope="module")
def trained(client, sft):
    """A run, four sequences it sampled with record_stability_info, then one SFT step (so r != 1)."""
    from tinker import types

    tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=3).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, params(1)).result().sequences
    assert all(s.sequence_id and len(s.tokens) == 6 and len(s.logprobs) == 6 for s in seqs)
    tc.forward_backward([sft([*PROMPT, 9, 10, 11])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    return tc, seqs


def test_loss_equals_reference_over_the_recorded_logprobs(trained):
    from tinker import types

    tc, seqs = trained
    advantages = [1.0, -0.5, 0.25, -0.75]
    # the client's own logprobs are garbage: the server must use what it recorded at sampling time
    data = [rl_datum(s, a, client_logprobs=[-9.0] * len(s.tokens)) for s, a in zip(seqs, advantages)]
    learner = [o["logprobs"].tolist() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
    expected = reference_loss(learner, seqs, advantages, CAP)
    ratios = [
        math.exp(learner[i][len(PROMPT) - 1 + t] - q) for i, s in enumerate(seqs) for t, q in enumerate(s.logprobs)
    ]
    assert min(ratios) < CAP < max(ratios)  # both branches of the truncation are exercised

    out = tc.forward_backward(data, "stable_reinforce", loss_fn_config={"ratio_cap": CAP}).result()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5 * len(ratios))
    assert out.metrics["policy_lag:max"] == 1.0  # sampled one optimizer step ago
    assert 0 < out.metrics["truncated_fraction:mean"] < 1
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result() is not None
    # training on them restarted their day; they can be used again
    again = tc.forward_backward(data, "stable_reinforce", loss_fn_config={"ratio_cap": CAP}).result()
    assert math.isfinite(again.metrics["loss:sum"]) and again.metrics["policy_lag:max"] == 2.0


def _with_spans(datum, model_input=None, loss_fn_inputs=None):
    """Spans set without the SDK's client-side tiling check (a buggy or hostile client)."""
    return dataclasses.replace(
        datum,
        model_input_spans=model_input if model_input is not None else datum.model_input_spans,
        loss_fn_input_spans=loss_fn_inputs if loss_fn_inputs is not None else datum.loss_fn_input_spans,
    )


def _refused(tc, datum, match):
    import tinker

    with pytest.raises(tinker.BadRequestError, match=match):
        tc.forward_backward([datum], "stable_reinforce").result()


def test_bad_spans_are_400s_naming_the_span(trained, server, keys):
    import tinker
    from tinker import types

    tc, seqs = trained
    good = rl_datum(seqs[0], 1.0)
    sid = seqs[0].sequence_id
    spans = good.loss_fn_input_spans

    unknown = [spans[0], types.SampledProvenanceSpan(sequence_id="nope", length=6)]
    _refused(
        tc, _with_spans(good, loss_fn_inputs=unknown), r"datum 0 loss_fn_input_spans\[1\] .*'nope'.*unknown sequence"
    )
    short = [spans[0], types.SampledProvenanceSpan(sequence_id=sid, length=5)]
    _refused(tc, _with_spans(good, loss_fn_inputs=short), r"datum 0: loss_fn_input_spans cover 12 positions .* 13")
    shifted = [spans[0], types.SampledProvenanceSpan(sequence_id=sid, offset=1, length=6)]
    _refused(
        tc, _with_spans(good, loss_fn_inputs=shifted), r"loss_fn_input_spans\[1\] .* outside the sequence's sampled"
    )
    other = seqs[1].sequence_id
    if list(seqs[1].tokens) != list(seqs[0].tokens):  # another sequence's tokens at these positions
        wrong = [spans[0], types.SampledProvenanceSpan(sequence_id=other, length=6)]
        _refused(tc, _with_spans(good, loss_fn_inputs=wrong), r"loss_fn_input_spans\[1\] .* recorded sampled token")
    bad_prompt = [types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=7), *good.model_input_spans[1:]]
    bad_prompt.insert(1, types.SampledProvenanceSpan(sequence_id=sid, length=1))  # input token 7 is not sampled 0
    _refused(tc, _with_spans(good, model_input=bad_prompt), r"model_input_spans\[1\] \(sampled")
    with pytest.raises(tinker.BadRequestError, match="needs provenance spans on every datum"):
        tc.forward_backward(
            [dataclasses.replace(good, model_input_spans=None, loss_fn_input_spans=None)], "stable_reinforce"
        ).result()

    # another tenant's sequence reads as unknown
    bob_sampler = (
        tinker.ServiceClient(base_url=server.url, api_key=keys["bob"])
        .create_sampling_client(base_model=TEST_MODEL, record_stability_info=True)
        .result()
    )
    bob_seq = bob_sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params(2)).result().sequences[0]
    _refused(tc, rl_datum(bob_seq, 1.0), r"model_input_spans\[0\] \(prompt, sequence_id '\w+'\): unknown sequence")


def test_sequences_are_session_scoped_and_expire(trained, server, tenant_key):
    import tinker
    from tinker import types

    _, seqs = trained
    second = tinker.ServiceClient(base_url=server.url, api_key=tenant_key)  # same key, a new session
    tc2 = second.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=4).result()
    _refused(tc2, rl_datum(seqs[2], 1.0), r"sampled by session .* not this run's")

    own = second.create_sampling_client(base_model=TEST_MODEL, record_stability_info=True).result()
    seq = own.sample(types.ModelInput.from_ints(PROMPT), 1, params(3)).result().sequences[0]
    assert math.isfinite(tc2.forward_backward([rl_datum(seq, 1.0)], "stable_reinforce").result().metrics["loss:sum"])
    server.runtime.store.db.execute(  # a day and a bit without use
        "UPDATE stability_records SET last_used = last_used - 90000 WHERE sequence_id=?", (seq.sequence_id,)
    )
    _refused(tc2, rl_datum(seq, 1.0), r"the record expired \(9\d{4} s unused; records expire after 86400 s")


def test_records_survive_a_restart_with_their_session(tmp_path):
    """The same SDK client keeps its session across a server restart on the same data dir and port."""
    import tinker
    from tinker import types

    import twinkle.serve as ts
    from twinkle.serve.server import free_port

    port = free_port()

    def boot():
        return ts.initialize(
            mode="http",
            port=port,
            data_dir=tmp_path,
            config={"models": [{"name": TEST_MODEL}]},
            block=False,
            log_level="warning",
        ).wait_ready()

    srv = boot()
    key = srv.create_key("rhea")
    client = tinker.ServiceClient(base_url=srv.url, api_key=key)
    tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=6).result()
    path = tc.save_state("s0").result().path
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params(4)).result().sequences[0]
    srv.stop()

    srv = boot()
    try:
        resumed = client.create_training_client_from_state_with_optimizer(path).result()
        out = resumed.forward_backward([rl_datum(seq, 1.0)], "stable_reinforce", loss_fn_config={"ratio_cap": 1e9})
        learner = resumed.forward([rl_datum(seq, 1.0)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        expected = reference_loss([learner.tolist()], [seq], [1.0], 1e9)
        assert out.result().metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    finally:
        srv.stop()
