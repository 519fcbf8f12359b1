"""Run tinker-cookbook 0.6.1's recipes against a real twinkle-server, each for 1-2 steps (`nox -s cookbook`).

Every recipe keeps its own defaults (model names, loss, renderer, max_tokens, ...); only sizes are
overridden (batch, group, steps), plus where it logs. The server serves the embedded demo model under
each base-model name the recipes default to (an operator may name a model anything), with a 32,768
context (RoPE; the tiny model is not good there, only served), so no recipe needs its model name
changed. The cookbook loads tokenizers by name from the Hugging Face hub, which is not reachable here:
each recipe process registers the served folder's tokenizer under those names first, through the
cookbook's own `tokenizer_utils.register_tokenizer` (no cookbook or SDK patch).

    python scripts/cookbook_recipes.py [RECIPE ...]      # none named: all of RECIPES
Prints one line per recipe and a final JSON line {"recipes": {name: {"status", "reason", "seconds"}}}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The base-model names the recipes default to (their CLIConfig.model_name / grader / teacher fields).
SERVED_NAMES = ["Qwen/Qwen3.5-9B", "Qwen/Qwen3.6-35B-A3B", "Qwen/Qwen3-8B", "Qwen/Qwen3.5-4B", "Qwen/Qwen3.5-9B-Base"]
CONTEXT = 32768

# recipe -> (module, size overrides, setup module run first or None). Recipes needing the network
# (hub datasets, web search, sandboxes, API models) are listed in NETWORK with the reason.
RECIPES = {
    "math_rl": (
        "tinker_cookbook.recipes.math_rl.train",
        ["groups_per_batch=2", "group_size=2", "max_steps=2", "eval_every=0", "save_every=0"],
        None,
    ),
    "rubric": (
        "tinker_cookbook.recipes.rubric.train",
        ["groups_per_batch=2", "train_group_size=2", "max_steps=2", "eval_every=0", "save_every=0"],
        "tinker_cookbook.recipes.rubric.generate_data",
    ),
    "guess_number": (
        "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
        ["batch_size=2", "group_size=2", "max_steps=2", "eval_every=0", "save_every=0"],
        None,
    ),
    "twenty_questions": (
        "tinker_cookbook.recipes.multiplayer_rl.twenty_questions.train",
        ["batch_size=2", "group_size=2", "max_steps=2", "eval_every=0", "save_every=0"],
        None,
    ),
    "rl_numerics_check": (
        "tinker_cookbook.recipes.rl_numerics_check.train",
        ["groups_per_batch=2", "group_size=2", "max_steps=2"],
        None,
    ),
}
NETWORK = {
    "audio": "hub audio datasets",
    "chat_sl": "hub chat datasets (tulu3, no_robots)",
    "code_rl": "hub datasets and a code sandbox",
    "distillation": "hub prompt datasets",
    "forecasting": "hub forecasting dataset",
    "harbor_rl": "Harbor task containers",
    "preference": "hub preference datasets",
    "sdft": "hub datasets",
    "search_tool": "web search and a hub dataset",
    "true_thinking_score": "hub datasets",
    "verifiers_rl": "the verifiers package's hub environments",
    "vlm_classifier": "hub image datasets",
    "rl_basic": "the gsm8k hub dataset",
    "rl_loop": "the gsm8k hub dataset",
    "sl_basic": "a hub chat dataset",
    "sl_loop": "a hub chat dataset",
}

# Run in each recipe process before the recipe: the served folder's tokenizer under every served name.
BOOT = """
import os, runpy, sys
from transformers import AutoTokenizer
from tinker_cookbook import tokenizer_utils
folder = os.environ["COOKBOOK_TOKENIZER"]
for name in os.environ["COOKBOOK_NAMES"].split(","):
    tokenizer_utils.register_tokenizer(name, lambda: AutoTokenizer.from_pretrained(folder))
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def serving_folder(root: Path) -> Path:
    """The embedded demo model with a 32K context: its files linked, its config's context raised."""
    from twinkle.hub import DEFAULT_MODEL, resolve_model_path

    src, dst = Path(resolve_model_path(DEFAULT_MODEL)), root / "demo-32k"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def last_error(text: str) -> str:
    """The exception line of a traceback (or the last non-empty line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception"))]
    return (errors or lines or ["(no output)"])[-1][:300]


def run_recipe(name: str, env: dict, workdir: Path, timeout: float) -> dict:
    module, sizes, setup = RECIPES[name]
    start = time.time()
    if setup:  # rubric's generate_data writes under ./tinker_cookbook/example_data/, where train reads
        (workdir / "tinker_cookbook" / "example_data").mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", BOOT, setup], env=env, cwd=workdir, capture_output=True, timeout=600)
    log = workdir / "logs" / name
    args = [*sizes, f"log_path={log}", "behavior_if_log_dir_exists=delete"]
    try:
        p = subprocess.run(
            [sys.executable, "-c", BOOT, module, *args],
            env=env,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        out = p.stdout + p.stderr
        (workdir / f"{name}.log").write_text(out)
        ok = p.returncode == 0
        reason = "" if ok else last_error(out)
    except subprocess.TimeoutExpired:
        ok, reason = False, f"did not finish within {timeout:.0f} s"
    return {"status": "works" if ok else "refused", "reason": reason, "seconds": round(time.time() - start, 1)}


def main(names: list[str]) -> None:
    import twinkle.serve as ts

    names = names or list(RECIPES)
    root = Path(tempfile.mkdtemp(prefix="cookbook-"))
    folder = serving_folder(root)
    models = [{"name": n, "path": str(folder)} for n in SERVED_NAMES]
    srv = ts.initialize(
        mode="http", port=0, data_dir=root / "data", config={"models": models}, block=False, log_level="warning"
    ).wait_ready()
    env = {
        **os.environ,
        "TINKER_BASE_URL": srv.url,
        "TINKER_API_KEY": srv.create_key("cookbook"),
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "COOKBOOK_TOKENIZER": str(folder),
        "COOKBOOK_NAMES": ",".join(SERVED_NAMES),
        "WANDB_MODE": "disabled",
    }
    results = {}
    try:
        for name in names:
            results[name] = run_recipe(name, env, root, float(os.environ.get("COOKBOOK_TIMEOUT_S", "900")))
            print(f"{name}: {results[name]['status']} {results[name]['reason']}", flush=True)
    finally:
        srv.stop()
        keep = os.environ.get("COOKBOOK_KEEP")
        if keep:
            shutil.copytree(root, keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("data"))
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"recipes": results, "needs_network": NETWORK}))


if __name__ == "__main__":
    main(sys.argv[1:])
