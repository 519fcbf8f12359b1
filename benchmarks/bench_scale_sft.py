"""LoRA SFT at the Qwen3-0.6B shape (`twinkle://qwen3-0.6b-shape`: 596M parameters, the 151,936-token
vocabulary; random weights, which measure speed and memory, not quality): TransformersModel against a
hand-written transformers + peft loop and against TRL's `SFTTrainer`, 4 rows x 512 tokens a step.

Every side as a competent CPU user runs it: the frozen base in bf16 where bf16 is fast (Twinkle:
`base_dtype='auto'`, which picks it on CUDA and on AVX-512 BF16 / AMX CPUs; the hand loop and TRL:
`dtype=torch.bfloat16` under the same test, fp32 otherwise), LoRA r16 on every attention and MLP
projection with fp32 factors (peft's), activation checkpointing on, AdamW at lr 1e-4, clipping at 1.0.
- Twinkle: the `GradientCheckpointing` patch; its default chunked head computes the loss.
- The hand loop: `gradient_checkpointing_enable` (non-reentrant), `model.train()`, transformers' own
  loss on full logits.
- TRL 1.16 (its own venv, benchmarks/_peer.py): `SFTTrainer(model=path, peft_config=...)` with the
  model loaded in that dtype (`model_init_kwargs`), its defaults otherwise: `bf16=True` (CPU autocast)
  and gradient checkpointing on, its chunked log-prob head with entropy and token accuracy; fp32
  without fast bf16 (`bf16=False`). The rows go in pre-tokenized, in order; the trainer's own loop
  (dataloader, collator, loss, clipping, optimizer, scheduler) is what is timed.
Each side runs in a process of its own (peak RSS, `ru_maxrss`, is that run's alone), one warm-up step
then `--steps` timed ones (the fastest is kept: this machine is shared), the sides alternating over
`--rounds` (the order reversed every other round). Wall time is what the goal counts; the CPU seconds of
a step (user + system, all threads) are reported beside it because other engineers' load stretches
wall time far more than CPU time.

    uv run python benchmarks/bench_scale_sft.py [--steps 1] [--rounds 2] [--rows 4] [--tokens 512]

Final line: JSON with `ratio` = Twinkle tokens/s / TRL tokens/s (goal >= 1.3), `peak_rss_vs_trl` and
`peak_rss_vs_hand` (Twinkle's peak RSS over theirs; goal <= 0.6 each), the CPU-time ratio, raw steps,
peaks and the first-step losses (equal weights and rows: they agree to bf16 precision).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

MODEL = "twinkle://qwen3-0.6b-shape"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIDES = ("twinkle", "hand", "trl")
LR = 1e-4


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)


def _rows(n_rows: int, n_tokens: int, vocab: int) -> list[list[int]]:
    return [[3 + (i * 7919 + r * 104729) % (vocab - 3) for i in range(n_tokens)] for r in range(n_rows)]


class _Clock:
    """Wall and CPU seconds (user + system, every thread) of each step."""

    def __init__(self):
        self.wall, self.cpu = [], []
        self.start()

    @staticmethod
    def _cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def start(self) -> None:
        self._t, self._c = time.perf_counter(), self._cpu()

    def lap(self) -> None:
        self.wall.append(time.perf_counter() - self._t)
        self.cpu.append(self._cpu() - self._c)
        self.start()


def _twinkle(path, rows, steps: int, dtype: str):
    from twinkle.model import TransformersModel

    model = TransformersModel(MODEL)
    model.add_adapter_to_model("sft", _lora())
    model.set_optimizer("AdamW", lr=LR)
    model.apply_patch("GradientCheckpointing")
    batch = [{"input_ids": ids, "labels": ids} for ids in rows]
    clock, losses = _Clock(), []
    for _ in range(steps + 1):
        losses.append(model.forward_backward(batch)["loss"])
        model.clip_grad_and_step(1.0)
        clock.lap()
    return clock, losses, model.get_info()["base_dtype"]


def _hand(path, rows, steps: int, dtype: str):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, _lora())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    ids = torch.tensor(rows)
    clock, losses = _Clock(), []
    for _ in range(steps + 1):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        clock.lap()
    return clock, losses, dtype


def _trl(path, rows, steps: int, dtype: str):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class Laps(TrainerCallback):
        def __init__(self):
            self.clock, self.losses = None, []

        def on_train_begin(self, args, state, control, **kwargs):
            self.clock = _Clock()  # the trainer's setup before the first step is not a step

        def on_step_end(self, args, state, control, **kwargs):
            self.clock.lap()

    class LossKeeping(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            laps.losses.append(float((loss[0] if return_outputs else loss).detach()))
            return loss

    bf16 = dtype == "bfloat16"
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-scale-trl-"),
        model_init_kwargs={"dtype": dtype},
        use_cpu=True,
        bf16=bf16,
        activation_checkpointing=True,  # TRL's default (its `gradient_checkpointing=True`), said outright
        per_device_train_batch_size=len(rows),
        max_steps=steps + 1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        train_sampling_strategy="sequential",
        logging_steps=10**9,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    dataset = Dataset.from_list([{"input_ids": ids} for _ in range(steps + 1) for ids in rows])
    laps = Laps()
    trainer = LossKeeping(model=path, args=args, train_dataset=dataset, peft_config=_lora(), callbacks=[laps])
    trainer.train()
    return laps.clock, laps.losses, "bf16" if bf16 else "fp32"


def worker(side: str, path: str, dtype: str, n_rows: int, n_tokens: int, steps: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    rows = _rows(n_rows, n_tokens, 151_643)
    clock, losses, ran_as = {"twinkle": _twinkle, "hand": _hand, "trl": _trl}[side](path, rows, steps, dtype)
    best = min(range(1, len(clock.wall)), key=clock.wall.__getitem__) if len(clock.wall) > 1 else 0
    print(
        json.dumps(
            {
                "step_s": clock.wall[best],
                "step_cpu_s": min(clock.cpu[1:] or clock.cpu),
                "tokens_per_s": n_rows * n_tokens / clock.wall[best],
                "first_loss": losses[0],
                "losses": losses,
                "wall_s": clock.wall,
                "cpu_s": clock.cpu,
                "dtype": ran_as,
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            }
        )
    )


def _command(side: str, args, path: str, dtype: str) -> list[str]:
    python = sys.executable
    if side == "trl":
        from _peer import peer_python
        from bench_peer_trl_sft import TRL

        python = str(peer_python("trl", TRL))  # the venv bench_peer_trl_sft builds, reused
    flags = ["--steps", str(args.steps), "--rows", str(args.rows), "--tokens", str(args.tokens)]
    return [python, __file__, "--worker", side, "--path", path, "--dtype", dtype, *flags]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1, help="timed steps per run, after one warm-up step")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--worker", choices=SIDES)
    p.add_argument("--path")
    p.add_argument("--dtype", choices=["bfloat16", "float32"])
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.path, args.dtype, args.rows, args.tokens, args.steps)
        return
    from twinkle.hub import resolve_model_path
    from twinkle.model.base_dtype import fast_bf16

    path = str(resolve_model_path(MODEL))  # built (once) before anything is timed
    dtype = "bfloat16" if fast_bf16("cpu") else "float32"
    sides = args.sides.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            out = subprocess.run(_command(side, args, path, dtype), capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(side, json.dumps(runs[side][-1]), flush=True)
    best = {s: max(v, key=lambda x: x["tokens_per_s"]) for s, v in runs.items()}
    cpu = {s: min(x["step_cpu_s"] for x in v) for s, v in runs.items()}
    peak = {s: max(x["peak_rss_gib"] for x in v) for s, v in runs.items()}
    result: dict = {}
    if "trl" in runs and "twinkle" in runs:
        result["ratio"] = best["twinkle"]["tokens_per_s"] / best["trl"]["tokens_per_s"]
        result["peak_rss_vs_trl"] = peak["twinkle"] / peak["trl"]
    if "hand" in runs and "twinkle" in runs:
        result.setdefault("ratio", best["twinkle"]["tokens_per_s"] / best["hand"]["tokens_per_s"])
        result["peak_rss_vs_hand"] = peak["twinkle"] / peak["hand"]
        result["ratio_vs_hand"] = best["twinkle"]["tokens_per_s"] / best["hand"]["tokens_per_s"]
    if "trl" in runs and "twinkle" in runs:
        result["cpu_ratio_vs_trl"] = cpu["trl"] / cpu["twinkle"]
    result.update({"rows": args.rows, "tokens": args.tokens, "dtype": dtype})
    for s in sides:
        result[f"{s}_peak_rss_gib"] = [round(x["peak_rss_gib"], 3) for x in runs[s]]
        result[f"{s}_step_s"] = best[s]["step_s"]
        result[f"{s}_step_cpu_s"] = cpu[s]
        result[f"{s}_first_loss"] = best[s]["first_loss"]
    result["load_avg"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
