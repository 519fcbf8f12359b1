"""The bundled arithmetic task, ready for RL on the embedded demo model.

A freshly built embedded model is random: RL from it would see only zero rewards. `warm_start`
gives it a brief full-parameter SFT on the bundled arithmetic *train* split (cached on disk, keyed
by its settings) so that it answers in the right format and sometimes correctly — the state real
RL runs start from. Evaluation uses the held-out *test* split, greedy decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path

ARITHMETIC = "twinkle://arithmetic"
DIGITS = "digits"  # twinkle.rl.digits: 64-token answers, for RL where sampling dominates


def _questions(split: str) -> list[dict]:
    from twinkle.dataset import Dataset, DatasetMeta

    return list(Dataset(DatasetMeta(ARITHMETIC, split=split)))


def _operands(rows: list[dict]):
    for row in rows:
        m = _TWO_OPERANDS.fullmatch(row["question"])
        if m:
            yield int(m[1]), m[2], int(m[3])


def _last_digit(rows: list[dict]) -> list[dict]:
    """The sums of `rows`, asked for their last digit: ten possible answers instead of ~150."""
    return [
        {"question": f"What is the last digit of {a} + {b}?", "answer": str((a + b) % 10)}
        for a, op, b in _operands(rows)
        if op == "+"
    ]


def _larger(rows: list[dict]) -> list[dict]:
    """The operands of `rows`, asked which one is larger (answer 1 or 2): a model that answers either
    is right half the time, so sampled groups hold right and wrong answers and RL has signal from its
    first step."""
    # Two-digit operands only, so the digits line up: with one-digit numbers mixed in, comparing the
    # leading digits (what the demo model learns first, from rewards or labels) scores 0.64 and stalls
    # there until the model also learns to count digits, which GRPO on 2 cores did not reach in 300 steps.
    pairs = [(a, b) for a, _, b in _operands(rows) if a != b and min(a, b) >= 10]
    # Subtractions put the larger operand first: alternate the order so "1" and "2" are equally common.
    pairs = [(max(a, b), min(a, b)) if i % 2 else (min(a, b), max(a, b)) for i, (a, b) in enumerate(pairs)]
    return [
        {"question": f"Which is larger, {a} or {b}? Answer 1 or 2.", "answer": "1" if a > b else "2"} for a, b in pairs
    ]


def _numbers(question: str) -> tuple[str, ...]:
    return tuple(sorted(re.findall(r"\d+", question)))


_TWO_OPERANDS = re.compile(r"What is (\d+) ([+-]) (\d+)\?")
TASKS = {
    "arithmetic": lambda rows: rows,
    "last-digit": _last_digit,
    "larger": _larger,
}
# `larger` and `digits` state their own answer format; without the arithmetic system prompt their rows
# are shorter, and an RL step (which trains on every prompt token) costs less.
SYSTEM_PROMPT = {"larger": None, DIGITS: None}


def _processor(task: str, with_answer: bool = False):
    from twinkle.preprocessor import ArithmeticProcessor
    from twinkle.preprocessor.rl import ARITHMETIC_SYSTEM

    return ArithmeticProcessor(system=SYSTEM_PROMPT.get(task, ARITHMETIC_SYSTEM), with_answer=with_answer)


def arithmetic_prompts(split: str = "train", limit: int | None = None, task: str = "arithmetic") -> list[dict]:
    """Rows `{"messages": [system, user], "ground_truth": "44", "question": ...}` of the bundled task.

    `task="last-digit"` asks for the last digit of the split's sums instead. The bundled train split
    repeats 74 of the test questions (operands 0..49 leave only 5,000 problems); "train" leaves
    them out, so the test split stays held out for whatever trains on it. `task="digits"` gives
    twinkle.rl.digits' rows instead (their own train and test draws).
    """
    if task == DIGITS:
        from twinkle.rl.digits import digit_rows

        raw = digit_rows(split, limit)
    elif task not in TASKS:
        raise ValueError(f"unknown arithmetic task {task!r}; known: {', '.join([*TASKS, DIGITS])}")
    else:
        raw = TASKS[task](_questions(split))
        if split == "train":  # a test question with its operands in either order is held out
            held_out = {_numbers(row["question"]) for row in TASKS[task](_questions("test"))}
            raw = [row for row in raw if _numbers(row["question"]) not in held_out]
        raw = raw[:limit]
    return [{**row, **out} for row, out in zip(raw, _processor(task)(raw))]


def task_reward(task: str):
    """The reward the RL examples train `task` with: exact match plus 0.1 x answer format, and for
    `arithmetic` 0.5 x closeness (exp(-|error|/5): a gradient where exact hits are rare); for `digits`
    exact match alone (digits are always the format, and closeness between 64-digit strings means little)."""
    from twinkle.reward import ArithmeticAccuracy, FormatReward, NumericCloseness, WeightedReward
    from twinkle.rl.digits import DigitsExactMatch

    if task == DIGITS:
        return WeightedReward({"accuracy": (DigitsExactMatch(), 1.0)})
    parts = {"accuracy": (ArithmeticAccuracy(), 1.0)}
    parts["format"] = (FormatReward(r"-?\d+(<\|im_end\|>)?", match="full"), 0.1)
    if task == "arithmetic":
        parts["closeness"] = (NumericCloseness(scale=5.0), 0.5)
    return WeightedReward(parts)


def _sft_rows(template, rows, task: str) -> list[dict]:
    encoded = [template.encode(r) for r in _processor(task, with_answer=True)(rows)]
    return [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in encoded]


def warm_start(
    base: str | None = None,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 1e-3,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    log=print,
    task: str = "arithmetic",
) -> str:
    """Folder of `base` after `steps` of full-parameter SFT on the `task`'s train split; built once, then cached."""
    import torch
    from tqdm import tqdm

    from twinkle.hub import DEFAULT_MODEL, cache_root, resolve_model_path
    from twinkle.model import TransformersModel
    from twinkle.template import Template

    base = base or DEFAULT_MODEL
    key = hashlib.sha256(json.dumps([base, steps, batch_size, lr, seed, task, 4]).encode()).hexdigest()[:12]
    target = Path(cache_dir or cache_root() / "rl-warm-start") / f"{task}-sft-{key}"
    if (target / "config.json").exists():
        return str(target)
    start = time.perf_counter()
    base_path = resolve_model_path(base)
    template = Template(model_id=base_path)
    rows = _sft_rows(template, arithmetic_prompts("train", task=task), task)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TransformersModel(model_id=base_path)
        model.set_optimizer("AdamW", lr=lr, weight_decay=0.0)
        order, rng = [], random.Random(seed)
        bar = tqdm(range(steps), desc="warm-start SFT", unit="step", disable=None)  # quiet off a terminal
        for step in bar:
            if len(order) < batch_size:
                order += rng.sample(range(len(rows)), len(rows))
            batch, order = [rows[i] for i in order[:batch_size]], order[batch_size:]
            out = model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
            bar.set_postfix(loss=f"{out['loss']:.3f}", refresh=False)
            if log and (step + 1) % max(1, steps // 5) == 0:
                log(
                    f"  warm-start SFT step {step + 1}/{steps}: loss {out['loss']:.3f} "
                    f"({time.perf_counter() - start:.0f}s)"
                )
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save(staging)
    template.tokenizer.save_pretrained(staging)
    shutil.copy(Path(base_path) / "generation_config.json", staging / "generation_config.json")
    try:
        os.rename(staging, target)
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def greedy_scores(sampler, prompt_rows, reward, adapter_name=None, max_tokens: int = 8) -> dict[str, float]:
    """`reward_metrics` (total and per component) of greedy answers to `prompt_rows`."""
    from twinkle.rl.metrics import reward_metrics
    from twinkle.rl.rollout import sample_rollout

    rollout = sample_rollout(
        sampler,
        prompt_rows,
        {"max_tokens": max_tokens, "temperature": 0.0, "num_samples": 1},
        adapter_name=adapter_name,
    )
    return reward_metrics(reward(rollout.texts, rollout.reward_rows()))


def greedy_accuracy(sampler, prompt_rows, adapter_name=None, reward=None, max_tokens: int = 8) -> float:
    """Mean reward (default: arithmetic exact match) of greedy answers to `prompt_rows`."""
    from twinkle.reward import ArithmeticAccuracy
    from twinkle.rl.rollout import sample_rollout

    rollout = sample_rollout(
        sampler,
        prompt_rows,
        {"max_tokens": max_tokens, "temperature": 0.0, "num_samples": 1},
        adapter_name=adapter_name,
    )
    result = (reward or ArithmeticAccuracy())(rollout.texts, rollout.reward_rows())
    return sum(result.values) / len(result)
