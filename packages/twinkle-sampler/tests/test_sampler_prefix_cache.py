"""TorchSampler's prefix cache: sample and compute_logprobs reuse each other's prefill, per adapter and
weights, within a byte budget, and give what a sampler without the cache gives.

Reuse is asserted twice: by the cache's counters and by the tokens the model's forward receives, so a
cache that silently stopped reusing (or reused across weights or tenants) fails here."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch

from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter

BIG = 64 << 20
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, seed=7, num_samples=3, ignore_eos=True, stop=[])


def make(model_path, trainer, budget: int | None = BIG) -> TorchSampler:
    s = TorchSampler(model_path, prefix_cache_bytes=budget)
    for name in ("tenant", "other"):
        s.set_adapter(name, extract_adapter(trainer, name).clone(), version=1)
    return s


@pytest.fixture(scope="module")
def plain(model_path, trainer) -> TorchSampler:
    return make(model_path, trainer, budget=0)


@pytest.fixture(scope="module")
def long_prompt(prompts) -> list[int]:
    return prompts[1] + prompts[3] + prompts[0] + prompts[1]


@contextmanager
def forwards(sampler: TorchSampler):
    """The input_ids shape of every model forward inside the block (prefills, then decode steps)."""
    shapes: list[tuple[int, ...]] = []

    def hook(_module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        shapes.append(tuple(ids.shape))

    handle = sampler.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield shapes
    finally:
        handle.remove()


def assert_lps_close(got: list, want: list) -> None:
    """fp32 agreement relative to the log-probs' magnitude (the first entry of each row is None)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[0] is None and w[0] is None and len(g) == len(w)
        g_T, w_T = torch.tensor(g[1:], dtype=torch.float64), torch.tensor(w[1:], dtype=torch.float64)
        torch.testing.assert_close(g_T, w_T, rtol=1e-5, atol=1e-5 * max(1.0, float(w_T.abs().max())))


def tokens(responses) -> list[list[list[int]]]:
    return [[s.tokens for s in r.sequences] for r in responses]


def test_score_after_sample_reuses_the_prompt(model_path, trainer, plain, long_prompt):
    cached = make(model_path, trainer)
    got = cached.sample([long_prompt], PARAMS, adapter_name="tenant")
    want = plain.sample([long_prompt], PARAMS, adapter_name="tenant")
    assert tokens(got) == tokens(want)
    assert_lps_close([[None, *s.logprobs] for s in got[0].sequences], [[None, *s.logprobs] for s in want[0].sequences])
    assert cached.prefix_cache_stats().misses == 1 and cached.prefix_cache_stats().entries == 1

    scored = [long_prompt + s.tokens for s in got[0].sequences]
    with forwards(cached) as shapes:
        lps = cached.compute_logprobs(scored, adapter_name="tenant")
    assert shapes == [(3, PARAMS.max_tokens)]  # only the completions were prefilled
    stats = cached.prefix_cache_stats()
    assert (stats.hits, stats.tokens_reused) == (3, 3 * len(long_prompt))
    with forwards(plain) as shapes:
        assert_lps_close(lps, plain.compute_logprobs(scored, adapter_name="tenant"))
    assert shapes == [(3, len(scored[0]))]


def test_prompt_logprobs_of_cached_positions(model_path, trainer, plain, long_prompt, prompts):
    cached = make(model_path, trainer)
    cached.compute_logprobs([long_prompt + prompts[2]], adapter_name="other")
    params = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3)
    with forwards(cached) as shapes:
        (got,) = cached.sample([long_prompt], params, adapter_name="other")
    assert shapes[0] == (1, 1)  # all but the last prompt token came from the cache
    (want,) = plain.sample([long_prompt], params, adapter_name="other")
    assert got.sequences[0].tokens == want.sequences[0].tokens
    assert_lps_close([got.prompt_logprobs], [want.prompt_logprobs])
    assert got.prompt_top_logprobs[0] is None and len(got.prompt_top_logprobs) == len(long_prompt)
    for g, w in zip(got.prompt_top_logprobs[1:], want.prompt_top_logprobs[1:]):
        assert [i for i, _ in g] == [i for i, _ in w]
        assert_lps_close([[None, *(v for _, v in g)]], [[None, *(v for _, v in w)]])


