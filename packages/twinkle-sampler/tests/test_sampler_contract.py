"""The Sampler contract, run against every backend: TorchSampler here, VLLMSampler where vllm is installed."""

from __future__ import annotations

import pytest
from contract_model import hf_greedy, teacher_logprobs

from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter

TOL = 1e-3  # fp32 log-prob agreement with the trainer: the basis of on-policy RL


@pytest.fixture(scope="module", params=["torch", "vllm"])
def sampler(request, model_path, trainer):
    if request.param == "vllm":
        pytest.importorskip(
            "vllm", reason="vllm is not installed here: run the `vllm` session (packages/twinkle-sampler/README.md)"
        )
        from twinkle.sampler import VLLMSampler

        s = VLLMSampler(model_path, max_lora_rank=8, max_model_len=256)
    else:
        s = TorchSampler(model_path)
    s.set_adapter("tenant", extract_adapter(trainer, "tenant"), version=3)
    yield s
    if hasattr(s, "close"):
        s.close()


@pytest.mark.parametrize("adapter", [None, "tenant"])
def test_greedy_equals_hf_generate(sampler, trainer, prompts, adapter):
    responses = sampler.sample(prompts, SamplingParams(max_tokens=12, temperature=0), adapter_name=adapter)
    for prompt, response in zip(prompts, responses):
        assert response.sequences[0].tokens == hf_greedy(trainer, prompt, 12, adapter)


@pytest.mark.parametrize("adapter", [None, "tenant"])
def test_sampled_logprobs_equal_teacher_forced_forward(sampler, trainer, prompts, adapter):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, num_samples=2)
    responses = sampler.sample(prompts[:2], params, adapter_name=adapter)
    for prompt, response in zip(prompts, responses):
        assert len(response.sequences) == 2
        for seq in response.sequences:
            expected = teacher_logprobs(trainer, prompt, seq.tokens, adapter)
            assert len(seq.logprobs) == len(seq.tokens) == len(expected)
            assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < TOL


def test_prompt_logprobs_and_compute_logprobs(sampler, trainer, prompts):
    response = sampler.sample(
        [prompts[1]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=True), adapter_name="tenant"
    )[0]
    full = sampler.compute_logprobs([prompts[1]], adapter_name="tenant")[0]
    expected = teacher_logprobs(trainer, prompts[1][:1], prompts[1][1:], "tenant")
    for got in (response.prompt_logprobs, full):
        assert got[0] is None and len(got) == len(prompts[1])
        assert max(abs(a - b) for a, b in zip(got[1:], expected)) < TOL


def test_stop_strings_are_honoured_and_kept(sampler, tokenizer, prompts):
    free = sampler.sample([prompts[0]], SamplingParams(max_tokens=12, temperature=0))[0].sequences[0]
    # A stop string taken from the middle of the free-running greedy text.
    stop_at = 5
    stop = tokenizer.decode(free.tokens[stop_at : stop_at + 1]).strip() or tokenizer.decode(
        free.tokens[stop_at : stop_at + 1]
    )
    cut = sampler.sample([prompts[0]], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0].sequences[0]
    assert cut.stop_reason == "stop"
    assert cut.tokens == free.tokens[: len(cut.tokens)] and len(cut.tokens) <= stop_at + 1
    text = tokenizer.decode(cut.tokens)
    assert stop in text and stop not in tokenizer.decode(cut.tokens[:-1])  # stops at the first occurrence, kept


def test_stop_token_ids(sampler, prompts):
    free = sampler.sample([prompts[2]], SamplingParams(max_tokens=12, temperature=0))[0].sequences[0]
    target = free.tokens[4]
    cut = sampler.sample([prompts[2]], SamplingParams(max_tokens=12, temperature=0, stop=target))[0].sequences[0]
    assert cut.stop_reason == "stop" and cut.tokens == free.tokens[: free.tokens.index(target) + 1]
    capped = sampler.sample([prompts[2]], SamplingParams(max_tokens=3, temperature=0))[0].sequences[0]
    assert capped.stop_reason == "length" and capped.tokens == free.tokens[:3]


def test_same_seed_same_output(sampler, prompts):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, num_samples=3)
    first = [[s.tokens for s in r.sequences] for r in sampler.sample(prompts, params, adapter_name="tenant")]
    again = [[s.tokens for s in r.sequences] for r in sampler.sample(prompts, params, adapter_name="tenant")]
    other = [
        [s.tokens for s in r.sequences]
        for r in sampler.sample(
            prompts, SamplingParams(max_tokens=10, temperature=1.0, seed=4321, num_samples=3), adapter_name="tenant"
        )
    ]
    assert first == again
    assert first != other
    assert len({tuple(t) for t in first[0]}) > 1  # the samples of one prompt differ from each other


def test_adapter_changes_output_and_base_stays_reachable(sampler, prompts):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    base_before = sampler.sample(prompts, greedy)
    tuned = sampler.sample(prompts, greedy, adapter_name="tenant")
    base_after = sampler.sample(prompts, greedy, adapter_name=None)
    assert [r.sequences[0].tokens for r in tuned] != [r.sequences[0].tokens for r in base_before]
    assert [r.sequences[0].tokens for r in base_after] == [r.sequences[0].tokens for r in base_before]
    assert {r.weight_version for r in tuned} == {3} and {r.weight_version for r in base_after} == {0}
    assert {r.adapter_name for r in tuned} == {"tenant"}


@pytest.mark.no_float
def test_unknown_adapter_is_a_clear_error(sampler, prompts):
    with pytest.raises(KeyError, match="unknown adapter.*'nobody'"):
        sampler.sample(prompts, SamplingParams(max_tokens=2), adapter_name="nobody")
