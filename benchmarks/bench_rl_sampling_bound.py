"""RL where sampling is most of a step: Twinkle's loop, synchronous and asynchronous, against TRL's `GRPOTrainer`.

The task is twinkle.rl.digits: add 1 to each digit of a 64-digit sequence, exact-match reward, so every
completion is 64 digit tokens plus the end token (the demo tokenizer splits digits one per token).
All sides start from one warm start (the demo model after a full-parameter SFT on the task's train
split, cached by twinkle.rl.demo.warm_start: 80 steps leave it exactly right on 6% of the held-out
prompts, mostly a digit short otherwise) and are stopped at a held-out greedy exact-match target,
checked every `--eval-every` steps on the same held-out rows. Twinkle's side is examples/grpo_async.py
run unmodified as a subprocess, at `--max-staleness 0` (synchronous: each batch sampled with the weights
that train on it) and `--max-staleness 1` (asynchronous: batch k+1 sampled while step k trains); TRL's
runs in its own venv through bench_peer_trl_grpo's machinery (benchmarks/_peer.py, _trl_grpo_worker.py).

Matched: prompts a step, groups of 8, 65 completion tokens at temperature 1, LoRA r32 / alpha 64 /
all-linear / no dropout, AdamW (weight decay 0.01, constant lr), clipping at 1.0, one optimizer step
per batch, clip range 0.2 / 0.28, no KL, entropy bonus 0.01, advantages normalised per group, every
sample trained on (zero-advantage groups kept on both sides), the loss a mean over the batch's
completion tokens (TRL's `dapo`), fp32, the same torch threads. Training time leaves held-out
evaluation out on every side.

Reported per side and seed: time and steps to the target, the share of each step spent sampling
(Twinkle: the sampler's busy time over the step's wall time, which in the asynchronous loop runs
beside training; TRL: its `_generate` over the step), and sampling tokens/s (completion tokens over
the sampling seconds).

    uv run python benchmarks/bench_rl_sampling_bound.py [--seeds 3] [--max-steps 60]

Final line: JSON with `ratio` = Twinkle asynchronous's / TRL's mean training seconds to the target
over the seeds where all three reached it (goal <= 0.5), `async_vs_sync` (goal <= 0.8), and the raw
numbers of every run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

from _peer import ROOT, peer_python
from bench_peer_trl_grpo import TRL, check_same_start, run_trl

WARM_START_STEPS = 80
STEP = re.compile(r"^step (\d+): reward .* busy sampler (\d+)% trainer \d+% tokens (\d+) \[([\d.]+)s\]")
HELD_OUT = re.compile(r"^step (\d+): held-out accuracy ([\d.]+)")


def run_twinkle(seed: int, args, max_staleness: int) -> dict:
    """examples/grpo_async.py as written, stopped at the first held-out accuracy >= target."""
    cmd = [sys.executable, str(ROOT / "examples" / "grpo_async.py"), "--task", "digits", "--seed", str(seed)]
    cmd += ["--warm-start-steps", str(WARM_START_STEPS), "--max-staleness", str(max_staleness)]
    cmd += ["--steps", str(args.max_steps), "--eval-every", str(args.eval_every), "--eval-prompts", str(args.held_out)]
    cmd += ["--prompts", str(args.prompts), "--group", str(args.group), "--max-tokens", str(args.max_tokens)]
    cmd += ["--lr", str(args.lr), "--threads", str(args.threads)]
    cmd += ["--plot", str(ROOT / "out" / "peer-bench" / f"digits-twinkle-s{max_staleness}-seed{seed}.png")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    seconds, sampling, tokens, curve, reached = [], [], [], [], None
    for line in proc.stdout:
        if m := STEP.match(line):
            seconds.append(float(m[4]))
            sampling.append(float(m[4]) * int(m[2]) / 100)
            tokens.append(int(m[3]))
        elif m := HELD_OUT.match(line):
            curve.append((int(m[1]), float(m[2])))
            print(f"Twinkle (staleness {max_staleness}) seed {seed} step {m[1]}: held-out acc {m[2]}", flush=True)
            if float(m[2]) >= args.target and int(m[1]) > 0:
                reached = int(m[1])
                proc.terminate()
                break
    proc.wait()
    return _summary(reached, seconds, sampling, tokens, curve)


def _summary(reached, seconds, sampling, tokens, curve) -> dict:
    n = reached or len(seconds)
    return {
        "steps_to_target": reached,
        "train_s_to_target": sum(seconds[:n]) if reached else None,
        "sample_share": sum(sampling[:n]) / max(sum(seconds[:n]), 1e-9),
        "sampling_tokens_per_s": sum(tokens[:n]) / max(sum(sampling[:n]), 1e-9),
        "step_seconds": [round(s, 3) for s in seconds[:n]],
        "curve": curve,
    }


def _trl_run(seed, args, python, model_path, train, held_out, settings) -> dict:
    """TRL's side through bench_peer_trl_grpo's runner, summarised as Twinkle's runs are."""
    out = run_trl(seed, args, python, model_path, train, held_out, settings, name="trl-digits")
    sampling, tokens = out.pop("generate_seconds"), out.pop("generated_tokens")
    steps = out.pop("step_seconds")
    return _summary(out["steps_to_target"], steps, sampling, tokens, out["curve"])


