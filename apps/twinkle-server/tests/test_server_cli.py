"""The `twinkle-server` command: key management and a real server process driven by the tinker SDK."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from twinkle.hub import TEST_MODEL

CLI = [sys.executable, "-m", "twinkle_server.cli"]
ENV = {**os.environ, "TINKER_TELEMETRY": "0", "OMP_NUM_THREADS": "2"}


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, timeout=120)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_invalid_config_is_refused_with_the_offending_key(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[[models]]\nname = "twinkle://qwen3-tiny"\nbatch_size = 4\n')
    result = _cli("--config", str(cfg), "--data-dir", str(tmp_path), "--port", str(_free_port()))
    assert result.returncode == 2 and "batch_size" in result.stderr and "Extra inputs" in result.stderr


def test_help_lists_the_keys_command():
    result = _cli("--help")
    assert result.returncode == 0 and "keys" in result.stdout and "manage API keys" in result.stdout
    keys = _cli("keys", "--help")
    assert keys.returncode == 0 and all(a in keys.stdout for a in ("create", "list", "revoke"))


def test_a_bad_log_level_names_the_valid_choices(tmp_path):
    result = _cli("--log-level", "foo", "--data-dir", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "invalid choice: 'foo'" in result.stderr and "'debug'" in result.stderr and "'warning'" in result.stderr


def test_data_dir_may_come_before_the_keys_command(tmp_path):
    assert _cli("--data-dir", str(tmp_path), "keys", "create", "dave").stdout.startswith("tml-")
    assert "dave\tactive" in _cli("keys", "list", "--data-dir", str(tmp_path)).stdout


def test_keys_and_a_served_training_step(tmp_path):
    import tinker
    from tinker import types

    data = tmp_path / "data"
    cfg = tmp_path / "server.toml"
    cfg.write_text(f'[[models]]\nname = "{TEST_MODEL}"\n\n[limits]\nmax_models = 4\n')
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [*CLI, "--port", str(port), "--data-dir", str(data), "--config", str(cfg)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=ENV,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while "listening on" not in Path(log.name).read_text():
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
            time.sleep(0.2)
        # started with no keys: it says how to make one; keys made while it runs work at once
        assert "keys create NAME" in Path(log.name).read_text()
        # an orchestrator's probes need no key; the detailed status does
        assert httpx.get(url + "/livez").json() == {"status": "alive"}
        assert httpx.get(url + "/readyz").status_code in (200, 503)
        key = _cli("keys", "create", "alice", "--data-dir", str(data)).stdout.strip()
        assert key.startswith("tml-") and len(key) > 30
        assert _cli("keys", "create", "alice", "--data-dir", str(data)).returncode == 2  # one live key per name
        while True:
            try:
                if httpx.get(url + "/api/v1/healthz", headers={"X-API-Key": key}).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
            time.sleep(0.5)
        assert httpx.get(url + "/api/v1/healthz").status_code == 401
        assert httpx.get(url + "/readyz").json() == {"status": "ready"}

        client = tinker.ServiceClient(base_url=url, api_key=key)
        tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0).result()
        seq = list(range(10, 30))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
        )
        first = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert tc.forward([datum], "cross_entropy").result().metrics["loss:sum"] < first
        # usage per key and run, as counted by the running server; a quota set now refuses at once
        import json

        (usage,) = json.loads(_cli("keys", "usage", "alice", "--json", "--data-dir", str(data)).stdout)
        assert usage["tokens"]["training"] == 2 * len(datum.model_input.to_ints())  # forward_backward + forward
        assert [r["training"] for r in usage["runs"]] == [usage["tokens"]["training"]]
        assert "alice: trained 38 tokens" in _cli("keys", "usage", "--data-dir", str(data)).stdout
        quota = _cli("keys", "set-quota", "alice", "--adapters", "1", "--data-dir", str(data))
        assert quota.returncode == 0 and "adapters 1" in quota.stdout
        refused = httpx.post(
            url + "/api/v1/create_model",
            headers={"X-API-Key": key},
            json={
                "session_id": client.holder.get_session_id(),
                "model_seq_id": 7,
                "base_model": TEST_MODEL,
                "lora_config": {"rank": 4},
            },
        )
        assert refused.status_code == 409 and refused.json()["quota"] == "adapters"
        assert refused.headers["x-should-retry"] == "false"
        assert _cli("keys", "set-quota", "nobody", "--adapters", "1", "--data-dir", str(data)).returncode == 1
        client.holder.close() if hasattr(client.holder, "close") else None

        listed = _cli("keys", "list", "--data-dir", str(data)).stdout
        assert "alice\tactive" in listed and key not in listed
        assert _cli("keys", "revoke", "alice", "--data-dir", str(data)).returncode == 0
        assert httpx.get(url + "/api/v1/healthz", headers={"X-API-Key": key}).status_code == 401
        assert "alice\trevoked" in _cli("keys", "list", "--data-dir", str(data)).stdout
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_bad_key_names_are_refused(tmp_path):
    code = (
        "import sys; from twinkle_server.cli import main; "
        "sys.exit(max(main(['keys', 'create', n, '--data-dir', sys.argv[1]]) for n in ['', 'a/b', '.x']))"
    )
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=ENV)
    assert result.returncode == 2 and result.stderr.count("key name") == 3


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz").status_code == 200
    except httpx.TransportError:
        return False


def test_model_flags_choose_the_served_models_without_a_config_file(tmp_path):
    """`--model NAME`, repeatable (as `vllm serve MODEL`): those base models and no config file."""
    from twinkle.hub import DEFAULT_MODEL

    data, port = tmp_path / "data", _free_port()
    key = _cli("keys", "create", "bob", "--data-dir", str(data)).stdout.strip()
    log = (tmp_path / "server.log").open("w")
    args = ["--port", str(port), "--data-dir", str(data), "--model", TEST_MODEL, "--model", DEFAULT_MODEL]
    proc = subprocess.Popen([*CLI, *args], stdout=log, stderr=subprocess.STDOUT, env=ENV)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 240
    try:
        while not _ready(url):  # listening, then both models loaded
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
            time.sleep(0.3)
        caps = httpx.get(url + "/api/v1/get_server_capabilities", headers={"X-API-Key": key}).json()
        assert [m["model_name"] for m in caps["supported_models"]] == [TEST_MODEL, DEFAULT_MODEL]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