def test_new_weights_invalidate(model_path, trainer, long_prompt, prompts):
    cached = make(model_path, trainer)
    seq = long_prompt + prompts[2]
    before = cached.compute_logprobs([seq], adapter_name="tenant")
    new_weights = extract_adapter(trainer, "other").clone()
    cached.set_adapter("tenant", new_weights, version=2)
    fresh = TorchSampler(model_path, prefix_cache_bytes=0)
    fresh.set_adapter("tenant", new_weights.clone(), version=2)
    with forwards(cached) as shapes:
        after = cached.compute_logprobs([seq], adapter_name="tenant")
    assert shapes == [(1, len(seq))] and cached.prefix_cache_stats().hits == 0
    assert cached.prefix_cache_stats().invalidations == 1
    assert_lps_close(after, fresh.compute_logprobs([seq], adapter_name="tenant"))
    assert max(abs(a - b) for a, b in zip(after[0][1:], before[0][1:])) > 0.05

    # Weights changed in place (an in-process sync shares the trainer's storage): no new version.
    with torch.no_grad():
        for b in new_weights.lora_B.values():
            b.mul_(-1.0)
    fresh.set_adapter("tenant", new_weights.clone(), version=2)
    with forwards(cached) as shapes:
        changed = cached.compute_logprobs([seq], adapter_name="tenant")
    assert shapes == [(1, len(seq))] and cached.prefix_cache_stats().hits == 0
    assert_lps_close(changed, fresh.compute_logprobs([seq], adapter_name="tenant"))
    assert max(abs(a - b) for a, b in zip(changed[0][1:], after[0][1:])) > 0.05

    cached.remove_adapter("tenant")
    assert cached.prefix_cache_stats().entries == 0


def test_adapters_never_share_entries(model_path, trainer, plain, long_prompt, prompts):
    cached = make(model_path, trainer)
    seq = long_prompt + prompts[0]
    cached.compute_logprobs([seq], adapter_name="tenant")
    for adapter in ("other", None):
        with forwards(cached) as shapes:
            got = cached.compute_logprobs([seq], adapter_name=adapter)
        assert shapes == [(1, len(seq))]
        assert_lps_close(got, plain.compute_logprobs([seq], adapter_name=adapter))
    assert cached.prefix_cache_stats().hits == 0 and cached.prefix_cache_stats().entries == 3
    with forwards(cached) as shapes:
        cached.compute_logprobs([seq], adapter_name="tenant")
    assert shapes == [(1, 1)] and cached.prefix_cache_stats().hits == 1


def test_eviction_keeps_bytes_under_budget(model_path, trainer, long_prompt):
    probe = make(model_path, trainer)
    seqs = [[first, *long_prompt] for first in (11, 12, 13, 14)]  # equal lengths, no shared prefix
    probe.compute_logprobs([seqs[0]])
    entry_bytes = probe.prefix_cache_stats().bytes_held
    budget = int(2.5 * entry_bytes)  # room for two entries
    cached = make(model_path, trainer, budget=budget)
    cached.compute_logprobs([seqs[0]])
    cached.compute_logprobs([seqs[1]])
    cached.compute_logprobs([seqs[0]])  # a hit: seqs[1] is now the least recently used
    assert cached.prefix_cache_stats().hits == 1
    for s in seqs[2:]:
        cached.compute_logprobs([s])
        assert cached.prefix_cache_stats().bytes_held <= budget
    stats = cached.prefix_cache_stats()
    assert (stats.entries, stats.evictions) == (2, 2)
    with forwards(cached) as shapes:
        cached.compute_logprobs([seqs[3]])  # the newest: still held
        cached.compute_logprobs([seqs[1]])  # evicted first
    assert shapes == [(1, 1), (1, len(seqs[1]))]


def test_mixed_batch_equals_uncached(model_path, trainer, plain, long_prompt, prompts):
    cached = make(model_path, trainer)
    cached.compute_logprobs([long_prompt + prompts[2]], adapter_name="tenant")
    partial = long_prompt[:7] + prompts[3]  # shares 7 tokens, then differs: a pad run in the middle
    fresh = prompts[2] + prompts[0]  # shorter than long_prompt, nothing cached
    assert len(fresh) < len(partial) < len(long_prompt)
    batch = [long_prompt, fresh, partial]
    # greedy and unseeded: a seeded sample never reads the cache (test_sampler_seeded_cache.py)
    params = SamplingParams(max_tokens=5, temperature=0.0, num_samples=2, prompt_logprobs=True)
    adapters = ["tenant", None, "tenant"]
    with forwards(cached) as shapes:
        got = cached.sample(batch, params, adapter_name=adapters)
    assert shapes[0] == (3, max(1, len(fresh), len(partial) - 7))  # the cached row fed 1 token
    want = plain.sample(batch, params, adapter_name=adapters)
    assert tokens(got) == tokens(want)
    assert_lps_close([r.prompt_logprobs for r in got], [r.prompt_logprobs for r in want])
    for g, w in zip(got, want):
        assert_lps_close([[None, *s.logprobs] for s in g.sequences], [[None, *s.logprobs] for s in w.sequences])
    stats = cached.prefix_cache_stats()
    assert (stats.hits, stats.misses) == (2, 2)

    scored = [long_prompt + got[0].sequences[1].tokens, fresh + got[1].sequences[0].tokens, partial]
    adapters = ["tenant", "tenant", "tenant"]
    with forwards(cached) as shapes:
        lps = cached.compute_logprobs(scored, adapter_name=adapters)
    assert shapes[0][1] < max(len(s) for s in scored)
    assert_lps_close(lps, plain.compute_logprobs(scored, adapter_name=adapters))


