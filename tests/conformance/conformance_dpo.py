"""A DPO sequence for the conformance matrix, run through the library (TwinkleModel calls) and through a
server backend's operations (the native API's: add_lora, configure_adapter, forward_backward_many,
clip_grad_and_step, calculate_metric, save_checkpoint), recording the matrix's columns.

    the shared initial adapter, DPOLoss (a mean over (chosen, rejected) pairs), AdamW, accumulation 2;
    4 forward_backward of 4 pairs each, each followed by clip_grad_and_step;
    forward-only log-probs of a probe batch; calculate_metric; the final adapter's weights.

Each micro-batch's pairs are uneven: on two data ranks, rank 0 holds the long completions and rank 1
the short ones, so weighting a rank by its loss tokens instead of its pairs shows in every column."""

from __future__ import annotations

import random
from pathlib import Path

import conformance_sequence as sequence

MICRO_BATCHES, GAS, PAIRS = 4, 2, 4
BETA = 0.5
OPTIMIZER = dict(lr=1e-2, weight_decay=0.0)


def micro_batch(seed: int) -> list[dict]:
    """PAIRS pairs (rows 2k chosen, 2k+1 rejected, one prompt); the first half long, the second short."""
    rng = random.Random(seed)
    rows = []
    for pair in range(PAIRS):
        prompt = [rng.randrange(3, 800) for _ in range(rng.randint(2, 4))]
        length = rng.randint(9, 14) if pair < PAIRS // 2 else rng.randint(1, 3)
        for _ in range(2):
            answer = [rng.randrange(3, 800) for _ in range(length)]
            rows.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return rows


BATCHES = [micro_batch(100 + i) for i in range(MICRO_BATCHES)]
PROBE = micro_batch(99)[:4]  # two pairs


def _weights(folder) -> dict:
    from safetensors.torch import load_file

    return {k: v.flatten().tolist() for k, v in load_file(f"{Path(folder)}/adapter_model.safetensors").items()}


def run_library(engine, init_folder: str, out: Path) -> dict:
    """Through TwinkleModel calls (one process: the reference)."""
    record = sequence.Record()
    engine.add_adapter_to_model("default", sequence.lora_config(), gradient_accumulation_steps=GAS)
    engine.load(init_folder)
    engine.set_loss("DPOLoss", beta=BETA)
    engine.set_optimizer("AdamW", **OPTIMIZER)
    for batch in BATCHES:
        record.losses.append(engine.forward_backward(inputs=batch)["loss"])
        step = engine.clip_grad_and_step(max_grad_norm=sequence.MAX_GRAD_NORM)
        if step["stepped"]:
            record.grad_norms.append(step["grad_norm"])
            record.lrs.append(step["lr"])
    record.logprobs = engine.forward_only(inputs=PROBE)["logprobs"]
    record.metric_loss = engine.calculate_metric(is_training=True)["loss"]
    record.weights = _weights(engine.save(out / "library"))
    return record.__dict__


def run_backend(backend, init_folder: str, out: Path) -> dict:
    """Through a serve Backend's operations, as the native API drives them."""
    from twinkle.serve.backend.base import RowsPass

    record = sequence.Record()
    backend.add_lora("dpo", sequence.lora_config(), GAS, sequence.SEED)
    backend.load_checkpoint("dpo", init_folder, False)
    backend.configure_adapter("dpo", "loss", "DPOLoss", {"beta": BETA})
    backend.configure_adapter("dpo", "optimizer", "AdamW", OPTIMIZER)
    for batch in BATCHES:
        (outcome,) = backend.forward_backward_many([RowsPass("dpo", batch, False)])
        record.losses.append(outcome["loss"])
        step = backend.clip_grad_and_step("dpo", sequence.MAX_GRAD_NORM)
        if step["stepped"]:
            record.grad_norms.append(step["grad_norm"])
            record.lrs.append(step["lr"])
    (probe,) = backend.forward_backward_many([RowsPass("dpo", PROBE, True)])
    record.logprobs = [[0.0, *row] for row in probe["logprobs"]]  # the library's rows start at position 0
    record.metric_loss = backend.calculate_metric("dpo", True)["loss"]
    backend.save_checkpoint("dpo", out / "backend", False)
    record.weights = _weights(out / "backend")
    return record.__dict__
