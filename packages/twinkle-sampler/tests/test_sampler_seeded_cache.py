"""A seeded sample is a function of its request alone, to the bit, whatever the prefix cache holds.

A prefill that takes a prefix's KV from the cache feeds the model only the rest of the prompt, and
those smaller matmuls round differently (~5e-7 in the log-probs): a seeded request that read the cache
would answer one way on a cold cache (after a server restart, on a fresh snapshot) and another once
the same prefix had run. RL resume relies on the repeat being exact (the behaviour log-probs enter the
loss), so a seeded sample prefills in full; it still stores what it computed, for unseeded requests
and compute_logprobs to reuse.
"""

from __future__ import annotations

from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter

SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=11, num_samples=3, ignore_eos=True, stop=[])


def draws(response) -> list[tuple[list[int], list[float]]]:
    return [(s.tokens, s.logprobs) for s in response.sequences]


def test_seeded_sample_is_the_same_cold_and_warm(model_path, trainer, prompts):
    cached = TorchSampler(model_path, prefix_cache_bytes=64 << 20)
    plain = TorchSampler(model_path, prefix_cache_bytes=0)
    for s in (cached, plain):
        s.set_adapter("tenant", extract_adapter(trainer, "tenant").clone(), version=1)
    prompt = prompts[1] + prompts[3] + prompts[0]
    longer = prompt + prompts[2]  # shares all of `prompt`: a warm cache would serve it

    (cold,) = cached.sample([prompt], SEEDED, adapter_name="tenant")
    (warm,) = cached.sample([prompt], SEEDED, adapter_name="tenant")
    (extended,) = cached.sample([longer], SEEDED, adapter_name="tenant")
    assert draws(warm) == draws(cold)  # equal lists of floats: bit for bit
    assert (cold.cached_prompt_tokens, warm.cached_prompt_tokens, extended.cached_prompt_tokens) == (0, 0, 0)
    assert draws(cold) == draws(plain.sample([prompt], SEEDED, adapter_name="tenant")[0])
    assert draws(extended) == draws(plain.sample([longer], SEEDED, adapter_name="tenant")[0])

    # what the seeded samples computed is stored: an unseeded sample and a score reuse it
    (unseeded,) = cached.sample([longer], SamplingParams(max_tokens=2, temperature=1.0), adapter_name="tenant")
    assert unseeded.cached_prompt_tokens == len(longer) - 1
    hits = cached.prefix_cache_stats().hits
    cached.compute_logprobs([prompt + cold.sequences[0].tokens], adapter_name="tenant")
    assert cached.prefix_cache_stats().hits == hits + 1
