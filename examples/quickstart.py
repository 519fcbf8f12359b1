"""Quickstart: fine-tune a LoRA on the embedded default model, then ask it who it is.

    uv run examples/quickstart.py            # about a minute on 2 CPU cores, no network, no GPU

Builds the embedded ~5M-parameter Qwen3 (`twinkle://qwen3-demo`) on first use, trains a LoRA on the
bundled self-cognition data with Twinkle's own loop (Dataset -> Template -> DataLoader ->
TransformersModel), syncs the adapter into a TorchSampler, samples the same questions from the base
model and from the tuned adapter, and saves the adapter as a PEFT folder.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from peft import LoraConfig
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from twinkle.checkpoint_engine import InProcessCheckpointEngine
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub import DEFAULT_MODEL
from twinkle.metric.trackers import open_trackers
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.sampler import SamplingParams, TorchSampler
from twinkle.template import Template

QUESTIONS = ["Who are you?", "Who made you?", "What is your name?"]
ADAPTER = "glimmer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--output", default="out/quickstart-lora")
    parser.add_argument("--report-to", default="none", help="tensorboard, wandb, mlflow, trackio (comma-separated)")
    parser.add_argument("--logging-dir", default="out/runs", help="where the trackers write their runs")
    args = parser.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(0)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    t0 = time.perf_counter()

    dataset = Dataset(dataset_meta=DatasetMeta("twinkle://self-cognition"))
    dataset.set_template("Template", model_id=args.model, max_length=128)
    dataset.map(SelfCognitionProcessor("Glimmer", "Lantern Labs"))
    dataset.encode()
    dataloader = DataLoader(dataset=dataset, batch_size=args.batch_size, shuffle=True, seed=0)

    model = TransformersModel(model_id=args.model)
    model.add_adapter_to_model(ADAPTER, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer(optimizer_cls="AdamW", lr=args.lr)
    print(
        f"model {args.model}: {sum(p.numel() for p in model.hf_model.parameters()) / 1e6:.1f}M params, "
        f"{len(dataset)} training rows, ready in {time.perf_counter() - t0:.1f}s"
    )

    tracker = open_trackers(args.report_to, logging_dir=args.logging_dir, run_name="quickstart", config=vars(args))
    losses: list[float] = []
    bar = tqdm(total=args.steps, desc="LoRA SFT", unit="step", disable=None)  # drawn on a terminal only
    while len(losses) < args.steps:
        for batch in dataloader:
            losses.append(model.forward_backward(inputs=batch)["loss"])
            model.clip_grad_and_step()
            bar.update()
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            tracker.log({"loss": losses[-1]}, step=len(losses))
            if len(losses) == args.steps:
                break
    bar.close()
    metrics = model.calculate_metric(is_training=True)
    tracker.log(metrics, step=args.steps)  # the run's totals: tokens/s, MFU, accuracy, grad norm
    tracker.close()
    window = max(1, args.steps // 10)
    print(
        "loss curve:",
        " ".join(
            f"{sum(losses[i : i + window]) / len(losses[i : i + window]):.2f}" for i in range(0, len(losses), window)
        ),
    )
    print(f"tokens/s {metrics.get('tokens_per_s', 0):.0f}, MFU {metrics.get('mfu', 0):.3f}")

    sampler = TorchSampler(args.model, template=Template(model_id=args.model))
    InProcessCheckpointEngine().sync(model, sampler, ADAPTER)  # adapter weights only, no base copy
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    base = sampler.sample(chats, greedy)
    tuned = sampler.sample(chats, greedy, adapter_name=ADAPTER)
    tokenizer = sampler.tokenizer
    for question, b, t in zip(QUESTIONS, base, tuned):
        decode = lambda r: tokenizer.decode(r.sequences[0].tokens, skip_special_tokens=True).strip()  # noqa: E731
        print(f"\nQ: {question}\n  base : {decode(b)!r}\n  tuned: {decode(t)!r}")

    model.save(args.output, adapter_name=ADAPTER)
    print(f"\nsaved PEFT adapter to {args.output}/ in {time.perf_counter() - t0:.0f}s total")


if __name__ == "__main__":
    main()
