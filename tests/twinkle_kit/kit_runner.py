"""Run one covered twinkle-kit script (rewritten) in a subprocess, and check what it left behind.

Used by test_twinkle_kit_scripts.py and by scripts/twinkle_kit_compat.py (which writes the table).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import kit_rewrite
from kit_scripts import KitScript

HERE = Path(__file__).parent
TIMEOUT_S = 900


@dataclass
class Outcome:
    status: str  # 'runs' | 'refused' | 'needs'
    detail: str
    output: str
    workdir: Path


def start_server(data_dir):
    """A real twinkle-server (uvicorn on a free loopback port) serving the embedded test model."""
    import twinkle.serve as ts
    from twinkle.hub import TEST_MODEL

    config = {"models": [{"name": TEST_MODEL}]}
    return ts.initialize(
        mode="http", port=0, data_dir=data_dir, config=config, block=False, log_level="warning"
    ).wait_ready()


def missing_modules(script: KitScript) -> list[str]:
    return [m for m in script.needs if importlib.util.find_spec(m) is None]


def command(script: KitScript, path: Path, model: str) -> list[str]:
    flags = kit_rewrite.rewrite_flags(list(script.args), dict(script.flag_sizes), model=model)
    if script.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(path), *flags]
    return [sys.executable, str(path), *flags]


def run(
    script: KitScript, workdir: Path, model: str, server_env: dict[str, str] | None = None, source: str | None = None
) -> Outcome:
    """`source`: the script's text when it is not ours (twinkle-kit's own, from its sdist)."""
    workdir.mkdir(parents=True, exist_ok=True)
    missing = missing_modules(script)
    if missing:
        return Outcome("needs", f"needs {', '.join(missing)} installed (the script imports it)", "", workdir)
    if source is None:
        source = (HERE / "scripts" / f"{script.name}.py").read_text()
    path = workdir / f"{script.name}.py"
    path.write_text(kit_rewrite.rewrite(source, list(script.sizes), model=model))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TINKER_TELEMETRY": "0",
        "PYTHONUNBUFFERED": "1",
        **(server_env or {}),
    }
    env.pop("TWINKLE_MODEL_ID", None)  # the scripts' own default is what the rewrite replaced
    proc = subprocess.run(
        command(script, path, model), cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = proc.stdout + proc.stderr
    if proc.returncode:
        return Outcome("refused", last_error(output), output, workdir)
    return Outcome("runs", "", output, workdir)


def last_error(output: str) -> str:
    """The exception line a failed script ended with (`Type: message`)."""
    lines = [line for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Refused", "NotImplementedError")) and " " not in head.strip():
            return line.strip()[:300]
    return (lines[-1] if lines else "no output")[:300]
