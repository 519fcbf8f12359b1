"""Four tenants' steps fused into one pass at the Qwen3-0.6B shape (issue 47), against one adapter over
the same rows: the server's engine (MultiLoraModel) on `twinkle://qwen3-0.6b-shape` (random weights at
the published shape, 151,936-token vocabulary; the base in the dtype the engine chooses for this CPU).

  fused   4 tenants (LoRA ranks 8/16/32/8 on every attention and MLP projection, AdamW) x 2 rows x
          128 tokens in one forward_backward_fused pass, then each tenant's clip-and-step
  single  ONE adapter (rank 16) over all the same rows in one pass and one optimizer step: the bound
          of fusing (nothing per tenant)
Alternating step by step (bench_multi_lora_fused's loops and timing), medians of wall and CPU seconds.

    uv run python benchmarks/bench_scale_fused.py [--steps 4] [--warmup 1] [--layers 28]

`--layers N` keeps the first N decoder layers (a quicker slice while iterating; the head over the
151,936-token vocabulary stays whole). On a shared machine, run it with OMP_WAIT_POLICY=PASSIVE too:
with torch's default OpenMP waiting each thread spins at every op's end while its partner waits for
a core, so under load a step's CPU time grows with its number of ops, not its work (the JSON
records the setting as `omp_wait_policy`).

Final line: JSON with `ratio` = fused / single median step seconds (goal <= 1.15) and the raw numbers.
"""

import argparse
import json
import os

import torch
from bench_multi_lora_fused import (
    EXPERTS,
    LINEARS,
    LR,
    fused_step,
    lora,
    make_batches,
    make_engine,
    measure,
    single_step,
    summary,
    tenants,
)
from transformers import AutoConfig, AutoModelForCausalLM

from twinkle.hub import resolve_model_path
from twinkle.model import base_dtype
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.structure import describe

MODEL = "twinkle://qwen3-0.6b-shape"
TENANTS, ROWS, SEQ = 4, 2, 128


def sliced(config, layers: int):
    """The config with only its first `layers` decoder layers."""
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    return config


def load(layers: int | None):
    """The model id the engine loads itself, or the loaded model cut to its first `layers` layers
    (held in the dtype the engine would choose for the whole model)."""
    if not layers:
        return MODEL
    path = resolve_model_path(MODEL)
    config = sliced(AutoConfig.from_pretrained(path), layers)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype="auto")
    n_params = sum(p.numel() for p in model.parameters())
    base_dtype.cast_parameters(model, base_dtype.resolve("auto", None, "cpu", n_params))
    return model


def engine_on(model, ranks: dict[str, int]) -> MultiLoraModel:
    if isinstance(model, str):
        return make_engine(model, ranks)
    engine = MultiLoraModel(model=model)
    for tenant, rank in ranks.items():
        engine.add_adapter_to_model(tenant, lora(rank))
        engine.set_optimizer("AdamW", adapter_name=tenant, lr=LR)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(resolve_model_path(MODEL))
    if args.layers:
        config = sliced(config, args.layers)
    with torch.device("meta"):  # the structure only
        structure = describe(AutoModelForCausalLM.from_config(config))
    LINEARS[:], EXPERTS[:] = structure.all_linear(), []
    ranks = tenants(TENANTS)
    engine = engine_on(load(args.layers), ranks)
    batches = make_batches(ranks, ROWS, SEQ, engine.base.config.vocab_size)
    single_engine = engine_on(load(args.layers), {"all": 16})
    all_rows = [row for batch in batches.values() for row in batch]
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
                "layers": engine.base.config.num_hidden_layers,
                "load_avg": os.getloadavg()[0],
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                **result,
            }
        )
    )


if __name__ == "__main__":
    main()