def _mean_to_target(runs: dict) -> tuple[int, dict]:
    """(seeds where every side reached the target, each side's mean training seconds to it over those)."""
    seeds = range(len(next(iter(runs.values()))))
    done = [i for i in seeds if all(side[i]["steps_to_target"] for side in runs.values())]
    return len(done), {
        name: statistics.mean(side[i]["train_s_to_target"] for i in done) if done else None
        for name, side in runs.items()
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    ap.add_argument("--max-steps", type=int, default=60, help="a side that has not reached the target by then stops")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.15, help="held-out exact-match accuracy (the start's: 0.06)")
    ap.add_argument("--held-out", type=int, default=128, help="held-out prompts (at most 256)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts a step")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=65, help="64 digits and the end token")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    from twinkle.hub import DEFAULT_MODEL
    from twinkle.rl.demo import DIGITS, arithmetic_prompts, warm_start

    python = peer_python("trl", TRL)
    model_path = warm_start(DEFAULT_MODEL, steps=WARM_START_STEPS, task=DIGITS)  # what grpo_async.py is told, cached
    train, held_out = arithmetic_prompts("train", task=DIGITS), arithmetic_prompts("test", args.held_out, DIGITS)
    settings = {"prompts": args.prompts, "group": args.group, "max_tokens": args.max_tokens, "lr": args.lr}
    settings.update(lora_rank=32, entropy_coef=0.01, reward_weights=[1.0, 0.0])  # exact match alone, as Twinkle's
    sides = {"sync": 0, "async": 1, "trl": None}
    runs = {side: [] for side in sides}
    for seed in range(args.seeds):
        for side in list(sides) if seed % 2 == 0 else list(sides)[::-1]:  # who goes first alternates
            if side == "trl":
                runs[side].append(_trl_run(seed, args, python, model_path, train, held_out, settings))
            else:
                runs[side].append(run_twinkle(seed, args, sides[side]))
            shown = {k: v for k, v in runs[side][-1].items() if k != "step_seconds"}
            print(f"seed {seed} {side}: {json.dumps(shown)}", flush=True)
        check_same_start(runs["sync"][-1], runs["trl"][-1], len(held_out))
    done, mean_s = _mean_to_target(runs)
    result = {
        "ratio": mean_s["async"] / mean_s["trl"] if done else None,
        "async_vs_sync": mean_s["async"] / mean_s["sync"] if done else None,
        **{f"{s}_train_s_to_target": mean_s[s] for s in sides},
        **{f"{s}_sample_share": statistics.mean(r["sample_share"] for r in runs[s]) for s in sides},
        **{f"{s}_sampling_tokens_per_s": statistics.mean(r["sampling_tokens_per_s"] for r in runs[s]) for s in sides},
        "seeds_all_reached": done,
        "target": args.target,
        "held_out_prompts": len(held_out),
        "settings": {**settings, "warm_start_steps": WARM_START_STEPS, "threads": args.threads},
        **{f"{s}_runs": runs[s] for s in sides},
        "peer": "trl==1.16.0",
        "load_avg": os.getloadavg()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
