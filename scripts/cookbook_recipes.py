"""Run tinker-cookbook 0.6.1's recipes against a real twinkle-server, each for 1-2 steps (`nox -s cookbook`).

Every recipe keeps its own defaults (model names, loss, renderer, max_tokens, ...); only sizes are
overridden (batch, group, steps, generated data), plus data paths and where it logs (scripts/cookbook/:
the server with the recipes' model names as aliases, the table, the local data, the capture/ and
weights/ checks).

    python scripts/cookbook_recipes.py [RECIPE ...]      # none named: all of RECIPES
Prints one line per recipe and a final JSON line {"recipes": {name: {"status", "reason", "seconds", ...}}}.
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

sys.path.insert(0, str(Path(__file__).resolve().parent / "cookbook"))

import server
from recipes import NETWORK, RECIPES, Recipe


def last_error(text: str) -> str:
    """The exception line of a traceback (or the last non-empty line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception"))]
    return (errors or lines or ["(no output)"])[-1][:300]


def run(cmd: list[str], env: dict, cwd: Path, timeout: float, log: Path) -> tuple[bool, str]:
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        log.write_text(_text(e.stdout) + _text(e.stderr))
        return False, f"did not finish within {timeout:.0f} s"
    out = p.stdout + p.stderr
    log.write_text(out)
    return p.returncode == 0, "" if p.returncode == 0 else last_error(out)


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def run_recipe(name: str, recipe: Recipe, served: server.Served, root: Path, timeout: float) -> dict:
    start = time.time()
    work = server.recipe_folder(root, name, served)
    env = server.recipe_env(served)
    if recipe.capture:
        env["COOKBOOK_CAPTURE"] = f"{name}={work / 'capture-store'}"
    args = recipe.prepare(work) if recipe.prepare else []
    ok, reason, extra = True, "", {}
    if recipe.setup:
        budget = timeout if recipe.needs_setup else timeout / 3  # an optional setup leaves the recipe its time
        cmd = server.boot_command(recipe.setup[0], list(recipe.setup[1:]))
        ok, reason = run(cmd, env, work, budget, root / f"{name}.setup.log")
        reason = reason and f"setup {recipe.setup[0].rsplit('.', 1)[-1]}: {reason}"
        if not ok and not recipe.needs_setup:
            ok, reason, extra = True, "", {"setup": reason}
    log = root / "logs" / name
    if ok:
        cmd = server.boot_command(recipe.module, [*recipe.sizes, *args, *recipe.log_args(log)])
        left = timeout - (time.time() - start) if recipe.needs_setup else timeout
        ok, reason = run(cmd, env, work, max(60.0, left), root / f"{name}.log")
    result = {
        "status": "works" if ok else "refused",
        "reason": reason,
        "seconds": round(time.time() - start, 1),
        **extra,
    }
    if log.exists():
        result.update(recipe.report(log, work))
    if ok and result.get("steps_logged") == 0:  # exited 0 but trained nothing
        result.update(status="refused", reason="exited 0 without logging a training step")
    if recipe.capture:
        import capture_check

        result.update(capture_check.summary(work / "capture-store", name, log))
    return result


def main(names: list[str]) -> None:
    names = names or list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        sys.exit(f"unknown recipe(s) {unknown}; known: {sorted(RECIPES)}")
    root = Path(tempfile.mkdtemp(prefix="cookbook-"))
    srv, served = server.start(root)
    results = {}
    try:
        for name in names:
            timeout = float(os.environ.get("COOKBOOK_TIMEOUT_S", "900"))
            results[name] = run_recipe(name, RECIPES[name], served, root, timeout)
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    finally:
        srv.stop()
        keep = os.environ.get("COOKBOOK_KEEP")
        if keep:
            shutil.copytree(root, keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("data"), symlinks=True)
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"recipes": results, "needs_network": NETWORK}))


if __name__ == "__main__":
    main(sys.argv[1:])
