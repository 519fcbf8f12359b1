"""`twinkle-server` as its own process for the benchmarks that compare serving with local mode.

The server runs in a separate process, as users run it, on purpose: in one process, torch ops run
from a second thread after the main thread has run torch ops are ~25% slower (measured on 2 cores:
per-op overhead of small elementwise ops doubles once a second OpenMP thread team exists), which is
a cost of sharing a process with the benchmark's local side, not of serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def start_server(model: str, n_keys: int, **config) -> tuple[subprocess.Popen, str, list[str]]:
    """`twinkle-server` on a free loopback port with a fresh data dir (`config`: more server config keys);
    returns (process, url, keys)."""
    import httpx

    from twinkle.serve import free_port

    data_dir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    cli = [sys.executable, "-m", "twinkle_server.cli"]
    keys = [
        subprocess.run(
            [*cli, "keys", "create", f"bench{i}", "--data-dir", str(data_dir)],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
        for i in range(n_keys)
    ]
    (data_dir / "config.json").write_text(json.dumps({"models": [{"name": model}], **config}))
    port = free_port()
    proc = subprocess.Popen(
        [
            *cli,
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            "--config",
            str(data_dir / "config.json"),
            "--log-level",
            "warning",
        ]
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"twinkle-server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": keys[0]}).status_code == 200:
                return proc, url, keys
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("twinkle-server did not become healthy within 300 s")
