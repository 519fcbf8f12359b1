"""A real two-node Ray cluster on this machine: `ray start --head` and a second `ray start --address`
node, one CPU each, with their own temp dir, ports and auth token. Whatever happens in the tests,
every process of this cluster (and only of this one) is killed at the end."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Before Ray is imported here: it reads the auth mode and token once per process. This process is
# the server's Ray driver; the `ray start`s inherit the same token.
os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)})
pytest.importorskip("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(args: list[str], env: dict) -> None:
    cmd = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--num-cpus=1",
        "--disable-usage-stats",
        f"--dashboard-agent-listen-port={_free_port()}",
        *args,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _kill_cluster(temp: Path) -> None:
    """Every process whose command line names this cluster's temp dir (GCS, raylets, agents), and
    their children (the actors): never another cluster on the machine, so no `ray stop`."""
    import psutil

    mine = [p for p in psutil.process_iter(["cmdline"]) if any(str(temp) in c for c in (p.info["cmdline"] or ()))]
    victims = {p.pid: p for p in mine}
    for p in mine:
        with contextlib.suppress(psutil.NoSuchProcess):
            victims.update({c.pid: c for c in p.children(recursive=True)})
    for p in victims.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(list(victims.values()), timeout=10)


@pytest.fixture(scope="session")
def two_nodes():
    """-> the head's address."""
    import ray

    assert not ray.is_initialized(), "this process is already attached to a Ray cluster"
    temp = Path(tempfile.mkdtemp(prefix="tw-ray-", dir="/tmp"))  # short: Ray's unix sockets live under it
    env, port = dict(os.environ), _free_port()
    try:
        _ray_start(
            [
                "--head",
                f"--port={port}",
                "--include-dashboard=false",
                f"--temp-dir={temp}",
                '--resources={"head_node": 1}',
            ],
            env,
        )
        _ray_start([f"--address=127.0.0.1:{port}", '--resources={"second_node": 1}'], env)
        yield f"127.0.0.1:{port}"
    finally:
        _kill_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)
