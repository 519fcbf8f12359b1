"""LoRA SFT: Twinkle's TransformersModel against Hugging Face TRL's `SFTTrainer` + peft, side by side.

TRL runs in its own venv (benchmarks/_peer.py: trl 1.16.0 with uv.lock's torch, transformers, peft,
accelerate, datasets), as a worker that the benchmark paces block by block; Twinkle runs in this
process. The blocks alternate (and so does which side goes first) so that machine load hits both.

Matched on both sides: the model folder (`twinkle://qwen3-demo`, resolved by twinkle.hub), the rows
and their order (Twinkle's tokenized rows, fed to TRL pre-tokenized with the same labels, so the loss
is on the assistant tokens only on both sides), the LoRA (r16, alpha 32, all-linear, no dropout, and
the same initial A matrices: TRL loads Twinkle's freshly initialised adapter), AdamW (lr, betas, eps,
weight decay 0.01 on the LoRA weights), a constant lr, gradient clipping at 1.0, batch size, max
length 128, fp32, and torch threads. TRL's defaults that are wrong for a CPU are set as a competent
user would: `bf16=False` (autocast to bf16 slows a model this small) and no gradient (activation) checkpointing
(recomputing the forward buys nothing at these sizes); its default optimizer stays (torch's fused
AdamW, which Twinkle uses on CPU too).

Not matched, by design of the tools: TRL's chat-template tokenization is not measured (both sides
train on the same token ids); TRL computes its entropy and token-accuracy metrics every step, Twinkle
its loss / token / throughput counters. Both are each tool's default work, so they stay in.

Shapes: the quickstart's (examples/quickstart.py: batch 8 of the bundled self-cognition rows, ~30
tokens each, lr 2e-3, 60 steps) and 8 x 128 (random token rows with a 16-token prompt, lr 1e-4).
The first losses must agree (relative 1e-4: both are the base model's loss on the same tokens);
the whole curves are printed with their largest relative difference.

    uv run python benchmarks/bench_peer_trl_sft.py [--shapes quickstart,8x128] [--warmup 4] [--block 6]
    uv run python benchmarks/bench_peer_trl_sft.py --precision bf16   # both sides under bf16 autocast
    uv run python benchmarks/bench_peer_trl_sft.py --compile          # both sides torch.compile'd

`--compile` compiles both sides with torch.compile (inductor): Twinkle `compile=True` (each decoder
layer), TRL `torch_compile=True` (the Trainer compiles the whole model); the warmup steps, which pay
the compiling, are reported per side as `*_warmup_s` and left out of the ratio like any warmup.

`--precision bf16` trains both sides under torch's CPU bf16 autocast with fp32 master weights and
optimizer state (Twinkle `mixed_precision="bf16"`, TRL `bf16=True`); the first losses must then agree
to 1e-2 relative (autocast rounds each matmul's inputs to bf16), the curves are printed as in fp32.

Final line: JSON with `ratio` = Twinkle tokens/s / TRL tokens/s at the quickstart's shape (goal
>= 1.25), `ratio_8x128`, s/step, tokens/s and both loss curves per shape.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from _peer import ROOT, Worker, locked, peer_python

# torch, peft and twinkle are imported where used, after argparse: `--help` must not wait for them
DEFAULT_MODEL = "twinkle://qwen3-demo"  # twinkle.hub.DEFAULT_MODEL, the embedded demo model
TRL = ["trl==1.16.0", *locked("torch", "transformers", "peft", "accelerate", "datasets")]
SHAPES = {"quickstart": {"lr": 2e-3, "steps": 60, "batch": 8}, "8x128": {"lr": 1e-4, "steps": 28, "batch": 8}}
WEIGHT_DECAY, MAX_LENGTH = 0.01, 128


def quickstart_batches(steps: int, batch: int) -> list[list[dict]]:
    """The quickstart's batches, in its order (DataLoader shuffle, seed 0, epochs back to back)."""
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.preprocessor import SelfCognitionProcessor

    dataset = Dataset(dataset_meta=DatasetMeta("twinkle://self-cognition"))
    dataset.set_template("Template", model_id=DEFAULT_MODEL, max_length=MAX_LENGTH)
    dataset.map(SelfCognitionProcessor("Glimmer", "Lantern Labs"))
    dataset.encode()
    batches = []
    while len(batches) < steps:
        for b in DataLoader(dataset=dataset, batch_size=batch, shuffle=True, seed=0):
            batches.append([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in b])
            if len(batches) == steps:
                break
    return batches


def random_batches(steps: int, batch: int, seq: int, vocab: int) -> list[list[dict]]:
    rng = random.Random(0)
    rows = lambda: [rng.randrange(1, vocab) for _ in range(seq)]  # noqa: E731
    return [[{"input_ids": ids, "labels": [-100] * 16 + ids[16:]} for ids in (rows() for _ in range(batch))]
            for _ in range(steps)]  # fmt: skip


