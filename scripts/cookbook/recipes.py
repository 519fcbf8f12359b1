"""The recipes `nox -s cookbook` runs: each with its own defaults, only sizes (batch, group, steps, the
generation budget where a recipe samples thousands of tokens per turn, the local data's size) and data
paths overridden, plus where it logs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import data

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Recipe:
    module: str  # a cookbook module run as __main__, or one of our check scripts (a .py path)
    sizes: tuple[str, ...] = ()
    prepare: Callable[[Path], list[str]] | None = None  # writes local data into the working folder -> args
    setup: tuple[str, ...] = ()  # a module run first in the same folder (its args after it)
    needs_setup: bool = True  # False: the recipe runs on local data even when its setup fails
    log_args: Callable[[Path], list[str]] = lambda log: [f"log_path={log}", "behavior_if_log_dir_exists=delete"]
    report: Callable[[Path, Path], dict] = lambda log, work: train_steps(log, work)  # numbers (log, work folder)
    capture: bool = False  # inside the cookbook's capture_to_store (tinker_cookbook/capture)


def metrics(log: Path) -> list[dict]:
    path = next(log.rglob("metrics.jsonl"), None)
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path else []


def sampler_trainer_kl(log: Path, work: Path) -> dict:
    """rl_numerics_check's sampler/trainer KL per step (mean over sampled tokens of sampler - trainer
    log-prob, and half the mean squared difference), as the recipe logs it."""
    rows = [r for r in metrics(log) if "optim/kl_sample_train_v1" in r]
    return train_steps(log, work) | {
        "kl_sample_train_v1": [r["optim/kl_sample_train_v1"] for r in rows],
        "kl_sample_train_v2": [r.get("optim/kl_sample_train_v2") for r in rows],
    }


def train_steps(log: Path, work: Path) -> dict:  # noqa: ARG001 - every recipe's report(log, work)
    """How many steps the recipe logged (a recipe can exit 0 having trained nothing)."""
    return {"steps_logged": len(metrics(log))}


def teacher_rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


RL = ("eval_every=0", "save_every=0")
RECIPES: dict[str, Recipe] = {
    "math_rl": Recipe(
        "tinker_cookbook.recipes.math_rl.train", ("groups_per_batch=2", "group_size=2", "max_steps=2", *RL)
    ),
    "rubric": Recipe(
        "tinker_cookbook.recipes.rubric.train",
        ("groups_per_batch=2", "train_group_size=2", "max_steps=2", *RL),
        setup=("tinker_cookbook.recipes.rubric.generate_data",),
    ),
    "guess_number": Recipe(
        "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
        ("batch_size=2", "group_size=2", "max_steps=1", *RL),
    ),
    "twenty_questions": Recipe(
        "tinker_cookbook.recipes.multiplayer_rl.twenty_questions.train",
        ("batch_size=2", "group_size=2", "max_steps=1", *RL),
    ),
    "text_arena": Recipe(
        "tinker_cookbook.recipes.multiplayer_rl.text_arena.train",
        ("batch_size=2", "num_train_datapoints=4", "num_test_datapoints=2", "max_steps=1", *RL),
    ),
    "prompt_distillation": Recipe(
        "tinker_cookbook.recipes.prompt_distillation.train",
        ("batch_size=2", "max_steps=2", "eval_every=0", "save_every=0"),
        prepare=data.multilingual,
        setup=("tinker_cookbook.recipes.prompt_distillation.create_data", "output_file=distill.jsonl"),
        needs_setup=False,
        report=lambda log, work: train_steps(log, work) | {"teacher_rows": teacher_rows(work / "distill.jsonl")},
    ),
    "decisions": Recipe(
        "tinker_cookbook.recipes.decisions.forecasting",
        ("batch_size=2", "max_steps=2", "max_train_questions=4", "max_validation_questions=4", "eval_every=0"),
        prepare=data.prophet_arena,
    ),
    "verifiers_rl": Recipe(
        "tinker_cookbook.recipes.verifiers_rl.train",
        ("groups_per_batch=2", "group_size=2", "max_steps=1", "dataset_n=4", "max_tokens=64", *RL),
    ),
    "sdft": Recipe(
        "tinker_cookbook.recipes.sdft.train",
        ("groups_per_batch=2", "max_steps=1", "max_tokens=64", *RL),
        prepare=data.sciknoweval,
    ),
    "rl_numerics_check": Recipe(
        "tinker_cookbook.recipes.rl_numerics_check.train",
        (
            "groups_per_batch=1",
            "group_size=2",
            "max_steps=2",
            "task.num_pages_min=2",
            "task.num_pages_max=3",
            "task.page_chars=2000",
            "max_tokens=64",
            "save_every=0",
        ),
        prepare=data.wikitext,
        report=sampler_trainer_kl,
    ),
    "distillation": Recipe(
        "tinker_cookbook.recipes.distillation.on_policy_distillation",
        ("groups_per_batch=2", "group_size=2", "max_steps=1", "max_tokens=64", *RL),
        prepare=data.deepmath,
    ),
    "vlm_classifier": Recipe(
        "tinker_cookbook.recipes.vlm_classifier.train",
        ("batch_size=2", "max_steps=2", "n_eval=2", "eval_every=0", "save_every=0", "infrequent_eval_every=0"),
        prepare=data.caltech101,
        log_args=lambda log: [f"experiment_dir={log}", "behavior_if_log_dir_exists=delete"],
    ),
    "capture": Recipe(
        "tinker_cookbook.recipes.math_rl.train",
        ("groups_per_batch=2", "group_size=2", "max_steps=2", *RL),
        capture=True,
    ),
    "weights": Recipe(
        str(HERE / "weights_check.py"),
        log_args=lambda log: [str(log)],
        report=lambda log, work: (  # noqa: ARG005 - every recipe's report(log, work)
            json.loads((log / "result.json").read_text()) if (log / "result.json").exists() else {}
        ),
    ),
}

# Recipes that need what this machine cannot reach, with what they need.
NETWORK = {
    "audio": "hub audio datasets",
    "chat_sl": "hub chat datasets (tulu3, no_robots)",
    "code_rl": "hub datasets and a code sandbox",
    "forecasting": "hub forecasting dataset",
    "harbor_rl": "Harbor task containers",
    "preference": "hub preference datasets",
    "search_tool": "web search and a hub dataset",
    "true_thinking_score": "hub datasets",
    "rl_basic": "the gsm8k hub dataset",
    "rl_loop": "the gsm8k hub dataset",
    "sl_basic": "a hub chat dataset",
    "sl_loop": "a hub chat dataset",
}
