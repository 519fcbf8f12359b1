"""LoRA SFT at the published Qwen3 shapes on a GPU (issue 47): `twinkle://qwen3-{0.6b,1.7b,8b}-shape`
(random weights at the published shapes, the 151,936-token vocabulary: they measure speed and memory,
not quality), Twinkle's TransformersModel against a hand-written transformers + peft loop, bf16 base,
sdpa attention, LoRA r16 on every attention and MLP projection (fp32 factors), AdamW, clipping at 1.0,
activation checkpointing on both sides.
- Twinkle: `TransformersModel(device=..., base_dtype="bf16")`, the `GradientCheckpointing` patch, its
  chunked log-prob head.
- The hand loop: `from_pretrained(dtype=bfloat16, attn_implementation="sdpa")`, peft, `train()`,
  `gradient_checkpointing_enable`, transformers' own loss on full logits.
Each (shape, side) runs in a process of its own: the peak memory (`torch.cuda.max_memory_allocated`)
is that run's alone. One warm-up step, then `--steps` timed ones (median). MFU = the step's model
FLOPs (twinkle.metric.step_flops: forward, activation and LoRA gradients, attention; the recompute of
checkpointing not counted) / step time / the device's bf16 matmul peak measured in the same process.

Not one of the runner's `bench_*` (its machines have no GPU): `nox -s gpu` runs it after the GPU tests.
Without a CUDA device it says so and exits 0; `--device cpu
--shapes 0.6b --rows 1 --tokens 64 --steps 1` runs the same code on the CPU, slowly, to check it.

    uv run python benchmarks/gpu_scale_sft.py [--shapes 0.6b,1.7b,8b] [--rows 4] [--tokens 2048]

Final line: JSON with `ratio` = the smallest Twinkle / hand-loop tokens/s over the shapes, and per
shape each side's tokens/s, MFU, peak memory and first loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-4


def _rows(n_rows: int, n_tokens: int, vocab: int) -> list[list[int]]:
    return [[3 + (i * 7919 + r * 104729) % (vocab - 3) for i in range(n_tokens)] for r in range(n_rows)]


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)


def _twinkle(model_id: str, device: str, rows):
    from twinkle.model import TransformersModel

    model = TransformersModel(model_id, device=device, base_dtype="bf16")
    model.add_adapter_to_model("sft", _lora())
    model.set_optimizer("AdamW", lr=LR)
    model.apply_patch("GradientCheckpointing")
    batch = [{"input_ids": ids, "labels": ids} for ids in rows]

    def step() -> float:
        loss = model.forward_backward(batch)["loss"]
        model.clip_grad_and_step(1.0)
        return float(loss)

    return model.hf_model, step


def _hand(model_id: str, device: str, rows):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model_path

    base = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(model_id), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).to(device)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    model = get_peft_model(base, _lora())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    ids = torch.tensor(rows, device=device)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return base, step


def worker(side: str, shape: str, device: str, n_rows: int, n_tokens: int, steps: int) -> None:
    """One side at one shape in this process; prints one JSON line."""
    import torch

    from twinkle.hub import resolve_model_path
    from twinkle.metric import attention_dims, matmul_params, measure_matmul_peak, step_flops

    model_id = f"twinkle://qwen3-{shape}-shape"
    resolve_model_path(model_id)  # built on first use, outside the timed steps
    cuda = device.startswith("cuda")
    rows = _rows(n_rows, n_tokens, 151_936)
    hf_model, step = (_twinkle if side == "twinkle" else _hand)(model_id, device, rows)
    losses, times = [], []
    for i in range(steps + 1):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(step())  # float(loss): the step's work is done when it returns
        if i:
            times.append(time.perf_counter() - start)
    n_matmul, n_trainable = matmul_params(hf_model)
    layers, q_width = attention_dims(hf_model.config)
    flops = step_flops(n_rows * n_tokens, n_tokens, n_matmul, n_trainable, layers, q_width)
    peak = measure_matmul_peak(device, torch.bfloat16)
    median = statistics.median(times)
    out = {
        "side": side,
        "shape": shape,
        "tokens_per_s": round(n_rows * n_tokens / median, 1),
        "step_s": round(median, 4),
        "mfu": round(flops / median / peak, 4),
        "peak_tflops_bf16": round(peak / 1e12, 2),
        "first_loss": round(losses[0], 5),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="0.6b,1.7b,8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worker", nargs=2, metavar=("SIDE", "SHAPE"))
    args = p.parse_args()
    if args.worker:
        worker(*args.worker, args.device, args.rows, args.tokens, args.steps)
        return
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_scale_sft: no CUDA device here, nothing measured (run it where a GPU is: nox -s gpu)")
        return
    results: dict[str, dict] = {}
    for shape in args.shapes.split(","):
        for side in ("twinkle", "hand"):
            cmd = [sys.executable, __file__, "--worker", side, shape, "--device", args.device]
            cmd += ["--rows", str(args.rows), "--tokens", str(args.tokens), "--steps", str(args.steps)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:  # out of memory at 8B on a small card is an answer, not a crash
                results.setdefault(shape, {})[side] = {"error": done.stderr.strip().splitlines()[-1:]}
                continue
            results.setdefault(shape, {})[side] = json.loads(done.stdout.strip().splitlines()[-1])
            print(done.stdout.strip().splitlines()[-1], flush=True)
    ratios = {
        shape: round(r["twinkle"]["tokens_per_s"] / r["hand"]["tokens_per_s"], 3)
        for shape, r in results.items()
        if "tokens_per_s" in r.get("twinkle", {}) and "tokens_per_s" in r.get("hand", {})
    }
    summary = {"benchmark": "gpu_scale_sft", "device": args.device, "rows": args.rows, "tokens": args.tokens}
    print(json.dumps({**summary, "ratio": min(ratios.values(), default=None), "ratios": ratios, "shapes": results}))


if __name__ == "__main__":
    main()
