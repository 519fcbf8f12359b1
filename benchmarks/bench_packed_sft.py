"""Packed SFT: TransformersModel with InputProcessor(packing=True) against a hand-written, padded
transformers + peft loop, on the same variable-length rows.

Rows have a realistic length spread (log-normal, median 200 tokens, clipped to 24..1024, the demo
model's context; a prompt share left out of the loss), 8 rows a step, the same rows in the same
order on both sides. The hand-written loop pads each batch to its longest row (attention mask, as
a user writes it); Twinkle concatenates the 8 rows padding-free into one row whose position_ids
restart per row, so transformers masks attention block-diagonally and no row sees another. Same
model (twinkle.hub.DEFAULT_MODEL), LoRA (r16, all-linear), AdamW and clipping; the sides alternate
step by step.

Checked, not only timed: before training, the per-token log-probs of the first batch agree between
the two sides (max abs difference printed, must be < 1e-4), and so does the first step's loss.

Prints a final JSON line: `speedup` = packed real tokens/s ÷ padded real tokens/s, wall clock (goal
>= 1.25); `cpu_time_speedup` the same by process CPU time (on a loaded machine the wall-clock ratio
is squeezed toward 1 by waiting, the CPU-time one much less).
On CPU the packed attention is sdpa with a block-diagonal mask over the whole packed row (O(T^2) for
T packed tokens, ~15% of a step here): a per-row (varlen) attention would cut that further.
Run: .venv/bin/python benchmarks/bench_packed_sft.py [--steps 12] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from twinkle.hub import DEFAULT_MODEL, resolve_model_path
from twinkle.model import TransformersModel
from twinkle.processor import InputProcessor

BATCH, LR, MAX_LEN = 8, 1e-4, 1024


def lora():
    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")


def make_batches(n_batches: int, vocab: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    batches = []
    for _ in range(n_batches):
        rows = []
        for _ in range(BATCH):
            n = min(MAX_LEN, max(24, int(rng.lognormvariate(5.3, 0.75))))  # median e^5.3 = 200
            ids = [rng.randrange(1, vocab) for _ in range(n)]
            prompt = int(n * rng.uniform(0.2, 0.6))
            rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
        batches.append(rows)
    return batches


class HandWrittenPadded:
    """What a user writes without Twinkle: pad to the batch's longest row, mask the pads."""

    def __init__(self, path):
        torch.manual_seed(0)
        self.model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora())
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.01)

    @staticmethod
    def collate(rows):
        batch = InputProcessor(padding_side="right")(rows)  # the usual right-padding collate (pads -100)
        return batch["input_ids"], batch["labels"], batch["attention_mask"]

    def logits(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).logits

    def step(self, rows) -> float:
        ids, labels, mask = self.collate(rows)
        logits = self.logits(ids, mask)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def logprobs(self, rows) -> list[torch.Tensor]:
        ids, labels, mask = self.collate(rows)
        with torch.no_grad():
            logps = torch.log_softmax(self.logits(ids, mask)[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        logps = torch.where(labels[:, 1:] == -100, 0.0, logps)
        return [logps[i, : len(r["input_ids"]) - 1] for i, r in enumerate(rows)]


class TwinklePacked:
    def __init__(self):
        torch.manual_seed(0)
        self.model = TransformersModel(model_id=DEFAULT_MODEL)
        self.model.add_adapter_to_model("default", lora())
        self.model.set_optimizer("AdamW", lr=LR, weight_decay=0.01)
        self.model.set_processor("InputProcessor", packing=True)

    def step(self, rows) -> float:
        loss = self.model.forward_backward(inputs=rows)["loss"]
        self.model.clip_grad_and_step(max_grad_norm=1.0)
        return loss

    def logprobs(self, rows) -> list[torch.Tensor]:
        return [torch.tensor(r[1:]) for r in self.model.forward_only(inputs=rows)["logprobs"]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    packed = TwinklePacked()
    padded = HandWrittenPadded(resolve_model_path(DEFAULT_MODEL))
    batches = make_batches(args.warmup + args.steps, packed.model.vocab_size)
    logp_diff = max(
        float((a - b).abs().max()) for a, b in zip(packed.logprobs(batches[0]), padded.logprobs(batches[0]))
    )
    assert logp_diff < 1e-4, f"packed and padded per-token log-probs differ by {logp_diff}"

    seconds = {"packed": 0.0, "padded": 0.0}
    cpu_seconds = {"packed": 0.0, "padded": 0.0}  # process CPU time: less bent by other load than wall time
    losses = {"packed": [], "padded": []}
    real_tokens = padded_tokens = 0
    for i, rows in enumerate(batches):
        order = (("packed", packed), ("padded", padded)) if i % 2 else (("padded", padded), ("packed", packed))
        for name, side in order:
            t0, c0 = time.perf_counter(), time.process_time()
            losses[name].append(side.step(rows))
            if i >= args.warmup:
                seconds[name] += time.perf_counter() - t0
                cpu_seconds[name] += time.process_time() - c0
        if i >= args.warmup:
            real_tokens += sum(len(r["input_ids"]) for r in rows)
            padded_tokens += BATCH * max(len(r["input_ids"]) for r in rows)
    assert abs(losses["packed"][0] - losses["padded"][0]) < 1e-4, (losses["packed"][0], losses["padded"][0])
    packed_tps, padded_tps = real_tokens / seconds["packed"], real_tokens / seconds["padded"]
    print(
        json.dumps(
            {
                "benchmark": "bench_packed_sft",
                "model": DEFAULT_MODEL,
                "speedup": round(packed_tps / padded_tps, 3),
                "packed_tokens_per_s": round(packed_tps, 1),
                "padded_tokens_per_s": round(padded_tps, 1),
                "cpu_time_speedup": round(cpu_seconds["padded"] / cpu_seconds["packed"], 3),
                "padding_efficiency": round(real_tokens / padded_tokens, 3),
                "steps": args.steps,
                "batch": BATCH,
                "threads": args.threads,
                "real_tokens": real_tokens,
                "first_batch_max_logprob_diff": logp_diff,
                "first_loss_packed": losses["packed"][0],
                "first_loss_padded": losses["padded"][0],
                "last_loss_packed": losses["packed"][-1],
                "last_loss_padded": losses["padded"][-1],
            }
        )
    )


if __name__ == "__main__":
    main()
