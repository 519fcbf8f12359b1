"""Four tenants at 8 x 128 tokens: the engine, fusing or not as the planner decides, vs sequential.

The planner's groups run as the server runs them: one `forward_backward_fused` per group, then each
tenant's optimizer step.

Same tenants and baseline as bench_multi_lora_fused.py (peft adapter switching), large batches.
Loops alternate step by step; medians compared. Also reported: the engine with fusion forced
(all four in one pass), to show what the planner's choice avoids or gains.
Final line: JSON with `speedup` = planner tokens/s / peft sequential tokens/s (goal >= 0.95).

    uv run python benchmarks/bench_multi_lora_planner.py [--steps 6] [--threads 2]
"""

import argparse
import json
import os

import torch
from bench_multi_lora_fused import (
    EXPERTS,
    LINEARS,
    PeftSwitching,
    fused_step,
    make_batches,
    make_engine,
    measure,
    summary,
    tenants,
)
from transformers import AutoConfig, AutoModelForCausalLM

from twinkle.hub import DEFAULT_MODEL, resolve_model_path
from twinkle.model.multi_lora.planner import FusionPlanner, Request, batch_shape
from twinkle.model.structure import describe


def planned_step(engine, batches, plan):
    for group in plan:
        engine.forward_backward_fused({r.tenant: batches[r.tenant] for r in group.requests})
    for tenant in batches:
        engine.clip_grad_and_step(adapter_name=tenant, max_grad_norm=1.0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.device("meta"):  # the structure only: which Linears (and expert weights) the adapters target
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model_path(DEFAULT_MODEL)))
    structure = describe(model)
    LINEARS[:], EXPERTS[:] = structure.all_linear(), structure.expert_parameters("experts")
    ranks = tenants(4)
    engine = make_engine(DEFAULT_MODEL, ranks)
    batches = make_batches(ranks, args.rows, args.seq, engine.base.config.vocab_size)
    baseline = PeftSwitching(resolve_model_path(DEFAULT_MODEL), ranks, batches)
    plan = FusionPlanner().plan([Request(t, shape=batch_shape(rows)) for t, rows in batches.items()])
    tokens = sum(len(r["input_ids"]) for b in batches.values() for r in b)
    times = measure(
        {
            "planner": lambda: planned_step(engine, batches, plan),
            "peft": baseline.step,
            "forced_fusion": lambda: fused_step(engine, batches),
        },
        args.steps,
        args.warmup,
    )
    result = {name: summary(t, tokens) for name, t in times.items()}
    print(
        json.dumps(
            {
                "benchmark": "multi_lora_planner_large",
                "model": DEFAULT_MODEL,
                "rows_per_tenant": args.rows,
                "seq": args.seq,
                "threads": args.threads,
                "load_avg": os.getloadavg()[0],
                "planner_passes": [[r.tenant for r in g.requests] for g in plan],
                **result,
                "forced_fusion_vs_peft": round(
                    result["forced_fusion"]["tokens_per_s"] / result["peft"]["tokens_per_s"], 3
                ),
                "cpu_speedup": round(result["planner"]["tokens_per_cpu_s"] / result["peft"]["tokens_per_cpu_s"], 3),
                "speedup": round(result["planner"]["tokens_per_s"] / result["peft"]["tokens_per_s"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
