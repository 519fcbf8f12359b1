"""Four tenants' steps fused into one pass at the Qwen3-0.6B shape (issue 47), against one adapter over
the same rows: the server's engine (MultiLoraModel) on `twinkle://qwen3-0.6b-shape` (random weights at
the published shape, 151,936-token vocabulary; the base in the dtype the engine chooses for this CPU).

  fused   4 tenants (LoRA ranks 8/16/32/8 on every attention and MLP projection, AdamW) x 2 rows x
          128 tokens in one forward_backward_fused pass, then each tenant's clip-and-step
  single  ONE adapter (rank 16) over all the same rows in one pass and one optimizer step: the bound
          of fusing (nothing per tenant)
Alternating step by step (bench_multi_lora_fused's loops and timing), medians of wall and CPU seconds.

    uv run python benchmarks/bench_scale_fused.py [--steps 4] [--warmup 1]

Final line: JSON with `ratio` = fused / single median step seconds (goal <= 1.15) and the raw numbers.
"""

import argparse
import json
import os

import torch
from bench_multi_lora_fused import (
    EXPERTS,
    LINEARS,
    fused_step,
    make_batches,
    make_engine,
    measure,
    single_adapter,
    single_step,
    summary,
    tenants,
)
from transformers import AutoConfig, AutoModelForCausalLM

from twinkle.hub import resolve_model_path
from twinkle.model import base_dtype
from twinkle.model.structure import describe

MODEL = "twinkle://qwen3-0.6b-shape"
TENANTS, ROWS, SEQ = 4, 2, 128


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with torch.device("meta"):  # the structure only
        structure = describe(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model_path(MODEL))))
    LINEARS[:], EXPERTS[:] = structure.all_linear(), []
    ranks = tenants(TENANTS)
    engine = make_engine(MODEL, ranks)
    batches = make_batches(ranks, ROWS, SEQ, engine.base.config.vocab_size)
    single_engine, all_rows = single_adapter(MODEL, batches)
    tokens = TENANTS * ROWS * SEQ
    times = measure(
        {"fused": lambda: fused_step(engine, batches), "single": lambda: single_step(single_engine, all_rows)},
        args.steps,
        args.warmup,
    )
    result = {name: summary(t, tokens) for name, t in times.items()}
    ratio = result["fused"]["median_s"] / result["single"]["median_s"]
    cpu_ratio = result["fused"]["median_cpu_s"] / result["single"]["median_cpu_s"]
    print(
        json.dumps(
            {
                "benchmark": "scale_fused",
                "ratio": round(ratio, 3),
                "cpu_ratio": round(cpu_ratio, 3),
                "model": MODEL,
                "base_dtype": base_dtype.name(next(engine.base.parameters()).dtype),
                "tenants": ranks,
                "rows_per_tenant": ROWS,
                "seq": SEQ,
                "load_avg": os.getloadavg()[0],
                **result,
            }
        )
    )


if __name__ == "__main__":
    main()
