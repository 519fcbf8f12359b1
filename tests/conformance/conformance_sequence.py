"""The conformance script: one sequence of TwinkleModel calls, run the same way against every engine
and mode, recording the numbers the matrix compares.

    add an adapter (the same initial weights everywhere); set optimizer, scheduler, loss;
    8 forward_backward with gradient accumulation 2, each followed by clip_grad_and_step;
    forward_only log-probs of a probe batch; calculate_metric;
    save with training state; a fresh engine loads and resumes, trains two more steps;
    greedy samples from the final adapter.

A mode supplies `Mode`: how to build an engine, how this process's share of a batch is cut, how
forward_only's rows are gathered, where checkpoints go, and how it samples. Engines over HTTP
answer Futures; `done` resolves them, so one script serves every engine.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

MICRO_BATCHES, GAS, GLOBAL_ROWS, STEPS_BEFORE_SAVE = 8, 2, 4, 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=4, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)  # = a Tinker rank-4 LoRA
SEED = 42  # the adapter's init seed: MultiLoraModel and the server draw the same initial weights from it
OPTIMIZER = dict(lr=1e-2, weight_decay=0.0)
WARMUP = 1
MAX_GRAD_NORM = 1.0
SAMPLE = dict(max_tokens=4, temperature=0.0, seed=1)


def lora_config():
    from peft import LoraConfig

    return LoraConfig(**LORA)


def make_rows(n: int, seed: int) -> list[dict]:
    """Rows of uneven length with a masked prompt, so ranks hold different token counts."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = rng.randint(6, 16)
        ids = [rng.randrange(3, 800) for _ in range(length)]
        prompt = rng.randint(1, 4)
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def micro_batches() -> list[list[dict]]:
    rows = make_rows(MICRO_BATCHES * GLOBAL_ROWS, seed=7)
    return [rows[i : i + GLOBAL_ROWS] for i in range(0, len(rows), GLOBAL_ROWS)]


PROBE = make_rows(3, seed=11)


def done(value):
    """A Future's result (HTTP engines), or the value itself."""
    return value.result() if hasattr(value, "result") and callable(value.result) else value


def lr_factor(step: int, total: int) -> float:
    """CosineWarmupScheduler's factor at `step` (for the Tinker SDK, which takes the lr each step)."""
    import math

    if step < WARMUP:  # transformers' warmup, which CosineWarmupScheduler builds
        return step / max(1, WARMUP)
    progress = (step - WARMUP) / max(1, total - WARMUP)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass
class Mode:
    make: Callable[[], object]  # a fresh engine
    shard: Callable[[list], list] = lambda rows: rows
    gather: Callable[[list], list] = lambda rows: rows
    init_path: str | None = None  # a LoRA folder holding the shared initial weights
    checkpoint: str = "ckpt"  # where save writes (a folder, or a server-side name)
    to_folder: Callable[[str], str] = lambda path: path  # a saved checkpoint as a local PEFT folder
    sample: Callable[[object, str], list] | None = None  # (engine, folder) -> greedy tokens per prompt


@dataclass
class Record:
    losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    lrs: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    metric_loss: float | None = None
    resumed: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)  # final adapter weights by peft name (as lists)
    samples: list = field(default_factory=list)


def configure(engine, mode: Mode) -> None:
    from twinkle.model import num_training_steps

    done(engine.add_adapter_to_model("default", lora_config(), gradient_accumulation_steps=GAS))
    if mode.init_path is not None:
        done(engine.load(mode.init_path))
    done(engine.set_loss("CrossEntropyLoss"))
    done(engine.set_optimizer("AdamW", **OPTIMIZER))
    done(
        engine.set_lr_scheduler(
            "CosineWarmupScheduler", num_warmup_steps=WARMUP, num_training_steps=num_training_steps(MICRO_BATCHES, GAS)
        )
    )


def _train(engine, mode: Mode, batches, record: Record) -> None:
    for batch in batches:
        record.losses.append(float(done(engine.forward_backward(inputs=mode.shard(batch)))["loss"]))
        out = done(engine.clip_grad_and_step(max_grad_norm=MAX_GRAD_NORM))
        if out["stepped"]:
            record.grad_norms.append(float(out["grad_norm"]))
            record.lrs.append(out.get("lr"))


def run(mode: Mode) -> Record:
    record = Record()
    batches = micro_batches()
    first_half = STEPS_BEFORE_SAVE * GAS
    engine = mode.make()
    configure(engine, mode)
    _train(engine, mode, batches[:first_half], record)
    record.logprobs = mode.gather(done(engine.forward_only(inputs=mode.shard(PROBE)))["logprobs"])
    record.metric_loss = done(engine.calculate_metric(is_training=True)).get("loss")
    saved = done(engine.save(mode.checkpoint, save_training_state=True))

    resumed = mode.make()
    configure(resumed, mode)
    record.resumed = dict(done(resumed.resume_from_checkpoint(saved)))
    _train(resumed, mode, batches[first_half:], record)
    final = done(resumed.save(f"{mode.checkpoint}-final"))
    folder = mode.to_folder(final)
    if folder is not None:
        from safetensors.torch import load_file

        record.weights = {k: v.flatten().tolist() for k, v in load_file(f"{folder}/adapter_model.safetensors").items()}
    if mode.sample is not None:
        record.samples = mode.sample(resumed, folder)
    return record


def sample_locally(_engine, folder: str) -> list:
    """Greedy tokens from the saved adapter with an in-process TorchSampler."""
    from twinkle.hub import TEST_MODEL
    from twinkle.sampler import TorchSampler

    sampler = TorchSampler(model_id=TEST_MODEL)
    sampler.load_adapter("final", folder)
    prompts = [row["input_ids"][:6] for row in PROBE]
    return [r.sequences[0].tokens for r in sampler.sample(prompts, dict(SAMPLE), adapter_name="final")]


def save_initial_adapter(path: str) -> str:
    """The shared initial LoRA: MultiLoraModel's draw from SEED (what the server draws for seed 42)."""
    from twinkle.hub import TEST_MODEL
    from twinkle.model.multi_lora import MultiLoraModel

    engine = MultiLoraModel(TEST_MODEL)
    engine.add_adapter_to_model("default", lora_config(), seed=SEED)
    return engine.save(path)
