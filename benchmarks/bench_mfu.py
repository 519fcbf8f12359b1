"""MFU of a LoRA training step on twinkle://qwen3-small (~51M parameters) against the measured peak.

TransformersModel, LoRA r16 on all linear layers, AdamW, clip 1.0, batch 8 x 256 tokens, fp32 on
the CPU. MFU = the FLOPs the step needs (twinkle.metric.step_flops: forward, activation gradients,
LoRA weight gradients, attention) / median step time / the machine's matmul peak measured in the
same process (twinkle.metric.measure_matmul_peak: best of large square fp32 matmuls, as
bench_model_sft_step). Goal: >= 30%. A profiled step afterwards splits the time by operator kind,
so a shortfall says where the time goes. Final line: JSON with `ratio` = MFU.

Where the time goes: the JSON's `time_share` splits one profiled step's operator time into GEMMs
(the base projections and LoRA factors), attention (SDPA's CPU kernel), elementwise work (RMSNorm,
SiLU, rotary, residual adds, forward and backward), softmax/loss and the optimizer. One run here
(2-core machine at load 12, 1 thread, so the absolute figures are not the machine's): GEMMs 79%,
attention 12%, elementwise 9%, optimizer and clipping <1%, MFU 0.16 of a peak that was itself
measured under that load. The model FLOPs are all GEMM and attention FLOPs, so the ceiling on a
quiet machine is about 0.79 x the GEMMs' own efficiency at these shapes ([2048, 512] x [512, 1536]
and the thin rank-16 LoRA products, which move a full activation for few FLOPs).

    uv run python benchmarks/bench_mfu.py [--steps 6] [--warmup 2] [--threads 2]
    uv run python benchmarks/bench_mfu.py --precision bf16 [--compile]

`--precision bf16` trains under bf16 autocast (fp32 master weights: `mixed_precision="bf16"`) and
takes MFU against the bf16 matmul peak measured the same way (on an AMX CPU ~6.7x the fp32 one);
`--compile` compiles the decoder layers (`compile=True`; its compiling runs in the warmup steps).
"""

import argparse
import json
import os
import random
import statistics
import time

import torch
from peft import LoraConfig

from twinkle.hub import resolve_model_path
from twinkle.metric import attention_dims, matmul_params, measure_matmul_peak, step_flops
from twinkle.model import TransformersModel

MODEL = "twinkle://qwen3-small"
BATCH, SEQ = 8, 256

KINDS = {  # operator name fragments -> what they are, for the time split
    "mm": "gemm",
    "addmm": "gemm",
    "bmm": "gemm",
    "linear": "gemm",
    "scaled_dot_product": "attention",
    "softmax": "softmax/loss",
    "nll_loss": "softmax/loss",
    "cross_entropy": "softmax/loss",
    "_foreach": "optimizer",
    "norm": "norm/clip",
}


def kind_of(name: str) -> str:
    for fragment, kind in KINDS.items():
        if fragment in name:
            return kind
    return "elementwise/other"


def time_share(model: TransformersModel, rows) -> dict[str, float]:
    """Self CPU time of one profiled step, by operator kind (fractions)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.forward_backward(inputs=rows)
        model.clip_grad_and_step(max_grad_norm=1.0)
    shares: dict[str, float] = {}
    for event in prof.key_averages():
        # with --compile, inductor's fused kernels run inside its graph calls (their self time), not as aten ops
        kind = "inductor fused" if event.key.startswith("## Call CompiledFxGraph") else None
        if event.key.startswith("aten::"):
            kind = kind_of(event.key)
        if kind:
            shares[kind] = shares.get(kind, 0.0) + event.self_cpu_time_total
    total = sum(shares.values()) or 1.0
    return {k: round(v / total, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    resolve_model_path(MODEL)  # built here on first use (~30 s), not inside a timed step

    torch.manual_seed(0)
    model = TransformersModel(model_id=MODEL, mixed_precision=args.precision, compile=args.compile)
    model.add_adapter_to_model("default", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-4)
    rng = random.Random(0)
    rows = [{"input_ids": [rng.randrange(1, model.vocab_size) for _ in range(SEQ)]} for _ in range(BATCH)]

    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        model.forward_backward(inputs=rows)
        model.clip_grad_and_step(max_grad_norm=1.0)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = measure_matmul_peak("cpu", torch.bfloat16 if args.precision == "bf16" else torch.float32)
    hf_model = model.hf_model
    n_matmul, n_trainable = matmul_params(hf_model)
    layers, q_width = attention_dims(hf_model.config)
    flops = step_flops(BATCH * SEQ, SEQ, n_matmul, n_trainable, layers, q_width)
    median = statistics.median(times)
    mfu = flops / median / peak
    print(
        json.dumps(
            {
                "benchmark": "mfu_lora_step",
                "model": MODEL,
                "batch": BATCH,
                "seq_len": SEQ,
                "threads": args.threads,
                "precision": args.precision,
                "compile": args.compile,
                "load_avg": os.getloadavg()[0],
                "params": sum(p.numel() for p in hf_model.parameters()),
                "peak_gflops": round(peak / 1e9, 2),
                "step_gflops": round(flops / 1e9, 2),
                "step_s": round(median, 4),
                "step_s_all": [round(t, 4) for t in times],
                "achieved_gflops": round(flops / median / 1e9, 2),
                "time_share": time_share(model, rows),
                "goal": 0.30,
                "ratio": round(mfu, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
