"""GRPO groups: the n samples of one prompt share one prefill (its KV cache expanded to n rows), and each
sample's per-token log-probs still equal a training forward of prompt + that sample."""

from __future__ import annotations

import pytest
from contract_model import teacher_logprobs

from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter


@pytest.fixture(scope="module")
def samplers(model_path, trainer):
    out = []
    for size in (64, 1):  # groups share a prefill / one row at a time, nothing shared
        s = TorchSampler(model_path, max_batch_size=size)
        s.set_adapter("tenant", extract_adapter(trainer, "tenant"))
        out.append(s)
    return out


def test_group_samples_score_like_a_training_forward(samplers, trainer, prompts):
    shared, _ = samplers
    calls = []
    original = shared.model.forward

    def counting(*args, **kw):
        calls.append(kw["input_ids"].shape)
        return original(*args, **kw)

    shared.model.forward = counting
    try:
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=4, num_samples=8, prompt_logprobs=True)
        (group,) = shared.sample([prompts[1]], params, adapter_name="tenant")
    finally:
        del shared.model.forward
    assert calls[0] == (1, len(prompts[1]))  # one prefill row for eight samples
    assert all(shape[0] <= 8 and shape[1] == 1 for shape in calls[1:])
    assert len({tuple(s.tokens) for s in group.sequences}) > 1
    for seq in group.sequences:
        expected = teacher_logprobs(trainer, prompts[1], seq.tokens, "tenant")
        assert max(abs(a - b) for a, b in zip(seq.logprobs, expected)) < 1e-3
    prompt_expected = teacher_logprobs(trainer, prompts[1][:1], prompts[1][1:], "tenant")
    assert max(abs(a - b) for a, b in zip(group.prompt_logprobs[1:], prompt_expected)) < 1e-3


def test_a_shared_prefill_draws_what_separate_prefills_draw(samplers, prompts):
    shared, separate = samplers
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=13, num_samples=4, stop=[], ignore_eos=True)
    rows = [prompts[0], prompts[3], prompts[2]]
    adapters = ["tenant", None, "tenant"]
    a = shared.sample(rows, params, adapter_name=adapters)
    b = separate.sample(rows, params, adapter_name=adapters)
    assert [[s.tokens for s in r.sequences] for r in a] == [[s.tokens for s in r.sequences] for r in b]
