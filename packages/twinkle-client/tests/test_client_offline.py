"""twinkle-client on its own: no torch in its dependencies (installed alone in an empty venv), the
row conversion, peft-config translation, the Tinker env set-up and CLI argument handling."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("uv") is None, reason="uv is needed to build the empty venv")
def test_installs_alone_without_torch(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(["uv", "pip", "install", "-q", "--python", str(py), str(PACKAGE)], check=True)
    probe = (
        "import importlib.util as u, twinkle.client, twinkle.client.model, twinkle.client.sampler, "
        "twinkle.client.cli\n"
        "assert u.find_spec('torch') is None and u.find_spec('transformers') is None\n"
        "try:\n    import torch\nexcept ImportError:\n    print('no torch')\n"
    )
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no torch"
    assert (venv / "bin" / "twinkle").exists()


def test_rows_become_encoded_rows_with_loss_fields():
    from twinkle.client.inputs import to_inputs

    inputs = to_inputs(
        [
            {
                "input_ids": [1, 2, 3],
                "labels": [-100, 2, 3],
                "advantages": 0.5,
                "weights": [0.0, 1.0, 1.0],
                "messages": [{"role": "user", "content": "x"}],
            }
        ]
    )
    (row,) = inputs.rows
    assert row.input_ids == [1, 2, 3] and row.labels == [-100, 2, 3]
    assert row.fields == {"advantages": 0.5, "weights": [0.0, 1.0, 1.0]}  # text columns stay home
    assert inputs.trajectories is None


def test_chats_go_to_the_server_when_not_encoded_here():
    from twinkle.client.inputs import LocalEncoder, to_inputs

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    inputs = to_inputs([chat, {"messages": chat, "advantages": 1.0}], LocalEncoder("any", "server"))
    assert inputs.rows is None and len(inputs.trajectories) == 2
    assert inputs.trajectories[1].fields == {"advantages": 1.0}
    with pytest.raises(ValueError, match="mix of encoded rows and chats"):
        to_inputs([chat, {"input_ids": [1]}], LocalEncoder("any", "server"))
    with pytest.raises(ValueError, match="non-empty list"):
        to_inputs([])


def test_lora_config_translation():
    from twinkle.client.model import lora_config_dict

    out = lora_config_dict({"r": 16, "lora_alpha": 32, "target_modules": ["q_proj"], "use_dora": False})
    assert out["r"] == 16 and out["target_modules"] == ["q_proj"] and out["use_dora"] is False
    with pytest.raises(Exception, match="greater than or equal to 1"):
        lora_config_dict({"r": 0})
    with pytest.raises(TypeError, match="peft.LoraConfig"):
        lora_config_dict(8)


def test_init_tinker_client_only_sets_the_environment(monkeypatch):
    from twinkle.client import init_tinker_client

    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    env = init_tinker_client("http://h:1/", "tml-abc")
    assert env == {"TINKER_BASE_URL": "http://h:1", "TINKER_API_KEY": "tml-abc"}
    assert os.environ["TINKER_BASE_URL"] == "http://h:1"
    with pytest.raises(ValueError, match="tml-"):
        init_tinker_client("http://h:1", "sk-abc")


def test_cli_reports_missing_server(monkeypatch, capsys):
    from twinkle.client.cli import main

    monkeypatch.delenv("TWINKLE_BASE_URL", raising=False)
    assert main(["runs"]) == 1
    assert "TWINKLE_BASE_URL" in capsys.readouterr().err
    assert main(["--base-url", "http://127.0.0.1:9", "--api-key", "tml-x", "status"]) == 1
    assert "cannot reach the server at http://127.0.0.1:9" in capsys.readouterr().err


def test_a_lost_answer_is_retried_with_the_same_idempotency_key(monkeypatch):
    import httpx

    from twinkle.client import http as client_http
    from twinkle.client.wire import Answer

    monkeypatch.setattr(client_http, "_backoff", lambda attempt: 0)
    seen = []

    def answering(method, path, json_body=None, params=None, headers=None, timeout=None):
        seen.append((method, (headers or {}).get("X-Idempotency-Key")))
        if len(seen) in (1, 2):  # the server ran it, the answer was lost on the way back
            raise httpx.ReadTimeout("answer lost")
        return Answer(method, path, 200, {}, b'{"request_id": "f1"}')

    client = client_http.TwinkleClient("http://twinkle.invalid", "tml-x")
    monkeypatch.setattr(client.wire, "send", answering)
    assert client.post("/models/m/forward_backward", {"inputs": []}) == {"request_id": "f1"}
    assert [m for m, _ in seen] == ["POST"] * 3
    assert len({k for _, k in seen}) == 1 and len(seen[0][1]) == 32  # one key for every attempt
    first_key = seen[0][1]
    client.post("/models/m/forward_backward", {"inputs": []})  # a new call: a new key
    assert seen[-1][1] not in (None, first_key)
    client.get("/runs")
    assert seen[-1] == ("GET", None)  # reads carry no key

    seen.clear()
    client = client_http.TwinkleClient("http://127.0.0.1:9", "tml-x")  # nothing listens on port 9
    real_send = client.wire.send

    def counted(*args, **kwargs):
        seen.append(args[0])
        return real_send(*args, **kwargs)

    monkeypatch.setattr(client.wire, "send", counted)
    with pytest.raises(httpx.ConnectError):
        client.get("/runs")
    assert len(seen) == 1 + client_http.TRANSPORT_RETRIES


def test_keep_alive_connection_is_reused_and_a_closed_one_replaced():
    """The sync client keeps one connection per thread; when the server closed it while idle, the next
    call opens a new one instead of failing."""
    import http.server
    import threading

    from twinkle.client.http import TwinkleClient

    peers = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            peers.append(self.client_address[1])
            body = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = TwinkleClient(f"http://127.0.0.1:{server.server_address[1]}", "tml-x")
        assert client.get("/a") == {"ok": True} and client.get("/b") == {"ok": True}
        assert len(peers) == 2 and peers[0] == peers[1]  # one connection for both calls
        client.wire._local.conn.sock.shutdown(2)  # as if the server had dropped the idle connection
        assert client.get("/c") == {"ok": True}
        assert peers[2] != peers[0]
        client.close()
    finally:
        server.shutdown()
        server.server_close()