class TwinkleSide:
    def __init__(self, lr: float, adapter_dir: Path, precision: str, compile: bool):
        import torch
        from peft import LoraConfig

        from twinkle.model import TransformersModel

        torch.manual_seed(0)
        self.model = TransformersModel(model_id=DEFAULT_MODEL, mixed_precision=precision, compile=compile)
        self.model.add_adapter_to_model("peer", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
        self.model.set_optimizer("AdamW", lr=lr, weight_decay=WEIGHT_DECAY, adapter_name="peer")
        self.model.save(str(adapter_dir), adapter_name="peer")  # TRL starts from this same LoRA

    def run(self, batches: list[list[dict]]) -> tuple[list[float], list[float]]:
        losses, seconds = [], []
        for rows in batches:
            t0 = time.perf_counter()
            losses.append(self.model.forward_backward(inputs=rows, adapter_name="peer")["loss"])
            self.model.clip_grad_and_step(max_grad_norm=1.0, adapter_name="peer")
            seconds.append(time.perf_counter() - t0)
        return losses, seconds


def compare(shape: str, batches: list[list[dict]], lr: float, args, trl_python: Path) -> dict:
    from twinkle.hub import resolve_model_path

    work = ROOT / "out" / "peer-bench" / f"trl-sft-{shape}"
    work.mkdir(parents=True, exist_ok=True)
    ours = TwinkleSide(lr, work / "init-adapter", args.precision, args.compile)
    with open(work / "rows.jsonl", "w") as f:
        for rows in batches:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    cfg = {
        "model_path": str(resolve_model_path(DEFAULT_MODEL)),
        "adapter_path": str(work / "init-adapter"),
        "rows_file": str(work / "rows.jsonl"),
        "out_dir": str(work / "trl-out"),
        "steps": len(batches),
        "batch": len(batches[0]),
        "lr": lr,
        "weight_decay": WEIGHT_DECAY,
        "max_length": MAX_LENGTH,
        "threads": args.threads,
        "bf16": args.precision == "bf16",
        "compile": args.compile,
    }
    trl = Worker(trl_python, Path(__file__).parent / "_trl_sft_worker.py", cfg, env={"TOKENIZERS_PARALLELISM": "false"})
    curves = {"twinkle": ([], []), "trl": ([], [])}
    try:
        for i, start in enumerate(range(0, len(batches), args.block)):
            block = batches[start : start + args.block]
            order = ("twinkle", "trl") if i % 2 == 0 else ("trl", "twinkle")
            for side in order:
                if side == "twinkle":
                    losses, seconds = ours.run(block)
                else:
                    answer = trl.ask({"steps": len(block)})
                    losses, seconds = answer["losses"], answer["seconds"]
                curves[side][0].extend(losses)
                curves[side][1].extend(seconds)
    finally:
        trl.close()
    tokens = [sum(len(r["input_ids"]) for r in rows) for rows in batches]
    out = {"steps": len(batches), "timed_steps": len(batches) - args.warmup, "tokens_per_step": statistics.mean(tokens)}
    for side, (losses, seconds) in curves.items():
        timed = seconds[args.warmup :]
        out[f"{side}_s_per_step"] = statistics.median(timed)
        out[f"{side}_warmup_s"] = sum(seconds[: args.warmup])  # with --compile: what compiling cost
        out[f"{side}_tokens_per_s"] = sum(tokens[args.warmup :]) / sum(timed)
        out[f"{side}_losses"] = [round(x, 6) for x in losses]
    ours_l, theirs_l = curves["twinkle"][0], curves["trl"][0]
    rel = [abs(a - b) / max(abs(a), abs(b), 1e-12) for a, b in zip(ours_l, theirs_l)]
    assert rel[0] <= (1e-2 if args.precision == "bf16" else 1e-4), (
        f"{shape}: first losses differ: Twinkle {ours_l[0]} vs TRL {theirs_l[0]}"
    )
    out["first_loss_rel_diff"], out["max_loss_rel_diff"] = rel[0], max(rel)
    out["ratio"] = out["twinkle_tokens_per_s"] / out["trl_tokens_per_s"]
    print(f"[{shape}] {json.dumps(out)}", flush=True)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="quickstart,8x128", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--warmup", type=int, default=4, help="first steps of each side left out of the timing")
    parser.add_argument("--block", type=int, default=6, help="steps a side runs before the other takes its turn")
    parser.add_argument("--steps", type=int, default=0, help="steps per shape (0: the shape's own, 60 and 28)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="both sides alike")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="both sides torch.compile'd (Twinkle compile=True, TRL torch_compile=True)",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # the TRL worker inherits it
    import torch

    from twinkle.model import TransformersModel

    torch.set_num_threads(args.threads)
    trl_python = peer_python("trl", TRL)

    shapes, per_shape = args.shapes.split(","), {}
    for shape in shapes:
        spec = {**SHAPES[shape], **({"steps": args.steps} if args.steps else {})}
        if shape == "quickstart":
            batches = quickstart_batches(spec["steps"], spec["batch"])
        else:
            seq = int(shape.split("x")[1])
            vocab = TransformersModel(model_id=DEFAULT_MODEL).vocab_size
            batches = random_batches(spec["steps"], spec["batch"], seq, vocab)
        per_shape[shape] = compare(shape, batches, spec["lr"], args, trl_python)
    # scalars first: the README's Results row shows the first few
    result = {"ratio": per_shape[shapes[0]]["ratio"]}
    for shape, r in per_shape.items():
        result.update({f"ratio_{shape}": r["ratio"], f"twinkle_s_per_step_{shape}": r["twinkle_s_per_step"]})
        result[f"trl_s_per_step_{shape}"] = r["trl_s_per_step"]
    result.update(model=DEFAULT_MODEL, threads=args.threads, peer="trl==1.16.0", load_avg=os.getloadavg()[0])
    result.update(precision=args.precision, compile=args.compile)
    print(json.dumps({**result, **per_shape}))


if __name__ == "__main__":
    main()
