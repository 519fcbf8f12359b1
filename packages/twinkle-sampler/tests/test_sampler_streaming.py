"""TorchSampler.sample(on_tokens=...) hands out every decode step's tokens as they are drawn: the same
tokens, log-probs and top-k the response holds, indexed in response order across batch chunks, without
changing what a seeded request draws; an exception from the callback ends the sampling there."""

from __future__ import annotations

import pytest

from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter

PARAMS = SamplingParams(max_tokens=8, temperature=1.0, seed=4, num_samples=3, logprobs=2, stop=[], ignore_eos=True)


@pytest.fixture(scope="module")
def sampler(model_path, trainer):
    # 4 rows a batch: two prompts x 3 samples decode as two chunks of 3 (the second starts at index 3)
    s = TorchSampler(model_path, max_batch_size=4)
    s.set_adapter("tenant", extract_adapter(trainer, "tenant"))
    return s


def test_each_step_hands_out_the_tokens_the_response_holds(sampler, prompts):
    steps = []
    streamed = sampler.sample(prompts[:2], PARAMS, adapter_name="tenant", on_tokens=steps.append)
    plain = sampler.sample(prompts[:2], PARAMS, adapter_name="tenant")
    seqs = [s for r in streamed for s in r.sequences]
    assert [s.tokens for s in seqs] == [s.tokens for r in plain for s in r.sequences]  # same draws
    assert len(steps) == 2 * PARAMS.max_tokens  # one call per step of each chunk, each with its live rows
    per_index = {i: [] for i in range(6)}
    for step in steps:
        for t in step:
            per_index[t.index].append(t)
    for i, seq in enumerate(seqs):
        assert [t.token for t in per_index[i]] == seq.tokens
        assert [t.logprob for t in per_index[i]] == seq.logprobs
        assert [t.top_logprobs for t in per_index[i]] == seq.top_logprobs


def test_an_exception_from_the_callback_stops_the_sampling(sampler, prompts):
    (before,) = sampler.sample(prompts[:1], PARAMS, adapter_name="tenant")
    calls = []

    def give_up(step):
        calls.append(step)
        if len(calls) == 3:
            raise RuntimeError("reader gone")

    with pytest.raises(RuntimeError, match="reader gone"):
        sampler.sample(prompts[:1], PARAMS, adapter_name="tenant", on_tokens=give_up)
    assert len(calls) == 3
    (again,) = sampler.sample(prompts[:1], PARAMS, adapter_name="tenant")  # the sampler serves on, unchanged
    assert [s.tokens for s in again.sequences] == [s.tokens for s in before.sequences]
