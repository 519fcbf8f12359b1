"""Memory of 8 tenants in one process vs its ideal, and vs 8 separate single-tenant processes.

Each measurement runs in a fresh child process: RSS after importing torch/transformers/twinkle
and a warm-up step on the tiny test model, deleted again (the runtime every process pays), then after loading DEFAULT_MODEL, adding the
tenants (ranks 8/16/32 cycling, all-linear, AdamW) and training 3 fused steps. The engine's
memory is the growth between the two; its ideal is the bytes of the base weights plus, per
tenant, its LoRA weights and AdamW state (exp_avg, exp_avg_sq). The benchmark trims nothing: each
process runs the engine as a server does (`release_memory_when_idle()`, which gives freed heap back
to the OS after a quiet second), and RSS is read both right after the last step (`ratio_busy`) and
after 2 s of quiet (`ratio`).
Final line: JSON with `ratio` = engine memory / ideal (goal <= 1.2) and the 8-process comparison.

    uv run python benchmarks/bench_multi_lora_memory.py [--tenants 8]
"""

import argparse
import json
import subprocess
import sys
import time

RANKS = (8, 16, 32)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(tenants: int) -> dict:
    import gc

    import torch
    from peft import LoraConfig

    from twinkle.hub import DEFAULT_MODEL, TEST_MODEL
    from twinkle.model.multi_lora import MultiLoraModel

    torch.set_num_threads(2)
    # Warm-up on the tiny test model: loads the modelling code and libraries every process pays
    # for, whatever its model size; then it is deleted and the baseline is read.
    warm = MultiLoraModel(TEST_MODEL)
    warm.release_memory_when_idle(1.0)
    warm.add_adapter_to_model("warm", LoraConfig(r=2, target_modules="all-linear"))
    warm.set_optimizer("AdamW", lr=1e-4)
    warm.forward_backward([{"input_ids": [5, 6, 7, 8]}])
    warm.clip_grad_and_step()
    del warm
    gc.collect()
    time.sleep(2.0)  # the warm-up engine's idle release
    runtime = rss_bytes()
    engine = MultiLoraModel(DEFAULT_MODEL)
    engine.release_memory_when_idle(1.0)
    names = [f"tenant{i}" for i in range(tenants)]
    for i, name in enumerate(names):
        rank = RANKS[i % len(RANKS)]
        engine.add_adapter_to_model(name, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
        engine.set_optimizer("AdamW", adapter_name=name, lr=1e-4)
    batch = [{"input_ids": list(range(3, 67))} for _ in range(2)]
    for _ in range(3):
        engine.forward_backward_fused({name: batch for name in names})
        for name in names:
            engine.clip_grad_and_step(adapter_name=name)
    busy = rss_bytes()
    time.sleep(2.0)  # quiet: the engine gives freed memory back by itself
    after = rss_bytes()
    # named_parameters() counts a tied embedding/head once, as memory does
    base_bytes = sum(
        t.numel() * t.element_size()
        for n, t in [*engine.base.named_parameters(), *engine.base.named_buffers()]
        if ".lora_A." not in n and ".lora_B." not in n
    )
    adapter_bytes = sum(engine.adapters[n].parameter_bytes() for n in names)
    return {
        "runtime_rss": runtime,
        "rss": after,
        "rss_busy": busy,
        "engine_bytes": after - runtime,
        "engine_bytes_busy": busy - runtime,
        "ideal_bytes": base_bytes + adapter_bytes,
        "base_bytes": base_bytes,
        "adapters_with_optimizer_bytes": adapter_bytes,
    }


def run_child(tenants: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(tenants)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--child", type=int, default=0)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    one = run_child(args.tenants)
    singles = [run_child(1) for _ in range(args.tenants)]
    separate_rss = sum(s["rss"] for s in singles)
    mib = 1 << 20
    print(
        json.dumps(
            {
                "benchmark": "multi_lora_memory",
                "tenants": args.tenants,
                "one_process": {k: round(v / mib, 2) for k, v in one.items()},
                "single_tenant_process_mib": [round(s["rss"] / mib, 2) for s in singles],
                "separate_processes_total_rss_mib": round(separate_rss / mib, 2),
                "one_process_rss_mib": round(one["rss"] / mib, 2),
                "separate_over_one_process": round(separate_rss / one["rss"], 3),
                "ratio_busy": round(one["engine_bytes_busy"] / one["ideal_bytes"], 3),
                "ratio": round(one["engine_bytes"] / one["ideal_bytes"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
