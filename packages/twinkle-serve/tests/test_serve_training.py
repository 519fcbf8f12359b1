"""The Tinker SL loop and sampling against a real server, through the unmodified SDK."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.hub import TEST_MODEL

SEQ_A = [5 + (7 * i) % 60 for i in range(24)]
SEQ_B = [100 + (3 * i) % 50 for i in range(18)]


@pytest.fixture(scope="module")
def trained(alice, sft):
    from tinker import types

    tc = alice.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=3).result()
    losses = []
    for _ in range(6):
        fb = tc.forward_backward([sft(SEQ_A), sft(SEQ_B)], "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=2e-2, weight_decay=0.01, grad_clip_norm=10.0))
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    return tc, losses


def test_loss_falls_and_outputs_have_tinker_shapes(trained, sft):
    tc, losses = trained
    assert losses[-1] < 0.7 * losses[0], losses
    out = tc.forward([sft(SEQ_A)], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (len(SEQ_A) - 1,)
    # loss:sum of cross_entropy with unit weights is exactly -sum(logprobs)
    assert out.metrics["loss:sum"] == pytest.approx(-logprobs.sum(), rel=1e-5)


def test_get_info_and_tokenizer_work_offline(trained):
    tc, _ = trained
    info = tc.get_info()
    assert info.model_data.model_name == TEST_MODEL and info.lora_rank == 8
    tok = tc.get_tokenizer()
    assert tok.decode(tok.encode("hello twinkle")) == "hello twinkle"


def test_sampler_logprobs_equal_training_logprobs(trained, sft):
    from tinker import types

    tc, _ = trained
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt_lps = sampler.compute_logprobs(types.ModelInput.from_ints(SEQ_A)).result()
    train_lps = tc.forward([sft(SEQ_A)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert prompt_lps[0] is None
    np.testing.assert_allclose(np.array(prompt_lps[1:], dtype=np.float32), train_lps, atol=2e-5)


def test_sample_honours_num_samples_seed_stop_and_logprobs(trained):
    from tinker import types

    tc, _ = trained
    path = tc.save_weights_for_sampler("samp-1").result().path
    assert path == f"tinker://{tc.model_id}/sampler_weights/samp-1"
    sampler = tc.create_sampling_client(path).result()
    prompt = types.ModelInput.from_ints(SEQ_A[:6])
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
    first = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(first.sequences) == 3
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    for s in first.sequences:
        assert len(s.logprobs) == len(s.tokens) and all(lp <= 0 for lp in s.logprobs)
    # stop on the last token greedy decoding emits: it ends at that token's first occurrence, keeping it
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
    stop_token = greedy.tokens[-1]
    stopped = (
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[stop_token]))
        .result()
        .sequences[0]
    )
    assert stopped.tokens == greedy.tokens[: greedy.tokens.index(stop_token) + 1]
    assert stopped.stop_reason == "stop"


def test_base_model_sampler_differs_from_trained_adapter(alice, trained):
    from tinker import types

    tc, _ = trained
    base = alice.create_sampling_client(base_model=TEST_MODEL).result()
    trained_lps = (
        tc.save_weights_and_get_sampling_client().result().compute_logprobs(types.ModelInput.from_ints(SEQ_A)).result()
    )
    base_lps = base.compute_logprobs(types.ModelInput.from_ints(SEQ_A)).result()
    assert sum(trained_lps[1:]) > sum(base_lps[1:]) + 1.0  # training raised the likelihood of SEQ_A


def test_gradients_accumulate_until_optim_step(alice, sft):
    """Two forward_backward calls then one step == one call on both datums then one step."""
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-2)
    split = alice.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=9).result()
    joint = alice.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=9).result()
    split.forward_backward([sft(SEQ_A)], "cross_entropy")
    split.forward_backward([sft(SEQ_B)], "cross_entropy")
    split.optim_step(adam).result()
    joint.forward_backward([sft(SEQ_A), sft(SEQ_B)], "cross_entropy")
    joint.optim_step(adam).result()
    a = split.forward([sft(SEQ_A)], "cross_entropy").result().metrics["loss:sum"]
    b = joint.forward([sft(SEQ_A)], "cross_entropy").result().metrics["loss:sum"]
    assert a == pytest.approx(b, rel=1e-4)


def test_tenants_queued_together_share_one_fused_pass(server, alice, bob, sft):
    """Work of two tenants queued at once runs as one multi-LoRA pass; each gets its own result."""
    import threading
    import time

    from twinkle.serve.core.work import Call, StoredAnswer

    a = alice.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=1).result()
    b = bob.create_lora_training_client(base_model=TEST_MODEL, rank=16, seed=2).result()
    solo = [c.forward([sft(s)], "cross_entropy").result().metrics["loss:sum"] for c, s in ((a, SEQ_A), (b, SEQ_B))]
    scheduler = server.runtime.engines[TEST_MODEL].scheduler
    gate, held = threading.Event(), threading.Event()

    def hold():  # occupies the worker so both requests are queued before it looks again
        held.set()
        gate.wait(30)
        return StoredAnswer.json({})

    scheduler.submit(Call("test-gate", None, server.runtime.hub.create("alice"), hold))
    held.wait(30)
    before = scheduler.fused_passes
    futures = [a.forward([sft(SEQ_A)], "cross_entropy"), b.forward([sft(SEQ_B)], "cross_entropy")]
    deadline = time.monotonic() + 30
    while scheduler.pending(a.model_id) + scheduler.pending(b.model_id) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    gate.set()
    fused = [f.result().metrics["loss:sum"] for f in futures]
    assert scheduler.fused_passes == before + 1
    assert fused == pytest.approx(solo, rel=1e-5)
