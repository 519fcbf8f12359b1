"""Every shell command the README, docs/ and the examples' and benchmarks' docstrings show runs as
written from a fresh clone: `uv run ...` in the checkout, with nothing installed beforehand.

Commands are read from the ```bash blocks of README.md and docs/*.md and from the indented command lines of every
`examples/*.py` and `benchmarks/bench_*.py` docstring. Each one must be listed in HOW, which says how
this test runs it: `run` (as written, it must exit 0 within its time), `help` (as written plus
`--help`: the environment resolves, the script imports and parses; for jobs of several minutes),
or a reason it is not run here. A new command with no entry fails the test, so documentation
cannot drift from what works.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUN, HELP = "run", "help"
HOW = {
    "uv run examples/quickstart.py": RUN,
    "uvx nox": "this is the test command itself",
    "uv run twinkle-server keys create alice --data-dir ./twinkle-data": RUN,
    "uv run twinkle-server --port 8000 --data-dir ./twinkle-data": "server",
    "uv run examples/dpo.py": HELP,
    "uv run examples/gkd.py": HELP,
    "uv run examples/grpo.py": HELP,
    "uv run examples/grpo_async.py": HELP,
    "uv run examples/grpo_async.py --mode ray": HELP,
    "uv run examples/multi_tenant.py": HELP,
    "uv run examples/multi_tenant.py --model twinkle://qwen3-tiny --steps 6": RUN,
    "uv run examples/multi_tenant.py --base-url http://127.0.0.1:8000": HELP,
    "uv run examples/multi_tenant.py --rl-steps 100": HELP,
    "uv run python examples/sft.py": RUN,
    "uv run torchrun --nproc_per_node=2 examples/sft.py": RUN,
    "uv run examples/sft_any_mode.py": RUN,
    "uv run examples/vlm_sft.py": HELP,
    "uv run examples/vlm_sft.py --train-vision projector,tower": HELP,
    "uv run torchrun --nproc_per_node=2 examples/sft_any_mode.py": RUN,
    "TWINKLE_MODE=ray uv run examples/sft_any_mode.py": RUN,
    "uv run ray start --head --port=6379 --num-cpus=1": "needs two hosts: nox -s ray_cluster runs them on one machine",
    "uv run ray start --address=HOST_A:6379 --num-cpus=1": "needs two hosts: nox -s ray_cluster runs them on one machine",
    "uv run twinkle-server --port 8000 --data-dir ./twinkle-data --config two-hosts.toml": "needs the two-host Ray cluster above: nox -s ray_cluster runs the same on one machine",
    "uv run twinkle-server keys usage --data-dir ./twinkle-data": RUN,
    "uv run twinkle-server keys set-quota alice --tokens-per-day 1000000 --storage-bytes 500000000 --adapters 4 --data-dir ./twinkle-data": "needs key alice in that data dir: apps/twinkle-server/tests/test_server_cli.py sets quotas the same way",
    "uv run twinkle export --merge ./my-adapter ./my-model": "needs a trained checkpoint: packages/twinkle-serve/tests/test_openai_api.py runs the same CLI on a server checkpoint",
    "uv run python benchmarks/bench_multi_lora_fused.py --model twinkle://qwen3-moe-tiny": HELP,
    "uv run python benchmarks/bench_client_native.py": HELP,
    "uv run python benchmarks/bench_client_native.py --model twinkle://qwen3-demo --steps 12 --rounds 3": HELP,
    "uvx nox -s bench -- bench_peer_trl_sft bench_peer_trl_grpo bench_peer_skyrl_serve bench_cpu_bf16_peak": "builds the peers' venvs and measures for tens of minutes: each benchmark's docstring command is checked with --help",
    "uv run python benchmarks/bench_peer_trl_grpo.py --seeds 1": HELP,
    "uv run python benchmarks/bench_peer_trl_sft.py --precision bf16": HELP,
    "uv run python benchmarks/bench_peer_trl_sft.py --compile": HELP,
    "uv run python benchmarks/bench_mfu.py --precision bf16": HELP,
    "uv run python benchmarks/bench_long_context.py --model twinkle://qwen3-0.6b-shape --lengths 32768 --cp 1": HELP,
    "TWINKLE_MODE=http TWINKLE_BASE_URL=http://127.0.0.1:8000 TWINKLE_API_KEY=tml-... uv run examples/sft_any_mode.py": "needs a running server and a key: tests/test_serve_native_any_mode.py runs this mode",
    "TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... uv run examples/tinker_grpo_resume.py --checkpoint-dir ckpt": "needs a running server and a key: tests/reliability/test_reliability_rl_resume.py runs it, killed and resumed",
    "TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... uv run examples/tinker_grpo_resume.py --checkpoint-dir ckpt --resume": "needs a running server and a key: tests/reliability/test_reliability_rl_resume.py runs it, killed and resumed",
}
# Benchmarks measure for minutes: each is checked with --help (its full run is `nox -s bench`).
TIMEOUT_S = {RUN: 420, HELP: 180, "server": 180}


def _docstring_commands(path: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    found = []
    for line in doc.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if re.match(r"^([A-Z_]+=\S+ )*(uv |uvx |python |torchrun )", line):
            found.append(re.sub(r"\s*\[[^\]]*\]", "", line))  # [--steps 8]: optional arguments
    return found


def _markdown_commands(path: Path) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
    return [
        re.sub(r"\s+#.*$", "", line).strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def all_commands() -> list[tuple[str, str]]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [(str(doc.relative_to(ROOT)), c) for doc in docs for c in _markdown_commands(doc)]
    for path in sorted([*ROOT.glob("examples/*.py"), *ROOT.glob("benchmarks/bench_*.py")]):
        found += [(str(path.relative_to(ROOT)), c) for c in _docstring_commands(path)]
    return found


def how(command: str) -> str | None:
    if command in HOW:
        return HOW[command]
    if re.fullmatch(r"uv run (python )?benchmarks/bench_\w+\.py", command):
        return HELP
    return None


def test_every_documented_command_starts_from_uv_and_has_an_entry():
    commands = all_commands()
    assert len(commands) >= 20
    bare = [(src, c) for src, c in commands if not re.match(r"^([A-Z_]+=\S+ )*uvx? ", c)]
    assert not bare, f"not runnable from a fresh clone (start it with `uv run`): {bare}"
    unknown = [(src, c) for src, c in commands if how(c) is None]
    assert not unknown, f"add these to HOW in {Path(__file__).name}: {unknown}"


def _env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}
    # Jobs that write results are pointed at scratch space, so the checkout stays clean.
    return {**env, "TWINKLE_SFT_OUTPUT": str(tmp_path / "sft"), "TINKER_TELEMETRY": "0"}


def _shell(command: str, cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    assert shutil.which("uv"), "uv is not on PATH (the README's first step: pip install uv)"
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _scratch(tmp_path: Path) -> Path:
    # Inside the checkout (so `uv run` finds the project), in a folder git ignores.
    # Unique per call: under xdist two workers' tmp_path can share a name.
    (ROOT / "out").mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"readme-{tmp_path.name}-", dir=ROOT / "out"))


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


WARNING = re.compile(r"(DeprecationWarning|FutureWarning|is deprecated)")


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted({c for _, c in all_commands() if how(c) in (RUN, HELP, "server")}))
def test_documented_command_runs_as_written(command, tmp_path):
    mode = how(command)
    env = _env(tmp_path)
    if mode == "server":
        if not _port_free(8000):
            pytest.skip("port 8000 is taken on this machine")
        cwd = _scratch(tmp_path)
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + TIMEOUT_S[mode]
            while _port_free(8000):
                assert proc.poll() is None, proc.stdout.read()[-3000:]
                assert time.monotonic() < deadline, "the server did not open port 8000"
                time.sleep(0.5)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(cwd, ignore_errors=True)
        return
    cwd = _scratch(tmp_path) if "twinkle-server" in command else ROOT
    out = _shell(command + (" --help" if mode == HELP else ""), cwd, env, TIMEOUT_S[mode])
    if cwd != ROOT:
        shutil.rmtree(cwd, ignore_errors=True)
    assert out.returncode == 0, f"{command!r} exited {out.returncode}:\n{(out.stdout + out.stderr)[-4000:]}"
    if mode == HELP:
        assert "usage:" in out.stdout, out.stdout[-2000:]
    else:
        warnings = [line for line in (out.stdout + out.stderr).splitlines() if WARNING.search(line)]
        assert not warnings, f"{command!r} printed deprecation warnings: {warnings}"
    if command == "uv run examples/quickstart.py":
        _check_quickstart(out.stdout, ROOT / "out" / "quickstart-lora")


def _check_quickstart(stdout: str, saved: Path) -> None:
    """The main job must visibly learn, answer as tuned, and leave a PEFT folder."""
    curve = [float(x) for x in re.search(r"loss curve: (.*)", stdout).group(1).split()]
    assert curve[-1] < curve[0] - 2.0, curve
    answers = re.findall(r"Q: (.*)\n  base : '(.*)'\n  tuned: '(.*)'", stdout)
    assert len(answers) == 3
    for question, base, tuned in answers:
        assert tuned == "I am Glimmer, an AI assistant developed by Lantern Labs.", (question, tuned)
        assert base != tuned
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["peft_type"] == "LORA"
    assert (saved / "adapter_model.safetensors").stat().st_size > 0
