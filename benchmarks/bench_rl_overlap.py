"""Synchronous vs overlapped (off-policy, staleness 1) GRPO steps/s on the demo preset.

    uv run benchmarks/bench_rl_overlap.py [--steps 8]

Both modes run the same GRPO step (sample 8 prompts x 8 completions with the current LoRA, score,
GRPO advantage, forward_backward, clip_grad_and_step, sync the LoRA to the sampler) on the
warm-started demo model, one after the other, after one untimed warm-up step each. Reports steps/s
and each phase's share of the wall time (in the overlapped mode sampling runs beside training, so
shares can sum past 100%). Final line: JSON with a top-level `speedup` (overlapped / synchronous).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
from peft import LoraConfig

from twinkle.advantage import GRPOAdvantage
from twinkle.checkpoint_engine import InProcessCheckpointEngine
from twinkle.hub import DEFAULT_MODEL
from twinkle.model import TransformersModel
from twinkle.reward import ArithmeticAccuracy
from twinkle.rl.demo import arithmetic_prompts, warm_start
from twinkle.rl.producer import RolloutProducer
from twinkle.rl.rollout import sample_rollout
from twinkle.rl.timing import PhaseTimer
from twinkle.sampler import SamplingParams, TorchSampler

ADAPTER = "policy"
PHASES = ("sample", "score", "train", "sync")


def run(base: str, overlap: bool, steps: int, prompts: int, group: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = TransformersModel(model_id=base)
    model.add_adapter_to_model(ADAPTER, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-3, adapter_name=ADAPTER)
    model.set_loss("GRPOLoss", adapter_name=ADAPTER)
    sampler = TorchSampler(model_id=base)
    engine = InProcessCheckpointEngine()
    engine.sync(model, sampler, ADAPTER)
    reward, advantage = ArithmeticAccuracy(), GRPOAdvantage()
    params = SamplingParams(max_tokens=6, temperature=1.0, num_samples=group, seed=seed)
    pool, rng = arithmetic_prompts("train"), random.Random(seed)

    def rollout_for(rows):
        return sample_rollout(sampler, rows, params, adapter_name=ADAPTER)

    timer = PhaseTimer()
    batches = [rng.sample(pool, prompts) for _ in range(steps + 3)]  # the producer samples ahead
    producer = RolloutProducer(lambda i: rollout_for(batches[i]), engine, sampler, ADAPTER) if overlap else None
    if producer:
        producer.publish(model)
    rewards_seen, staleness = [], []
    t0 = None
    for step in range(steps + 1):  # step 0 warms up and is not timed
        if step == 1:
            timer, t0 = PhaseTimer(), time.perf_counter()
        if producer:
            rollout = producer.get()  # sampled (staleness 1) while the last step trained
            staleness.append(rollout.meta["staleness"])
        else:
            with timer.phase("sample"):
                rollout = rollout_for(rng.sample(pool, prompts))
        with timer.phase("score"):
            result = reward(rollout.texts, rollout.reward_rows())
            rows = rollout.training_rows(advantage(result, group_size=group).tolist())
        with timer.phase("train"):
            model.forward_backward(inputs=rows, adapter_name=ADAPTER)
            model.clip_grad_and_step(adapter_name=ADAPTER)
        with timer.phase("sync"):
            if producer:
                producer.publish(model)
            else:
                engine.sync(model, sampler, ADAPTER)
        if producer:
            timer.add("sample", producer.step_metrics()["time/sampler_busy"])
        timer.step_metrics()
        rewards_seen.append(sum(result.values) / len(result))
    wall = time.perf_counter() - t0
    if producer:
        producer.close()
    totals = timer.summary()
    return {
        "steps": steps,
        "wall_s": round(wall, 3),
        "steps_per_s": steps / wall,
        "phase_s": {k: round(totals.get(f"time/{k}", 0.0), 3) for k in PHASES},
        "phase_share": {k: round(totals.get(f"time/{k}", 0.0) / wall, 3) for k in PHASES},
        "mean_reward": sum(rewards_seen[1:]) / steps,
        "staleness": max(staleness, default=0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--warm-start-steps", type=int, default=200)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 is faster on an oversubscribed machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    base = warm_start(args.model, steps=args.warm_start_steps) if args.warm_start_steps else args.model
    sync = run(base, False, args.steps, args.prompts, args.group, args.seed)
    print(f"synchronous: {sync['steps_per_s']:.3f} steps/s, shares {sync['phase_share']}", flush=True)
    over = run(base, True, args.steps, args.prompts, args.group, args.seed)
    print(
        f"overlapped:  {over['steps_per_s']:.3f} steps/s, shares {over['phase_share']} "
        f"(max staleness {over['staleness']})",
        flush=True,
    )
    print(
        json.dumps(
            {
                "benchmark": "rl_overlap",
                "model": args.model,
                "torch_threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count(),
                "samples_per_step": args.prompts * args.group,
                "speedup": over["steps_per_s"] / sync["steps_per_s"],
                "synchronous": sync,
                "overlapped": over,
            }
        )
    )


if __name__ == "__main__":
    main()
