"""On-policy distillation (GKD): a student LoRA learns from a stronger teacher on its own samples.

    uv run examples/gkd.py

Teacher: the demo model after a brief SFT on arithmetic (the cached warm start the GRPO and DPO
examples use); student: the untrained demo model plus a LoRA. Each step the student samples
answers with its current adapter (for a share 1 - `--on-policy` of the prompts, GKD's lambda, the
teacher answers instead: answers the student cannot yet reach by itself), the teacher scores every position
of those sequences (its top-k next-token log-probs), and the student minimises the generalised JSD
to the teacher there (`GKDLoss`):

    sample (student adapter) -> teacher top-k -> forward_backward -> clip_grad_and_step -> sync weights

Measures on held-out test prompts: the student's GKD loss to the teacher on fixed sequences (the
prompt and the teacher's greedy answer; the number to watch), the same on the student's own
greedy answers, and how often the student's greedy answer equals the teacher's. Prints the curve,
saves a PNG, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from twinkle.checkpoint_engine import InProcessCheckpointEngine
from twinkle.hub import DEFAULT_MODEL, resolve_model_path
from twinkle.metric.trackers import open_trackers
from twinkle.model import TransformersModel
from twinkle.reward import ArithmeticAccuracy
from twinkle.rl.demo import arithmetic_prompts, greedy_accuracy, warm_start
from twinkle.rl.plot import save_curves
from twinkle.rl.rollout import sample_rollout
from twinkle.rl.timing import PhaseTimer
from twinkle.sampler import SamplingParams, TorchSampler

ADAPTER = "student"


@torch.no_grad()
def teacher_topk(teacher, rows: list[dict], k: int) -> list[dict]:
    """Add `teacher_topk_ids` / `teacher_topk_logprobs` per token (aligned with labels: position t holds
    the teacher's distribution over the token at t, i.e. computed from the logits at t-1)."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    logp = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
    top = logp.topk(k, dim=-1)
    out = []
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        # logits at t-1 predict token t; position 0 has no prediction (its label is -100 anyway)
        top_ids = torch.cat([torch.zeros(1, k, dtype=torch.long), top.indices[i, : n - 1]])
        top_lps = torch.cat([torch.zeros(1, k), top.values[i, : n - 1]])
        out.append(
            {
                "input_ids": r["input_ids"],
                "labels": r["labels"],
                "teacher_topk_ids": top_ids.tolist(),
                "teacher_topk_logprobs": top_lps.tolist(),
            }
        )
    return out


def _fmt(metrics: dict) -> str:
    return " ".join(f"{k} {v:.3f}" for k, v in metrics.items())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--student-warm-start", type=int, default=0, help="SFT steps for the student's base (0: none)")
    p.add_argument("--teacher-warm-start", type=int, default=200, help="SFT steps for the teacher (cached)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument(
        "--on-policy",
        type=float,
        default=0.5,
        help="GKD's lambda: the share of each step's prompts answered by the student; the rest by the teacher",
    )
    p.add_argument("--beta", type=float, default=0.5, help="GKD's JSD mix (0: forward KL, 1: reverse KL)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--eval-prompts", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 is faster on an oversubscribed machine)")
    p.add_argument("--plot", default="out/gkd-curve.png")
    p.add_argument("--report-to", default="none", help="tensorboard, wandb, mlflow, trackio (comma-separated), or none")
    p.add_argument("--logging-dir", default="out/runs", help="where the trackers write their runs")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    student_base = warm_start(args.model, steps=args.student_warm_start) if args.student_warm_start else args.model
    teacher_path = warm_start(args.model, steps=args.teacher_warm_start) if args.teacher_warm_start else args.model
    teacher_path = resolve_model_path(teacher_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=torch.float32).eval()

    model = TransformersModel(model_id=student_base)
    model.add_adapter_to_model(ADAPTER, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    model.set_optimizer("AdamW", lr=args.lr, adapter_name=ADAPTER)
    model.set_loss("GKDLoss", adapter_name=ADAPTER, beta=args.beta)
    sampler = TorchSampler(model_id=student_base)
    engine = InProcessCheckpointEngine()
    engine.sync(model, sampler, ADAPTER)
    teacher_sampler = TorchSampler(model_id=teacher_path)  # with the teacher's tokenizer and template

    held_out = arithmetic_prompts("test", limit=args.eval_prompts)
    pool, rng = arithmetic_prompts("train"), random.Random(args.seed)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, num_samples=1)
    teacher_answers = sample_rollout(teacher_sampler, held_out, greedy)
    teacher_acc = greedy_accuracy(teacher_sampler, held_out)
    # fixed held-out sequences: prompt + the teacher's greedy answer, with the teacher's top-k there
    teacher_rows = teacher_topk(teacher, teacher_answers.training_rows([0.0] * len(teacher_answers)), args.top_k)

    def evaluate() -> dict:
        own = sample_rollout(sampler, held_out, greedy, adapter_name=ADAPTER)
        own_rows = teacher_topk(teacher, own.training_rows([0.0] * len(own)), args.top_k)
        agree = sum(a == b for a, b in zip(own.texts, teacher_answers.texts)) / len(held_out)
        reward = ArithmeticAccuracy()(own.texts, own.reward_rows())
        return {
            "loss_on_teacher_answers": model.forward_only(inputs=teacher_rows, adapter_name=ADAPTER)["loss"],
            "loss_on_own_answers": model.forward_only(inputs=own_rows, adapter_name=ADAPTER)["loss"],
            "agreement": agree,
            "accuracy": sum(reward.values) / len(reward),
        }

    tracker = open_trackers(
        args.report_to, logging_dir=args.logging_dir, config=vars(args), run_name=time.strftime("gkd-%Y%m%d-%H%M%S")
    )
    curve = [(0, evaluate())]
    print(f"teacher held-out accuracy {teacher_acc:.3f}; student step 0: {_fmt(curve[0][1])}")
    params = SamplingParams(max_tokens=6, temperature=1.0, num_samples=args.group)
    timer = PhaseTimer()
    for step in range(1, args.steps + 1):
        with timer.phase("sample"):
            prompts = rng.sample(pool, args.prompts)
            n_own = round(args.on_policy * len(prompts))
            # on-policy: the student's own answers (current adapter); the rest: the teacher's answers,
            # which the student may not yet reach by itself. Both in every step keeps the gradient steady.
            rollouts = [sample_rollout(sampler, prompts[:n_own], params, adapter_name=ADAPTER)] if n_own else []
            if n_own < len(prompts):
                rollouts.append(sample_rollout(teacher_sampler, prompts[n_own:], params))
        with timer.phase("score"):
            rows = teacher_topk(teacher, [r for ro in rollouts for r in ro.training_rows([0.0] * len(ro))], args.top_k)
        with timer.phase("train"):
            out = model.forward_backward(inputs=rows, adapter_name=ADAPTER)
            model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=ADAPTER)
        with timer.phase("sync"):
            engine.sync(model, sampler, ADAPTER)
        tracker.log({**out, **timer.step_metrics()}, step=step)
        line = f"step {step}: gkd loss {out['loss']:.4f} [{timer.step_metrics()['time/step']:.1f}s]"
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, evaluate()))
            tracker.log({f"eval/{k}": v for k, v in curve[-1][1].items()}, step=step)
            line += f"  held-out {_fmt(curve[-1][1])}"
        print(line, flush=True)

    tracker.close()
    steps = [s for s, _ in curve]
    for key in ("loss_on_teacher_answers", "loss_on_own_answers", "agreement", "accuracy"):
        print(f"held-out {key}: " + "  ".join(f"{s}:{m[key]:.3f}" for s, m in curve))
    print(f"teacher held-out accuracy {teacher_acc:.3f}")
    plot = save_curves(
        args.plot,
        {
            "held-out GKD loss, teacher's answers": (steps, [m["loss_on_teacher_answers"] for _, m in curve]),
            "held-out GKD loss, student's answers": (steps, [m["loss_on_own_answers"] for _, m in curve]),
            "held-out agreement with teacher": (steps, [m["agreement"] for _, m in curve]),
        },
        title="On-policy distillation (GKD)",
        ylabel="JSD to teacher / agreement",
    )
    print(f"plot: {plot or 'matplotlib not installed (pip install matplotlib)'}")
    summary = {
        "example": "gkd",
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "group": args.group,
        "held_out_prompts": len(held_out),
        "teacher_accuracy": teacher_acc,
        "loss_start": curve[0][1]["loss_on_teacher_answers"],
        "loss_end": curve[-1][1]["loss_on_teacher_answers"],
        "own_loss_start": curve[0][1]["loss_on_own_answers"],
        "own_loss_end": curve[-1][1]["loss_on_own_answers"],
        "agreement_start": curve[0][1]["agreement"],
        "agreement_end": curve[-1][1]["agreement"],
        "student_accuracy_start": curve[0][1]["accuracy"],
        "student_accuracy_end": curve[-1][1]["accuracy"],
        "minutes": round((time.perf_counter() - t_start) / 60, 2),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
