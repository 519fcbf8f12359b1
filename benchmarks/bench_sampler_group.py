"""GRPO group sampling: n samples of one prompt, TorchSampler (one prefill, its KV cache expanded to the
n rows) against HF `generate(num_return_sequences=n)` (which prefills n copies of the prompt).

Both sides: the demo preset (twinkle://qwen3-demo) in fp32 on 2 threads, one prompt of about
--prompt-tokens tokens, n=8 samples at temperature 1 with exactly --new-tokens new tokens each (HF:
min_new_tokens; TorchSampler: ignore_eos=True), KV cache on. TorchSampler also returns each token's
log-prob (equal to a training forward: tests/test_sampler_group.py); HF returns none. Runs alternate
(HF, Twinkle, HF, ...) so load from other processes hits both alike; the medians are reported.

Prints a final JSON line: `speedup` (HF seconds / TorchSampler seconds) and the raw numbers.
Run:
    uv run benchmarks/bench_sampler_group.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from _sampling_setup import load_model, sampling_args

from twinkle.sampler import SamplingParams, TorchSampler


def main() -> None:
    args = sampling_args("GRPO group sampling: TorchSampler vs HF generate", n=8, prompt_tokens=512)
    tokenizer, model = load_model(args.model)
    text = " ".join(f"Step {i}: add {i} and {3 * i}, then check the sum." for i in range(args.prompt_tokens))
    prompt = tokenizer(text)["input_ids"][: args.prompt_tokens]
    sampler = TorchSampler(model=model, tokenizer=tokenizer)
    params = SamplingParams(
        max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, logprobs=True, num_samples=args.n, seed=0
    )
    ids = torch.tensor([prompt])

    def run_hf() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_k=0,
                num_return_sequences=args.n,
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
            )
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    def run_twinkle() -> int:
        return sum(len(s.tokens) for s in sampler.sample([prompt], params)[0].sequences)

    run_hf(), run_twinkle()  # warm-up
    hf_s, tw_s = [], []
    for _ in range(args.repeats):
        for fn, times in ((run_hf, hf_s), (run_twinkle, tw_s)):
            t = time.perf_counter()
            got = fn()
            times.append(time.perf_counter() - t)
            assert got == args.n * args.new_tokens, got
    hf, tw = statistics.median(hf_s), statistics.median(tw_s)
    print(f"HF generate (n={args.n})  {hf:.3f} s   TorchSampler (shared prefill)  {tw:.3f} s")
    print(
        json.dumps(
            {
                "bench": "sampler_group",
                "speedup": round(hf / tw, 3),
                "model": args.model,
                "n": args.n,
                "prompt_tokens": len(prompt),
                "new_tokens": args.new_tokens,
                "hf_generate_s": hf_s,
                "torch_sampler_s": tw_s,
                "torch_sampler_returns_logprobs": True,
            }
        )
    )


if __name__ == "__main__":
    main()
