"""The embedded model builds right from any process: torchrun ranks, Ray actors, several at once,
each starting from an empty cache; a damaged cache folder is rebuilt, not trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from twinkle.hub import TEST_MODEL, embedded_path
from twinkle.hub.cache_folder import MANIFEST, problems
from twinkle.hub.embedded import PINNED_WEIGHTS, weights_digest

# Each process: (optionally) join a gloo group first, exactly the state in which transformers'
# save_pretrained writes nothing on rank 1; then resolve, load, and report what it saw.
WORKER = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    if os.environ.get("WORLD_SIZE"):
        dist.init_process_group("gloo")
    import twinkle.hub.embedded as embedded
    real = embedded.write_folder
    def counted(name, folder):
        with open(os.environ["BUILD_LOG"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        real(name, folder)
    embedded.write_folder = counted
    from transformers import AutoModelForCausalLM
    path = embedded.embedded_path("twinkle://qwen3-tiny")
    model = AutoModelForCausalLM.from_pretrained(path)
    print(json.dumps({"path": str(path), "params": sum(p.numel() for p in model.parameters())}))
""")


def _env(cache: Path) -> dict:
    return {**os.environ, "TWINKLE_CACHE": str(cache), "BUILD_LOG": str(cache / "builds.log"), "OMP_NUM_THREADS": "1"}


def _reports(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _assert_one_complete_build(cache: Path, reports: list[dict], n: int) -> None:
    assert len(reports) == n and len({r["path"] for r in reports}) == 1, reports
    folder = Path(reports[0]["path"])
    assert problems(folder) == []
    assert weights_digest(folder / "model.safetensors") == PINNED_WEIGHTS["qwen3-tiny"]
    assert len((cache / "builds.log").read_text().split()) == 1, "more than one process built it"
    assert not [p for p in folder.parent.iterdir() if p.is_dir() and p.name.startswith(".")]


@pytest.mark.slow
def test_two_torchrun_ranks_from_an_empty_cache(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(script)],
        env=_env(cache),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_one_complete_build(cache, _reports(out.stdout), 2)


@pytest.mark.slow
def test_three_plain_processes_at_once(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER], env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    _assert_one_complete_build(cache, [r for out, _ in outs for r in _reports(out)], 3)


@pytest.mark.slow
def test_two_ray_actors_in_a_gloo_group_from_an_empty_cache(tmp_path):
    ray = pytest.importorskip("ray")
    cache = tmp_path / "cache"
    cache.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)

    @ray.remote(num_cpus=1)
    class Rank:
        def run(self, rank: int, port: int) -> str:
            env = {
                **_env(cache),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            # The actor itself joins the group and builds: this is the Ray mode's own state.
            os.environ.update(env)
            namespace: dict = {}
            import contextlib
            import io

            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(WORKER, "worker", "exec"), namespace)
            return buf.getvalue()

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actors = [Rank.remote() for _ in range(2)]
        outs = ray.get([a.run.remote(r, port) for r, a in enumerate(actors)], timeout=300)
    finally:
        ray.shutdown()
    _assert_one_complete_build(cache, [r for out in outs for r in _reports(out)], 2)


@pytest.mark.parametrize("damage", ["delete config.json", "truncate weights", "flip a tokenizer byte", "no manifest"])
def test_a_damaged_cache_folder_is_rebuilt_on_next_use(tmp_path, monkeypatch, damage):
    from twinkle.hub import cache_folder

    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path))
    folder = embedded_path(TEST_MODEL)
    good = {p.name: p.read_bytes() for p in folder.iterdir()}
    if damage == "delete config.json":
        (folder / "config.json").unlink()
    elif damage == "truncate weights":
        with open(folder / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    elif damage == "flip a tokenizer byte":  # same size: only the sha256 can tell
        data = bytearray((folder / "tokenizer.json").read_bytes())
        data[100] ^= 1
        (folder / "tokenizer.json").write_bytes(bytes(data))
    else:
        (folder / MANIFEST).unlink()
    monkeypatch.setattr(cache_folder, "_VERIFIED", set())  # as a new process would see it
    assert problems(folder) != []
    assert embedded_path(TEST_MODEL) == folder
    assert problems(folder) == []
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == good
