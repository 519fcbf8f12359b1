"""The reliability suite's harness: the real `twinkle-server` CLI as a subprocess on a free loopback
port, keys made with `twinkle-server keys create`, a raw wire client with bounded timeouts, and a
summary table printed at the end of the session (the figures docs/reliability.md quotes).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")

HOST = "127.0.0.1"  # loopback only, always
SUMMARY: dict[str, str] = {}  # row label -> figure, filled by the tests, printed at the end


def _cli() -> list[str]:
    exe = shutil.which("twinkle-server", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "twinkle_server.cli"]


def create_key(data_dir: Path, name: str) -> str:
    out = subprocess.run(
        [*_cli(), "keys", "create", name, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def _keys_in_process(data_dir: Path, names) -> dict[str, str]:
    from twinkle.serve.core.store import Store
    from twinkle.serve.keys import KeyStore

    store = Store(data_dir)
    try:
        return {n: KeyStore(store).create(n) for n in names}
    finally:
        store.close()


def revoke_key(data_dir: Path, name: str) -> None:
    subprocess.run(
        [*_cli(), "keys", "revoke", name, "--data-dir", str(data_dir)], capture_output=True, timeout=120, check=True
    )


def server_env() -> dict[str, str]:
    """The server's environment. One torch thread: on 2 shared cores, with clients in the same machine,
    OpenMP's spin-waiting second thread starves the HTTP and scheduler threads (measured: an SDK step
    ~300 ms with 2 threads, ~28 ms with 1). Bytecode cached under the session's temp dir (not the venv),
    so the restarts of the crash test don't recompile torch and transformers each time (~12 s -> ~5 s)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("RELIABILITY_SERVER_THREADS", "1"),
        "PYTHONPYCACHEPREFIX": str(Path(tempfile.gettempdir()) / "twinkle-reliability-pycache"),
    }
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


class ServerProcess:
    """`twinkle-server --port P --data-dir D --config C` in its own process group (so kill -9 is real)."""

    def __init__(self, data_dir: Path, config: dict, probe_key: str):
        from twinkle.serve import free_port

        self.data_dir, self.probe_key = Path(data_dir), probe_key
        self.config_path = self.data_dir.parent / f"{self.data_dir.name}-config.json"
        self.config_path.write_text(json.dumps(config))
        self.port = free_port(HOST)
        self.url = f"http://{HOST}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-server.log"
        self.starts = 0

    def start(self, timeout: float = 180) -> ServerProcess:
        env = server_env()
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child process writes to it after this returns
        self.proc = subprocess.Popen(
            [
                *_cli(),
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                "--config",
                str(self.config_path),
                "--log-level",
                "warning",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"twinkle-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(f"{self.url}/api/v1/healthz", headers={"X-API-Key": self.probe_key}, timeout=2)
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"twinkle-server not ready within {timeout} s:\n{self.log_tail()}")

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill9()

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""


def test_config(**extra) -> dict:
    from twinkle.hub import TEST_MODEL

    return {"models": [{"name": TEST_MODEL}], **extra}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """launch(tenants, **config) -> (ServerProcess, {tenant: key}); a module's servers are stopped when
    it ends (each holds a model and its threads: later modules should not share the cores with them)."""
    started: list[ServerProcess] = []

    def _launch(tenants, **config):
        tenants = list(tenants)
        data_dir = tmp_path_factory.mktemp("rel-data")
        keys = {tenants[0]: create_key(data_dir, tenants[0])}  # the real CLI; the rest in-process (faster)
        keys.update(_keys_in_process(data_dir, tenants[1:]))
        srv = ServerProcess(data_dir, test_config(**config), next(iter(keys.values())))
        started.append(srv)
        return srv.start(), keys

    yield _launch
    for srv in started:  # all told at once, then waited for: each drains on its own
        if srv.proc is not None and srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGTERM)
    for srv in started:
        srv.stop()


class HttpWire:
    """One API's routes by hand (httpx, bounded timeouts), under `prefix`."""

    prefix = ""

    def __init__(self, url: str, key: str | None, timeout: float = 60):
        self.http = httpx.Client(base_url=url, headers={"X-API-Key": key} if key else {}, timeout=timeout)

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        return self.http.post(f"{self.prefix}{path}", json=body, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.http.get(f"{self.prefix}{path}", **kw)

    @staticmethod
    def ok(r: httpx.Response) -> dict:
        assert r.status_code == 200, (r.request.method, r.request.url, r.status_code, r.text[:300])
        return r.json()

    def close(self):
        self.http.close()


class Wire(HttpWire):
    """The Tinker wire protocol by hand: for routes the SDK would retry forever."""

    prefix = "/api/v1"

    def session(self) -> str:
        return self.ok(self.post("/create_session", {"tags": [], "sdk_version": "0.38.0"}))["session_id"]

    def result(self, request_id: str, deadline_s: float = 120):
        """A future's result: ('json', dict) or ('proto', bytes) or ('error', dict); bounded in time."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            r = self.post("/retrieve_future", {"request_id": request_id})
            if r.status_code != 200:
                return "http", r
            if r.headers["content-type"].startswith("application/x-protobuf"):
                return "proto", r.content
            body = r.json()
            if body.get("type") == "try_again":
                continue
            return ("error", body) if "error" in body and "category" in body else ("json", body)
        raise TimeoutError(f"future {request_id} did not finish within {deadline_s} s")

    def done(self, r: httpx.Response, deadline_s: float = 120):
        kind, out = self.result(self.ok(r)["request_id"], deadline_s)
        assert kind in ("json", "proto"), (kind, out)
        return out

    def create_model(self, session_id: str, seq: int = 0, rank: int = 8, seed: int = 0, base_model=None) -> str:
        from twinkle.hub import TEST_MODEL

        body = {
            "session_id": session_id,
            "model_seq_id": seq,
            "base_model": base_model or TEST_MODEL,
            "lora_config": {"rank": rank, "seed": seed},
        }
        return self.done(self.post("/create_model", body))["model_id"]


def fb_body(
    model_id: str,
    seq_id: int,
    data: list[tuple[list[int], dict]],
    loss_fn: str = "cross_entropy",
    dtypes: dict | None = None,
) -> bytes:
    """A ForwardBackwardRequest protobuf: data = [(tokens, {name: values})]."""
    import numpy as np

    from twinkle.serve.tinker import wire_proto as pb

    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn)
    for tokens, inputs in data:
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        for name, values in inputs.items():
            arr = np.asarray(values)
            dtypes = dtypes or {}
            dtype = dtypes.get(name, pb.DTYPE_INT64 if arr.dtype.kind in "iu" else pb.DTYPE_FLOAT32)
            np_dtype = {pb.DTYPE_INT64: np.int64, pb.DTYPE_FLOAT32: np.float32}.get(dtype, np.float32)
            t = d.loss_fn_inputs[name]
            t.dtype = dtype
            t.shape.append(arr.size)
            t.dense = arr.astype(np_dtype).tobytes()
    return msg.SerializeToString()


def sft_pair(tokens: list[int]) -> tuple[list[int], dict]:
    return tokens[:-1], {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}


def pytest_terminal_summary(terminalreporter):
    if not SUMMARY:
        return
    width = max(len(k) for k in SUMMARY)
    terminalreporter.section("twinkle-serve reliability summary")
    for label, figure in SUMMARY.items():
        terminalreporter.write_line(f"{label.ljust(width)}  {figure}")