def test_budget_zero_is_the_uncached_path(model_path, trainer, plain, long_prompt, prompts):
    seq = long_prompt + prompts[2]
    first = plain.compute_logprobs([seq], adapter_name="tenant")
    with forwards(plain) as shapes:
        again = plain.compute_logprobs([seq], adapter_name="tenant")
        plain.sample([long_prompt], SamplingParams(max_tokens=2, temperature=0), adapter_name="tenant")
    assert again == first and shapes[:2] == [(1, len(seq)), (1, len(long_prompt))]
    stats = plain.prefix_cache_stats()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes_held, stats.budget_bytes) == (0, 0, 0, 0, 0)


def test_default_budget_is_a_fraction_of_the_weights(model_path):
    from twinkle.sampler.torch_sampler import PREFIX_CACHE_FRACTION

    s = TorchSampler(model_path)
    weight_bytes = sum(p.numel() * p.element_size() for p in s.model.parameters())
    assert s.prefix_cache_stats().budget_bytes == int(PREFIX_CACHE_FRACTION * weight_bytes) > 0


@pytest.mark.parametrize("family, reuses", [("deepseek_v3", True), ("gpt_oss", False)])
def test_attention_families(family, reuses):
    """deepseek_v3: keys and values of different head dims (latent attention) are cached and reused;
    gpt_oss: sliding-window layers, whose window a mid-batch pad run would widen, never reuse."""
    from twinkle.model.families import tiny_model

    base = tiny_model(family)
    cached = TorchSampler(model=copy.deepcopy(base), prefix_cache_bytes=BIG)
    plain = TorchSampler(model=copy.deepcopy(base), prefix_cache_bytes=0)
    batch = [[5, 17, 33, 90, 4, 8, 9, 10, 11, 12], [7, 7, 120, 61, 3, 3]]
    got, want = cached.sample(batch, PARAMS), plain.sample(batch, PARAMS)
    assert tokens(got) == tokens(want)
    scored = [p + s.tokens for p, r in zip(batch, got) for s in r.sequences]
    with forwards(cached) as shapes:
        lps = cached.compute_logprobs(scored)
    assert_lps_close(lps, plain.compute_logprobs(scored))
    assert (shapes == [(len(scored), PARAMS.max_tokens)]) == reuses
    assert (cached.prefix_cache_stats().entries > 0) == reuses


def test_namespaces_share_no_kv(model_path, trainer, long_prompt):
    """Two namespaces on one adapter and the same weights (a server's inflight sampling sessions) each
    reuse only their own prefixes, and say how many prompt tokens came from the cache; new weights,
    installed or written in place, leave no namespace anything to reuse."""
    cached = make(model_path, trainer)
    params = SamplingParams(max_tokens=3, temperature=0)

    def sample(namespace):
        with forwards(cached) as shapes:
            (resp,) = cached.sample([long_prompt], params, adapter_name="tenant", cache_namespace=namespace)
        return resp, shapes[0]

    first, fed = sample("a")
    assert (first.cached_prompt_tokens, fed) == (0, (1, len(long_prompt)))
    again, fed = sample("a")
    assert (again.cached_prompt_tokens, fed) == (len(long_prompt) - 1, (1, 1))
    for namespace in ("b", None):  # another session, and the shared namespace, prefill it all
        other, fed = sample(namespace)
        assert (other.cached_prompt_tokens, fed) == (0, (1, len(long_prompt)))
        assert other.sequences[0].tokens == first.sequences[0].tokens == again.sequences[0].tokens
    assert cached.prefix_cache_stats().entries == 3

    with torch.no_grad():  # in place, as an in-process sync writes: one lookup drops every namespace's entry
        for b in cached.router.adapters["tenant"].lora_B.values():
            b.mul_(-1.0)
    changed, fed = sample("a")
    assert (changed.cached_prompt_tokens, fed) == (0, (1, len(long_prompt)))
    stats = cached.prefix_cache_stats()
    assert (stats.entries, stats.invalidations) == (1, 3)
    cached.set_adapter("tenant", extract_adapter(trainer, "other").clone(), version=2)
    assert cached.prefix_cache_stats().entries == 0
