"""TorchSampler's prefix cache in an RL-like step: sample n completions of a prompt, then score each
prompt+completion with compute_logprobs (what a GRPO loop does for the reference/behaviour log-probs).

Both sides: the demo preset (twinkle://qwen3-demo) in fp32 on 2 threads, one model shared by two
samplers: one with the default prefix-cache budget, one with budget 0 (every call prefills in full).
Each step uses a fresh prompt of --prompt-tokens tokens (no reuse across steps, only sample -> score
within one), n=4 samples at temperature 1 with exactly --new-tokens new tokens. Steps alternate
(uncached, cached, ...) so load from other processes hits both alike; the medians are reported, and
the cached side's log-probs are checked against the uncached side's.

Prints a final JSON line: `speedup` (uncached step seconds / cached step seconds) and the raw numbers.
Run:
    uv run benchmarks/bench_sampler_prefix_cache.py
"""

from __future__ import annotations

import json
import statistics
import time

from _sampling_setup import load_model, sampling_args

from twinkle.sampler import SamplingParams, TorchSampler


def main() -> None:
    args = sampling_args("sample -> compute_logprobs with and without the prefix cache", n=4, prompt_tokens=256)
    tokenizer, model = load_model(args.model)
    cached = TorchSampler(model=model, tokenizer=tokenizer)
    plain = TorchSampler(model=model, tokenizer=tokenizer, prefix_cache_bytes=0)
    params = SamplingParams(
        max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, num_samples=args.n, seed=0, stop=[]
    )

    def prompt(step: int) -> list[int]:
        text = " ".join(f"Task {step}.{i}: add {i} and {3 * i + step}, then check the sum." for i in range(256))
        return tokenizer(text)["input_ids"][: args.prompt_tokens]

    def rl_step(sampler: TorchSampler, ids: list[int]) -> list[list[float | None]]:
        (response,) = sampler.sample([ids], params)
        return sampler.compute_logprobs([ids + s.tokens for s in response.sequences])

    rl_step(cached, prompt(-1))  # warm-up (and the head check of the first store)
    rl_step(plain, prompt(-1))
    plain_s, cached_s, max_diff = [], [], 0.0
    for r in range(args.repeats):
        results = {}
        for name, sampler, times in (("plain", plain, plain_s), ("cached", cached, cached_s)):
            t = time.perf_counter()
            results[name] = rl_step(sampler, prompt(r))
            times.append(time.perf_counter() - t)
        for a, b in zip(results["cached"], results["plain"]):
            max_diff = max(max_diff, max(abs(x - y) for x, y in zip(a[1:], b[1:])))
    stats = cached.prefix_cache_stats()
    print(f"budget 0      {statistics.median(plain_s):.3f} s / step   (median of {args.repeats})")
    print(f"prefix cache  {statistics.median(cached_s):.3f} s / step   {stats}")
    print(
        json.dumps(
            {
                "bench": "sampler_prefix_cache",
                "speedup": round(statistics.median(plain_s) / statistics.median(cached_s), 3),
                "model": args.model,
                "n": args.n,
                "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens,
                "cached_step_s": cached_s,
                "uncached_step_s": plain_s,
                "max_logprob_abs_diff": max_diff,
                "cache": stats.as_dict(),
            }
        )
    )


if __name__ == "__main__":
    main()
