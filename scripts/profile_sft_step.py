"""Where a TransformersModel LoRA SFT step's time goes, at the quickstart's shape (the batches
bench_peer_trl_sft.py feeds both sides): torch.profiler over `--steps` steps after 5 warm-up steps,
printing the forward+backward / optimizer split and the largest self-CPU shares by op.

    uv run python scripts/profile_sft_step.py [--steps 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch
    from peft import LoraConfig
    from torch.profiler import ProfilerActivity, profile, record_function

    from twinkle.model import TransformersModel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_peer_trl_sft import DEFAULT_MODEL, quickstart_batches

    torch.set_num_threads(args.threads)
    batches = quickstart_batches(args.steps + 5, 8)
    model = TransformersModel(model_id=DEFAULT_MODEL)
    model.add_adapter_to_model("p", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=2e-3, weight_decay=0.01, adapter_name="p")
    for rows in batches[:5]:
        model.forward_backward(inputs=rows, adapter_name="p")
        model.clip_grad_and_step(max_grad_norm=1.0, adapter_name="p")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for rows in batches[5:]:
            with record_function("forward_backward"):
                model.forward_backward(inputs=rows, adapter_name="p")
            with record_function("optimizer"):
                model.clip_grad_and_step(max_grad_norm=1.0, adapter_name="p")
        wall = time.perf_counter() - start
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    phase = {e.key: e.cpu_time_total for e in events if e.key in ("forward_backward", "optimizer")}
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    print(
        json.dumps(
            {
                "s_per_step": wall / args.steps,
                "forward_backward_share": phase["forward_backward"] / sum(phase.values()),
                "optimizer_share": phase["optimizer"] / sum(phase.values()),
                "self_cpu_share_by_op": {e.key: round(e.self_cpu_time_total / total, 3) for e in top},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
