"""A half-precision model decodes on a float32 copy of its KV cache, attending in float32
(decode_attention.py, issue 47); a decode whose copy would not fit its budget keeps the model's dtype."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from twinkle.sampler import SamplingParams, TorchSampler, decode_attention, kv_room, torch_sampler

ATTENTION = decode_attention.preemption.attention  # what decode_attention delegates to, unspied


def test_a_float32_roomy_cache_holds_the_half_precision_keys_exactly():
    g = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    cache.update(*(torch.randn(2, 2, 5, 4, generator=g).bfloat16() for _ in range(2)), 0)
    reference = DynamicLayer()
    reference.update(cache.layers[0].keys.clone(), cache.layers[0].values.clone())
    assert kv_room.float32_bytes(cache, 3) == 2 * (2 * 2 * 8 * 4 * 4)
    kv_room.make_room(cache, 3, torch.float32)
    for _ in range(4):  # the fourth append moves to a new buffer, still float32
        new_k, new_v = (torch.randn(2, 2, 1, 4, generator=g).bfloat16() for _ in range(2))
        got, want = cache.update(new_k, new_v, 0), reference.update(new_k, new_v)
        assert got[0].dtype == got[1].dtype == torch.float32
        assert torch.equal(got[0], want[0].float()) and torch.equal(got[1], want[1].float())


@pytest.fixture(scope="module")
def bf16_sampler(model_path):
    return TorchSampler(model_path, dtype=torch.bfloat16)


def _decode(sampler, prompt, monkeypatch, fraction: float) -> tuple[list, list[tuple]]:
    """(the sequences, (query dtype, key dtype) of every one-query attention call) of a seeded sample."""
    monkeypatch.setattr(torch_sampler, "FLOAT32_KV_FRACTION", fraction)
    seen = []

    def spy(module, query, key, *args, **kwargs):
        if query.shape[2] == 1:
            seen.append((query.dtype, key.dtype))
        return ATTENTION(module, query, key, *args, **kwargs)

    monkeypatch.setattr(decode_attention.preemption, "attention", spy)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=7, num_samples=4)
    return sampler.sample([prompt], params)[0].sequences, seen


def test_a_bf16_model_attends_in_float32_while_the_copy_fits_and_agrees_with_bf16(bf16_sampler, prompts, monkeypatch):
    assert bf16_sampler.model.config._attn_implementation == decode_attention.NAME
    fast, seen_fast = _decode(bf16_sampler, prompts[1], monkeypatch, torch_sampler.FLOAT32_KV_FRACTION)
    slow, seen_slow = _decode(bf16_sampler, prompts[1], monkeypatch, 0.0)  # no room: the cache stays bf16
    assert seen_fast and set(seen_fast) == {(torch.float32, torch.float32)}
    assert seen_slow and set(seen_slow) == {(torch.bfloat16, torch.bfloat16)}
    # the same draws from the same logits up to the kernels' bf16 rounding: where the tokens agree so far,
    # each log-prob agrees to bf16's resolution of the logits (a wrong attention is off by whole units)
    for a, b in zip(fast, slow):
        for k in range(len(a.tokens)):
            assert abs(a.logprobs[k] - b.logprobs[k]) <= 0.05 * max(1.0, abs(b.logprobs[k]))
            if a.tokens[k] != b.tokens[k]:
                break
