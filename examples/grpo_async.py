"""Asynchronous GRPO with bounded staleness: examples/grpo.py's task, sampled while the trainer trains.

    uv run examples/grpo_async.py                          # ~2 min of RL on 2 quiet CPU cores
    uv run examples/grpo_async.py --mode ray               # trainer and sampler on DeviceGroups of their own

The loop is yours; a `RolloutProducer` (twinkle.rl.producer) samples batch k+1.. in the background
while step k trains, into a bounded queue, never more than `--max-staleness` policy versions behind
(it waits rather than drop a batch; 0 is the synchronous loop). Weights go to the sampler through
the CheckpointEngine: in this process (`--mode local`), or as a PEFT folder from the `model`
DeviceGroup to the `sampler` one (`--mode ray`). GRPOLoss's ratio π_θ/q against each token's
behaviour log-prob q (the rollout's `logprobs`) corrects for the staleness. Each step prints the
staleness (mean/max over the batch's samples), the queue depth, and how busy sampler and trainer were.

With `--checkpoint-dir` every `--checkpoint-every` steps writes an RL checkpoint (twinkle.rl.checkpoint):
adapter, optimizer, RNG, policy version, the queued batches; `--resume` goes on from the newest one.
Prompts and sampling seeds are drawn per batch from (seed, batch index), so at `--max-staleness 0`
a resumed run ends with the adapter bit for bit as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from peft import LoraConfig

from twinkle.advantage import GRPOAdvantage
from twinkle.hub import DEFAULT_MODEL
from twinkle.rl.checkpoint import RLState, batch_rng, latest_rl_checkpoint, load_rl_checkpoint, save_rl_checkpoint
from twinkle.rl.demo import DIGITS, TASKS, arithmetic_prompts, greedy_scores, task_reward, warm_start
from twinkle.rl.metrics import reward_metrics
from twinkle.rl.plot import save_curves
from twinkle.rl.producer import RolloutProducer
from twinkle.rl.rollout import Rollout, sample_rollout
from twinkle.sampler import SamplingParams
from twinkle.template import Template

ADAPTER = "policy"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="base model id (warm-started on the task first)")
    p.add_argument(
        "--task", default="larger", choices=[*TASKS, DIGITS], help="as examples/grpo.py; digits: 64-token answers"
    )
    p.add_argument("--warm-start-steps", type=int, default=20, help="SFT steps before RL (0: start from --model)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=3)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--entropy-coef", type=float, default=0.01, help="entropy bonus (keeps groups disagreeing)")
    p.add_argument("--max-staleness", type=int, default=1, help="policy versions a batch may lag (0: synchronous)")
    p.add_argument("--queue-size", type=int, default=None, help="finished batches held (default: max-staleness)")
    p.add_argument("--mode", default="local", choices=["local", "ray"], help="ray: model and sampler DeviceGroups")
    p.add_argument("--eval-prompts", type=int, default=200, help="held-out test prompts (at most the split)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--checkpoint-dir", default=None, help="write RL checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="go on from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--save", default=None, help="write the final adapter (a PEFT folder) here")
    p.add_argument("--plot", default="out/grpo-async-curve.png")
    return p.parse_args(argv)


def build(args, base: str):
    """(model, sampler, engine): in this process, or the model and the sampler on DeviceGroups of their own."""
    from twinkle.checkpoint_engine import FolderCheckpointEngine, InProcessCheckpointEngine
    from twinkle.mesh import DeviceGroup, initialize
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler

    if args.mode == "ray":
        cpus = {"CPU": args.threads}
        groups = [DeviceGroup("model", 1, resources_per_rank=cpus), DeviceGroup("sampler", 1, resources_per_rank=cpus)]
        initialize(mode="ray", groups=groups, seed=args.seed)
        engine = FolderCheckpointEngine(Path(args.checkpoint_dir or "out/grpo-async") / "weights")
    else:
        initialize(mode="local", seed=args.seed)
        engine = InProcessCheckpointEngine()
    model = TransformersModel(model_id=base, remote_group="model")
    sampler = TorchSampler(model_id=base, remote_group="sampler")
    return model, sampler, engine


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    base = warm_start(args.model, steps=args.warm_start_steps, task=args.task) if args.warm_start_steps else args.model
    model, sampler, engine = build(args, base)
    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear", lora_dropout=0.0)
    model.add_adapter_to_model(ADAPTER, lora)
    model.set_optimizer("AdamW", lr=args.lr, adapter_name=ADAPTER)
    model.set_loss("GRPOLoss", adapter_name=ADAPTER, entropy_coef=args.entropy_coef)
    reward, advantage = task_reward(args.task), GRPOAdvantage(scale_by="group")

    # Prompts encoded here, so a sampler in another process needs no template.
    template = Template(model_id=base)
    train = [template.encode_prompt(r) for r in arithmetic_prompts("train", task=args.task)]
    held_out = [template.encode_prompt(r) for r in arithmetic_prompts("test", args.eval_prompts, args.task)]

    def sample_batch(index: int) -> Rollout:
        rng = batch_rng(args.seed, index)  # batch `index`'s prompts and seed: the same in a resumed run
        params = SamplingParams(max_tokens=args.max_tokens, num_samples=args.group, seed=rng.randrange(2**31))
        return sample_rollout(sampler, rng.sample(train, args.prompts), params, adapter_name=ADAPTER)

    state, queued = RLState(extra={"curve": []}), []
    resume_from = latest_rl_checkpoint(args.checkpoint_dir) if args.resume and args.checkpoint_dir else None
    if resume_from is not None:
        state = load_rl_checkpoint(resume_from, model, ADAPTER, engine)
        advantage.load_state_dict(state.advantage)
        reward.load_state_dict(state.reward)
        queued = [Rollout.from_json(r) for r in state.producer["queued"]]
        print(f"resumed from {resume_from.name}: step {state.step}, policy version {state.policy_version}")
    producer = RolloutProducer(
        sample_batch,
        engine,
        sampler,
        ADAPTER,
        max_staleness=args.max_staleness,
        queue_size=args.queue_size,
        start_index=state.step,  # batch b is trained on at step b + 1
        queued=queued,
    )
    curve = state.extra["curve"]

    def evaluate(step: int) -> None:
        with producer.paused():  # the sampler serves the newest weights and samples nothing else meanwhile
            m = greedy_scores(sampler, held_out, reward, ADAPTER, max_tokens=args.max_tokens)
        curve.append([step, m["reward/accuracy/mean"]])
        print(f"step {step}: held-out accuracy {curve[-1][1]:.3f}", flush=True)

    producer.publish(model)
    if resume_from is None:
        evaluate(0)
    history = []
    for step in range(state.step + 1, args.steps + 1):
        rollout = producer.get()  # sampled while earlier steps trained
        rewards = reward(rollout.texts, rollout.reward_rows())
        adv = advantage(rewards, group_size=rollout.group_size)
        rows = rollout.training_rows(adv.tolist(), skip_zero=args.entropy_coef == 0)
        stats = model.forward_backward(inputs=rows, adapter_name=ADAPTER) if rows else {}
        if rows:
            model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=ADAPTER)
        version = producer.publish(model)  # the sampler applies it before its next batch
        metrics = {"step": step, **reward_metrics(rewards), **producer.step_metrics()}
        metrics.update(loss=stats.get("loss"), clip_fraction=stats.get("clip_fraction"))  # clipped: r far from 1
        metrics["sampled_tokens"] = sum(len(s.tokens) for s in rollout.sequences)
        history.append(metrics)
        print(
            f"step {step}: reward {metrics['reward/mean']:.3f} loss {metrics['loss'] or 0:.4f} "
            f"clip {metrics['clip_fraction'] or 0:.3f} "
            f"staleness {metrics['async/staleness_mean']:.2f}/{metrics['async/staleness_max']:.0f} "
            f"queue {metrics['async/queue_depth']:.0f} busy sampler {metrics['share/sampler_busy']:.0%} "
            f"trainer {metrics['share/trainer_busy']:.0%} tokens {metrics['sampled_tokens']} [{metrics['time/step']:.2f}s]",
            flush=True,
        )
        if args.checkpoint_dir and step % args.checkpoint_every == 0:
            state = RLState(
                step, version, producer.state(), advantage.state_dict(), reward.state_dict(), {"curve": curve}
            )
            save_rl_checkpoint(args.checkpoint_dir, model, ADAPTER, state)
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step)
    rl_seconds = sum(h["time/step"] for h in history)  # evaluation left out
    producer.close()
    if args.save:
        model.save(args.save, adapter_name=ADAPTER)

    print("held-out accuracy curve: " + "  ".join(f"{s}:{a:.3f}" for s, a in curve))
    staleness = [h["async/staleness_mean"] for h in history]
    busy = sum(h["time/sampler_busy"] for h in history)
    save_curves(
        args.plot,
        {
            "held-out accuracy (greedy)": ([s for s, _ in curve], [a for _, a in curve]),
            "staleness (mean, versions)": ([h["step"] for h in history], staleness),
        },
        title=f"async GRPO on '{args.task}', max staleness {args.max_staleness} ({args.mode})",
    )
    summary = {
        "example": "grpo_async",
        "task": args.task,
        "mode": args.mode,
        "max_staleness": args.max_staleness,
        "steps": args.steps,
        "accuracy_start": curve[0][1],
        "accuracy_end": curve[-1][1],
        "curve": curve,
        "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
        "staleness_max": max((h["async/staleness_max"] for h in history), default=None),
        "sampler_busy_share": busy / rl_seconds if history else None,
        "trainer_busy_share": sum(h["time/trainer_busy"] for h in history) / rl_seconds if history else None,
        "rl_seconds": round(rl_seconds, 2),
        "sampled_tokens_per_s": sum(h["sampled_tokens"] for h in history) / max(busy, 1e-9),
        "minutes": round((time.perf_counter() - t_start) / 60, 2),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
