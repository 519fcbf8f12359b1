"""Peer tools (TRL, SkyRL) in venvs of their own, for the benchmarks that run them side by side with Twinkle.

A peer never shares Twinkle's venv: its pins would fight uv.lock, and a benchmark must not change what
Twinkle runs on. Each peer venv lives under out/peer-venvs/NAME (git ignores out/) and is rebuilt only
when its package list changes. Where the peer allows, torch / transformers / peft are pinned to the
versions this venv runs, which are uv.lock's, so both sides run the same kernels.

The peer side runs as a worker process that answers one JSON line per request on stdin/stdout, so a
benchmark can alternate the two sides step by step in one invocation.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / "out" / "peer-venvs"


def locked(*names: str) -> list[str]:
    """`name==version` for packages as this (uv.lock's) environment has them."""
    return [f"{n}=={version(n)}" for n in names]


def peer_python(name: str, packages: list[str], python: str | None = None) -> Path:
    """The interpreter of venv `name` with exactly `packages` installed (built on first use: minutes)."""
    venv = VENVS / name
    marker = venv / ".peer-packages.json"
    wanted = json.dumps({"python": python, "packages": packages})
    exe = venv / "bin" / "python"
    if marker.exists() and marker.read_text() == wanted and exe.exists():
        return exe
    uv = shutil.which("uv") or "uv"
    shutil.rmtree(venv, ignore_errors=True)
    print(f"[peer] building {venv.relative_to(ROOT)}: {' '.join(packages)}", file=sys.stderr, flush=True)
    subprocess.run([uv, "venv", "-q", str(venv), *(["--python", python] if python else [])], check=True)
    subprocess.run([uv, "pip", "install", "-q", "--python", str(exe), *packages], check=True)
    marker.write_text(wanted)
    return exe


def find_python(minor: str) -> str:
    """A Python `minor` interpreter to build a venv with: one on PATH that runs, a pyenv install, or
    (failing both) the bare version request, which uv answers by downloading a build."""
    for candidate in [
        shutil.which(f"python{minor}"),
        *sorted(Path.home().glob(f".pyenv/versions/{minor}*/bin/python{minor}")),
    ]:
        if candidate and subprocess.run([str(candidate), "-V"], capture_output=True).returncode == 0:
            return str(candidate)  # a pyenv shim for a version pyenv does not select fails here
    return minor


def uv_env(**extra: str) -> dict[str, str]:
    """This process's environment for a `uv` command on a peer's project: without the variables that
    name this process's own venv (nox sets them), which would make uv sync the peer into it."""
    own = ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")
    return {**{k: v for k, v in os.environ.items() if k not in own}, **extra}


def peer_project(name: str, pyproject: str, python: str) -> Path:
    """A uv project folder for a peer that must run under `uv run --project` (SkyRL starts its engine
    with the `uv run` flags it was started with), synced once per pyproject text."""
    folder = VENVS / name
    marker = folder / ".peer-synced"
    if marker.exists() and marker.read_text() == pyproject:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(pyproject)
    print(f"[peer] syncing {folder.relative_to(ROOT)}", file=sys.stderr, flush=True)
    uv = shutil.which("uv") or "uv"
    subprocess.run([uv, "sync", "-q", "--project", str(folder)], check=True, env=uv_env(UV_PYTHON=python))
    marker.write_text(pyproject)
    return folder


class Worker:
    """A peer-side process driven by JSON lines: `ask(request)` sends one and returns its answer."""

    def __init__(self, python: Path, script: Path, config: dict, env: dict | None = None):
        self.proc = subprocess.Popen(
            [str(python), str(script), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.ready = self._read()  # the worker's first line: it has built everything

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer worker exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def serve_requests(handle) -> None:
    """The worker's side of `Worker`: `handle(request) -> answer` for each stdin line until EOF."""
    for line in sys.stdin:
        print(json.dumps(handle(json.loads(line))), flush=True)
