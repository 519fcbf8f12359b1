"""Four LoRA adapters served in one TorchSampler batch against four sequential HF `generate` calls.

The demo preset (twinkle://qwen3-demo), fp32, 2 threads. Four LoRA adapters (r16 on every Linear of
the attention and MLP) live in one peft model, the usual way to hold several tenants' adapters.
8 prompts, 2 per adapter, 64 new tokens each, greedy:
- baseline: for each adapter, `peft_model.set_adapter(name)` then `generate` on its 2 prompts (4 calls);
- Twinkle: one `TorchSampler.sample` call whose rows name their adapters (per-row LoRA routing).
Runs alternate; medians are reported.

Prints a final JSON line: `speedup` (sequential seconds / one-batch seconds) and the raw numbers.
Run: .venv/bin/python benchmarks/bench_sampler_multi_adapter.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle.hub import DEFAULT_MODEL, resolve_model_path
from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter

torch.set_num_threads(2)
ADAPTERS = ["a", "b", "c", "d"]
PER_ADAPTER, NEW_TOKENS, REPEATS = 2, 64, 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    peft_model = None
    for i, name in enumerate(ADAPTERS):
        torch.manual_seed(i)
        config = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
        if peft_model is None:
            base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            peft_model = get_peft_model(base, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    peft_model.eval()
    sampler = TorchSampler(path)
    for name in ADAPTERS:
        sampler.set_adapter(name, extract_adapter(peft_model, name))

    prompts = [
        tokenizer(f"Tenant {i}: tell me about number {i * 13}." + " please" * (i % 3))["input_ids"]
        for i in range(len(ADAPTERS) * PER_ADAPTER)
    ]
    row_adapters = [ADAPTERS[i // PER_ADAPTER] for i in range(len(prompts))]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    tokenizer.padding_side = "left"

    def run_sequential() -> int:
        total = 0
        for k, name in enumerate(ADAPTERS):
            peft_model.set_adapter(name)
            batch = tokenizer.pad({"input_ids": prompts[k * PER_ADAPTER : (k + 1) * PER_ADAPTER]}, return_tensors="pt")
            with torch.no_grad():
                out = peft_model.generate(
                    **batch, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
                )
            total += (out.shape[1] - batch["input_ids"].shape[1]) * PER_ADAPTER
        return total

    def run_one_batch() -> int:
        return sum(len(r.sequences[0].tokens) for r in sampler.sample(prompts, params, adapter_name=row_adapters))

    run_sequential(), run_one_batch()  # warm-up
    seq_s, batch_s = [], []
    for _ in range(REPEATS):
        for fn, times in ((run_sequential, seq_s), (run_one_batch, batch_s)):
            t = time.perf_counter()
            n = fn()
            times.append(time.perf_counter() - t)
            assert n == len(prompts) * NEW_TOKENS, n
    seq, one = statistics.median(seq_s), statistics.median(batch_s)
    print(f"4 sequential peft generate calls  {seq:.3f} s")
    print(f"one TorchSampler batch (4 adapters) {one:.3f} s")
    print(
        json.dumps(
            {
                "bench": "sampler_multi_adapter",
                "speedup": round(seq / one, 3),
                "model": DEFAULT_MODEL,
                "adapters": len(ADAPTERS),
                "rows_per_adapter": PER_ADAPTER,
                "new_tokens": NEW_TOKENS,
                "lora_rank": 16,
                "sequential_generate_s": seq_s,
                "one_batch_s": batch_s,
                "one_batch_tokens_per_s": round(len(prompts) * NEW_TOKENS / one, 1),
                "sequential_tokens_per_s": round(len(prompts) * NEW_TOKENS / seq, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
