"""Weight sync (trainer -> sampler) as a share of one RL step on the demo preset. Goal: <= 1%.

One RL step, as an RL loop runs it here: TorchSampler samples 8 prompts x 64 new tokens from the
adapter being trained; TransformersModel runs forward_backward on the 8 sampled sequences and
clip_grad_and_step (LoRA r16 on every Linear, AdamW, fp32, 2 threads); then the adapter is synced
to the sampler. Sync is timed for each path that runs in one process:
- inprocess (zero copy: the sampler serves the trainer's tensors; sync = extract + version bump),
- inprocess copy=True (a snapshot of the adapter per sync),
- object-store round trip (payload -> ray.put -> ray.get -> apply), when ray is installed.

Prints a final JSON line: `ratio` (zero-copy sync seconds / RL step seconds) and the raw numbers.
Run: .venv/bin/python benchmarks/bench_sampler_weight_sync.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from peft import LoraConfig

from twinkle.checkpoint_engine import InProcessCheckpointEngine
from twinkle.checkpoint_engine.ray_engine import adapter_to_payload, payload_to_adapter
from twinkle.hub import DEFAULT_MODEL
from twinkle.model import TransformersModel
from twinkle.sampler import SamplingParams, TorchSampler, extract_adapter

torch.set_num_threads(2)
STEPS, BATCH, NEW_TOKENS, SYNC_REPEATS = 3, 8, 64, 20
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def timed(fn, repeats=SYNC_REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    model = TransformersModel(model_id=DEFAULT_MODEL)
    model.add_adapter_to_model("policy", LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    model.set_optimizer("AdamW", lr=1e-3)
    sampler = TorchSampler(DEFAULT_MODEL)
    engine = InProcessCheckpointEngine()
    engine.sync(model, sampler, "policy")
    prompts = [sampler.tokenizer(f"Question {i}: what is {i} + {2 * i}?")["input_ids"] for i in range(BATCH)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=0, ignore_eos=True)

    step_s, sync_s = [], []
    for step in range(STEPS + 1):  # the first step warms up
        t = time.perf_counter()
        responses = sampler.sample(prompts, params, adapter_name="policy")
        rows = [
            {
                "input_ids": r.prompt_tokens + r.sequences[0].tokens,
                "labels": [-100] * len(r.prompt_tokens) + r.sequences[0].tokens,
            }
            for r in responses
        ]
        model.forward_backward(inputs=rows, adapter_name="policy")
        model.clip_grad_and_step(adapter_name="policy")
        t_sync = time.perf_counter()
        version = engine.sync(model, sampler, "policy")
        done = time.perf_counter()
        if step:
            step_s.append(done - t)
            sync_s.append(done - t_sync)
    assert sampler.weight_version("policy") == version == STEPS + 2

    zero_copy = timed(lambda: engine.sync(model, sampler, "policy"))
    copying = InProcessCheckpointEngine(copy=True)
    copy_s = timed(lambda: copying.sync(model, sampler, "policy", sampler_adapter_name="snapshot"))
    adapter_bytes = extract_adapter(model, "policy").num_bytes()
    result = {
        "bench": "sampler_weight_sync",
        "model": DEFAULT_MODEL,
        "lora_rank": 16,
        "adapter_bytes": adapter_bytes,
        "rl_step_s": step_s,
        "rl_step_median_s": statistics.median(step_s),
        "sync_in_step_s": sync_s,
        "inprocess_zero_copy_sync_s": zero_copy,
        "inprocess_copy_sync_s": copy_s,
    }
    try:
        import ray
    except ImportError:
        result["object_store_sync_s"] = None
    else:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:

            def via_store():
                payload = ray.get(ray.put(adapter_to_payload(extract_adapter(model, "policy"), 0)))
                sampler.set_adapter("via_store", payload_to_adapter(payload))

            result["object_store_sync_s"] = timed(via_store)
        finally:
            ray.shutdown()
    step = statistics.median(step_s)
    result["ratio"] = round(zero_copy / step, 6)
    result["copy_ratio"] = round(copy_s / step, 6)
    if result["object_store_sync_s"] is not None:
        result["object_store_ratio"] = round(result["object_store_sync_s"] / step, 6)
    print(
        f"RL step {step:.3f} s; zero-copy sync {zero_copy * 1e3:.2f} ms ({100 * zero_copy / step:.3f}%), "
        f"copy sync {copy_s * 1e3:.2f} ms ({100 * copy_s / step:.3f}%), adapter {adapter_bytes / 1e6:.2f} MB"
    )
    print(json.dumps({"ratio": result.pop("ratio"), **result}))


if __name__ == "__main__":
    main()
