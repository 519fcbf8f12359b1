"""A TransformersModel SFT step against a hand-written transformers + peft step, side by side.

Same model (twinkle.hub.DEFAULT_MODEL), same batch (8 x 128 tokens), same LoRA (r16, all-linear),
same AdamW and gradient clipping. The two loops alternate step by step so that machine load hits
both alike; the medians are compared. MFU for both uses the same FLOP count and the same matmul
peak measured once at start. Final line: JSON with `ratio` = twinkle median / hand median
(goal: <= 1.02).

    uv run python benchmarks/bench_model_sft_step.py [--steps 24] [--warmup 4]
"""

import argparse
import json
import random
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from twinkle.hub import DEFAULT_MODEL, resolve_model_path
from twinkle.metric import attention_dims, matmul_params, measure_matmul_peak, step_flops
from twinkle.model import TransformersModel

BATCH, SEQ, LR = 8, 128, 1e-4


def lora():
    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")


def make_rows(vocab: int):
    rng = random.Random(0)
    rows = []
    for _ in range(BATCH):
        ids = [rng.randrange(1, vocab) for _ in range(SEQ)]
        rows.append({"input_ids": ids, "labels": [-100] * 16 + ids[16:]})
    return rows


class HandWritten:
    """What a user writes without Twinkle."""

    def __init__(self, path, rows):
        torch.manual_seed(0)
        self.model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora())
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR)
        self.input_ids = torch.tensor([r["input_ids"] for r in rows])
        self.labels = torch.tensor([r["labels"] for r in rows])

    def step(self) -> float:
        logits = self.model(input_ids=self.input_ids, attention_mask=torch.ones_like(self.input_ids)).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), self.labels[:, 1:].reshape(-1), ignore_index=-100
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


class Twinkle:
    def __init__(self, rows):
        torch.manual_seed(0)
        self.model = TransformersModel(model_id=DEFAULT_MODEL)
        self.model.add_adapter_to_model("default", lora())
        self.model.set_optimizer("AdamW", lr=LR, weight_decay=0.01)
        self.rows = rows

    def step(self) -> float:
        loss = self.model.forward_backward(inputs=self.rows)["loss"]
        self.model.clip_grad_and_step(max_grad_norm=1.0)
        return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)  # 8 left a 3% spread between runs
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    path = resolve_model_path(DEFAULT_MODEL)
    ours = Twinkle(None)
    rows = make_rows(ours.model.vocab_size)
    ours.rows = rows
    hand = HandWritten(path, rows)
    times = {"twinkle": [], "hand": []}
    losses = {"twinkle": [], "hand": []}
    for i in range(args.warmup + args.steps):
        for name, runner in (("twinkle", ours), ("hand", hand)) if i % 2 else (("hand", hand), ("twinkle", ours)):
            t0 = time.perf_counter()
            losses[name].append(runner.step())
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)

    peak = measure_matmul_peak("cpu", torch.float32)
    n_matmul, n_trainable = matmul_params(hand.model)
    layers, q_width = attention_dims(hand.model.config)
    flops = step_flops(BATCH * SEQ, SEQ, n_matmul, n_trainable, layers, q_width)
    result = {
        "model": DEFAULT_MODEL,
        "batch": BATCH,
        "seq_len": SEQ,
        "threads": args.threads,
        "steps": args.steps,
        "peak_gflops": peak / 1e9,
        "step_gflops": flops / 1e9,
    }
    for name in times:
        median = statistics.median(times[name])
        result[f"{name}_step_s"] = median
        result[f"{name}_step_s_all"] = times[name]
        result[f"{name}_tokens_per_s"] = BATCH * SEQ / median
        result[f"{name}_mfu"] = flops / median / peak
        result[f"{name}_first_loss"], result[f"{name}_last_loss"] = losses[name][0], losses[name][-1]
    result["ratio"] = result["twinkle_step_s"] / result["hand_step_s"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
