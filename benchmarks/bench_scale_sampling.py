"""GRPO-style group sampling at the Qwen3-0.6B shape (issue 47): 8 samples of 64 tokens from one shared
128-token prompt, through the unmodified Tinker SDK against a `twinkle-server`, vs HF `generate`.

Both sides hold the model the same way: `twinkle://qwen3-0.6b-shape` (random weights at the published
shape, 151,936-token vocabulary), its frozen base in the dtype the server chooses for this CPU (bf16
where the CPU multiplies bf16 fast, as `get_info` says; fp32 elsewhere), 2 torch threads. HF side: the
model loaded in that dtype, `generate(num_return_sequences=8, do_sample=True, top_k=0, min_new_tokens=
max_new_tokens=64)`, KV cache on, batched as the library batches. Twinkle side: `SamplingClient.sample(
prompt, num_samples=8, SamplingParams(max_tokens=64, temperature=1))` of a LoRA training client's
sampler (the weights a GRPO loop samples from), every sample run to 64 tokens (no stop sequence, and a
random-weight model rarely emits its end token; a shorter sample is counted as what it is). The SDK
side includes everything a user waits for: HTTP, queueing, the returned log-probs. The server's sampler
runs an unseeded decode's steps (and its prefill) at 2 threads or 1, whichever its steps time faster
(twinkle.sampler.step_threads: on a loaded machine a 2-thread team waits for its second thread at every
parallel region); HF's side runs at the 2 threads set here, as a user of `generate` would. Runs alternate
(HF, Twinkle, ...); medians. Random weights measure speed and memory, not quality.

    uv run python benchmarks/bench_scale_sampling.py [--repeats 3]

Final line: JSON with `speedup` = Twinkle's sampled tokens/s ÷ HF generate's (goal ≥ 2), and the raw
numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from _server import start_server

MODEL = "twinkle://qwen3-0.6b-shape"
N, PROMPT_TOKENS, NEW_TOKENS = 8, 128, 64


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import tinker
    from tinker import types
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model_path
    from twinkle.model import base_dtype

    torch.set_num_threads(2)
    proc, url, keys = start_server(MODEL, 1)
    try:
        service = tinker.ServiceClient(base_url=url, api_key=keys[0])
        trainer = service.create_lora_training_client(base_model=MODEL, rank=16, seed=0)
        sampler = trainer.save_weights_and_get_sampling_client(name="s0").result()
        path = resolve_model_path(MODEL)
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()  # as stored (bf16)
        # the dtype the server's "auto" holds the base in, by the same rule (twinkle.model.base_dtype)
        dtype = base_dtype.resolve("auto", None, "cpu", sum(p.numel() for p in model.parameters()))
        model = model.to(dtype)
        served_dtype = base_dtype.name(dtype)
        prompt = [(37 * i + 11) % 30_000 + 100 for i in range(PROMPT_TOKENS)]
        ids = torch.tensor([prompt])

        def run_hf() -> int:
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    top_k=0,
                    num_return_sequences=N,
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                )
            return (out.shape[1] - ids.shape[1]) * out.shape[0]

        def run_twinkle() -> int:
            params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0)
            got = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=N, sampling_params=params).result()
            return sum(len(s.tokens) for s in got.sequences)

        run_hf(), run_twinkle()  # warm-up: both sides' first call pays one-time costs
        hf_s, tw_s, tw_tokens = [], [], []
        for _ in range(args.repeats):
            for fn, times in ((run_hf, hf_s), (run_twinkle, tw_s)):
                t = time.perf_counter()
                got = fn()
                times.append(time.perf_counter() - t)
                if fn is run_twinkle:
                    tw_tokens.append(got)
    finally:
        proc.terminate()
        proc.wait(60)
    hf_tps = N * NEW_TOKENS / statistics.median(hf_s)
    tw_tps = statistics.median(tw_tokens) / statistics.median(tw_s)
    print(f"HF generate {hf_tps:.1f} tokens/s   Twinkle through the SDK {tw_tps:.1f} tokens/s")
    print(
        json.dumps(
            {
                "bench": "scale_sampling",
                "speedup": round(tw_tps / hf_tps, 3),
                "model": MODEL,
                "base_dtype": served_dtype,
                "n": N,
                "prompt_tokens": PROMPT_TOKENS,
                "new_tokens": NEW_TOKENS,
                "hf_generate_s": [round(s, 3) for s in hf_s],
                "twinkle_sdk_s": [round(s, 3) for s in tw_s],
                "twinkle_tokens": tw_tokens,
                "hf_tokens_per_s": round(hf_tps, 2),
                "twinkle_tokens_per_s": round(tw_tps, 2),
                "load_avg": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
