"""TorchSampler decode throughput against HF `generate`: same model, batch 8 x 64 new tokens, greedy.

Both sides: the demo preset (twinkle://qwen3-demo) in fp32 on 2 threads, 8 prompts of different
lengths (left padding), exactly 64 new tokens per row (HF: min_new_tokens=64; TorchSampler:
ignore_eos=True), KV cache on. Runs alternate (HF, Twinkle, HF, Twinkle, ...) so load from other
processes hits both alike; the median of each is reported.

Prints a final JSON line: `speedup` (TorchSampler tokens/s / HF generate tokens/s) and the raw numbers.
Run: .venv/bin/python benchmarks/bench_sampler_throughput.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle.hub import DEFAULT_MODEL, resolve_model_path
from twinkle.sampler import SamplingParams, TorchSampler

torch.set_num_threads(2)
BATCH, NEW_TOKENS, REPEATS = 8, 64, 5


def main() -> None:
    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tokenizer(f"Question {i}: what is {i} plus {i * 7}? " * (1 + i % 3))["input_ids"] for i in range(BATCH)]
    sampler = TorchSampler(model=model, tokenizer=tokenizer)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=True)

    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")

    def run_hf() -> int:
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        return (out.shape[1] - batch["input_ids"].shape[1]) * BATCH

    def run_twinkle() -> int:
        return sum(len(r.sequences[0].tokens) for r in sampler.sample(prompts, params))

    run_hf(), run_twinkle()  # warm-up
    hf_s, tw_s = [], []
    for _ in range(REPEATS):
        for fn, times in ((run_hf, hf_s), (run_twinkle, tw_s)):
            t = time.perf_counter()
            n = fn()
            times.append(time.perf_counter() - t)
            assert n == BATCH * NEW_TOKENS, n
    hf_tps = BATCH * NEW_TOKENS / statistics.median(hf_s)
    tw_tps = BATCH * NEW_TOKENS / statistics.median(tw_s)
    print(f"HF generate   {hf_tps:8.0f} tokens/s   (median of {REPEATS}: {statistics.median(hf_s):.3f} s)")
    print(f"TorchSampler  {tw_tps:8.0f} tokens/s   (median of {REPEATS}: {statistics.median(tw_s):.3f} s)")
    print(
        json.dumps(
            {
                "bench": "sampler_throughput",
                "speedup": round(tw_tps / hf_tps, 3),
                "model": DEFAULT_MODEL,
                "batch": BATCH,
                "new_tokens": NEW_TOKENS,
                "torch_sampler_tokens_per_s": round(tw_tps, 1),
                "hf_generate_tokens_per_s": round(hf_tps, 1),
                "torch_sampler_s": tw_s,
                "hf_generate_s": hf_s,
                "torch_sampler_returns_logprobs": True,
            }
        )
    )


if __name__ == "__main__":
    main()
