"""LoRA SFT at the Qwen3-0.6B shape (`twinkle://qwen3-0.6b-shape`: 596M parameters, the 151,936-token
vocabulary; random weights, which measure speed and memory, not quality): TransformersModel against a
hand-written transformers + peft loop, 4 rows x 512 tokens a step.

Both sides as a competent CPU user runs them: the frozen base in bf16 where bf16 is fast (Twinkle:
`base_dtype='auto'`, which picks it on CUDA and on AVX-512 BF16 / AMX CPUs; the hand loop: `dtype=
torch.bfloat16` under the same test, fp32 otherwise), LoRA r16 on every attention and MLP projection
with fp32 factors (peft's), activation checkpointing on (Twinkle: the `GradientCheckpointing` patch;
the hand loop: `gradient_checkpointing_enable`, non-reentrant, `model.train()`), AdamW, clipping at
1.0. Twinkle computes its loss through its default chunked head; the hand loop through transformers'
own loss on full logits. Each side runs in a process of its own (peak RSS is that run's alone), one
warm-up step then `--steps` timed ones (the faster is kept: this machine is shared), sides
alternating over `--rounds`.

    uv run python benchmarks/bench_scale_sft.py [--steps 3] [--rounds 1] [--rows 4] [--tokens 512]

Final line: JSON with `ratio` = Twinkle tokens/s / hand-loop tokens/s, `peak_rss_ratio` (Twinkle /
hand loop; the issue's goal is <= 0.6) and the raw numbers, the first-step losses of both (equal
weights and rows: they should agree to bf16 precision).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MODEL = "twinkle://qwen3-0.6b-shape"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)


def _rows(n_rows: int, n_tokens: int, vocab: int) -> list[list[int]]:
    return [[3 + (i * 7919 + r * 104729) % (vocab - 3) for i in range(n_tokens)] for r in range(n_rows)]


def _twinkle(rows, steps: int) -> tuple[list[float], list[float], str]:
    from twinkle.model import TransformersModel

    model = TransformersModel(MODEL)
    model.add_adapter_to_model("sft", _lora())
    model.set_optimizer("AdamW", lr=1e-4)
    model.apply_patch("GradientCheckpointing")
    batch = [{"input_ids": ids, "labels": ids} for ids in rows]
    times, losses = [], []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        losses.append(model.forward_backward(batch)["loss"])
        model.clip_grad_and_step(1.0)
        times.append(time.perf_counter() - t0)
    return times, losses, model.get_info()["base_dtype"]


def _hand(rows, steps: int) -> tuple[list[float], list[float], str]:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model_path
    from twinkle.model.base_dtype import fast_bf16

    dtype = torch.bfloat16 if fast_bf16("cpu") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL), dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, _lora())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.tensor(rows)
    times, losses = [], []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    return times, losses, "bf16" if dtype == torch.bfloat16 else "fp32"


def worker(side: str, n_rows: int, n_tokens: int, steps: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    rows = _rows(n_rows, n_tokens, 151_643)
    times, losses, dtype = (_twinkle if side == "twinkle" else _hand)(rows, steps)
    step_s = min(times[1:]) if len(times) > 1 else times[0]
    print(
        json.dumps(
            {
                "step_s": step_s,
                "tokens_per_s": n_rows * n_tokens / step_s,
                "first_loss": losses[0],
                "losses": losses,
                "base_dtype": dtype,
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--worker", choices=["twinkle", "hand"])
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.rows, args.tokens, args.steps)
        return
    from twinkle.hub import resolve_model_path

    resolve_model_path(MODEL)  # built (once) before anything is timed
    runs: dict[str, list[dict]] = {"twinkle": [], "hand": []}
    for r in range(args.rounds):
        for side in ("twinkle", "hand") if r % 2 == 0 else ("hand", "twinkle"):
            cmd = [sys.executable, __file__, "--worker", side, "--steps", str(args.steps)]
            cmd += ["--rows", str(args.rows), "--tokens", str(args.tokens)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{side} failed:\n{out.stderr[-2000:]}")
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(side, runs[side][-1], flush=True)
    best = {s: max(v, key=lambda x: x["tokens_per_s"]) for s, v in runs.items()}
    peak = {s: max(x["peak_rss_gib"] for x in v) for s, v in runs.items()}
    print(
        json.dumps(
            {
                "ratio": best["twinkle"]["tokens_per_s"] / best["hand"]["tokens_per_s"],
                "peak_rss_ratio": peak["twinkle"] / peak["hand"],
                "rows": args.rows,
                "tokens": args.tokens,
                "twinkle_step_s": best["twinkle"]["step_s"],
                "hand_step_s": best["hand"]["step_s"],
                "twinkle_peak_rss_gib": peak["twinkle"],
                "hand_peak_rss_gib": peak["hand"],
                "twinkle_first_loss": best["twinkle"]["first_loss"],
                "hand_first_loss": best["hand"]["first_loss"],
                "base_dtype": best["twinkle"]["base_dtype"],
                "hand_dtype": best["hand"]["base_dtype"],
                "load_avg": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
