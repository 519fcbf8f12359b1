"""`twinkle-server launch / check-config / print-config -c` with twinkle-kit's Ray-Serve-style server YAML:
what maps onto our config maps, every key it cannot honour is named, and `launch` serves the models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from twinkle.hub import TEST_MODEL

CLI = [sys.executable, "-m", "twinkle_server.cli"]
ENV = {**os.environ, "TINKER_TELEMETRY": "0", "OMP_NUM_THREADS": "2"}


def kit_yaml(port: int, model: str = TEST_MODEL) -> str:
    """A server config in twinkle-kit's format (server, model, sampler and processor apps)."""
    return f"""proxy_location: EveryNode
http_options:
  host: 127.0.0.1
  port: {port}
persistence:
  mode: file
  file_path: /tmp/state.json
applications:
  - name: server
    route_prefix: /api/v1
    import_path: server
    args:
      server_config:
        per_token_model_limit: 3
      supported_models: [qwen3-tiny]
    deployments:
      - name: TinkerCompatServer
        autoscaling_config: {{min_replicas: 1, max_replicas: 1}}
  - name: models-tiny
    route_prefix: /api/v1/model/tiny
    import_path: model
    args:
      backend: transformers
      model_id: "{model}"
      max_length: 4096
      device_group: {{name: model, ranks: 1, device_type: cuda}}
      queue_config: {{rps_limit: 100, tps_limit: 100000}}
      adapter_config: {{adapter_timeout: 30}}
  - name: sampler-tiny
    import_path: sampler
    args:
      model_id: "{model}"
      sampler_type: vllm
      engine_args: {{gpu_memory_utilization: 0.5}}
  - name: processor
    import_path: processor
    args: {{ncpu_proc_per_node: 2}}
"""


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, timeout=120)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_kit_yaml_maps_and_names_what_it_cannot_honour(tmp_path):
    cfg = tmp_path / "server_config.yaml"
    cfg.write_text(kit_yaml(8123))
    printed = json.loads(_cli("print-config", "-c", str(cfg)).stdout)
    assert printed["host"] == "127.0.0.1" and printed["port"] == 8123
    assert printed["models"] == [{"name": TEST_MODEL, "aliases": ["qwen3-tiny"]}]
    assert printed["limits"] == {"max_models": 3, "requests_per_s": 100.0, "input_tokens_per_s": 100000.0}
    assert printed["adapter_idle_offload_s"] == 30.0
    checked = _cli("check-config", "-c", str(cfg))
    assert checked.returncode == 0 and f"serves {TEST_MODEL} on 127.0.0.1:8123" in checked.stdout
    for key in (
        "proxy_location",
        "persistence",
        ".deployments",
        ".args.max_length",
        ".args.engine_args",
        "(processor)",
    ):
        assert key in checked.stdout, key
    megatron = tmp_path / "megatron.yaml"
    megatron.write_text(kit_yaml(8123).replace("backend: transformers", "backend: megatron"))
    refused = _cli("check-config", "-c", str(megatron))
    assert refused.returncode == 2 and "serves no model" in refused.stderr


def test_launch_serves_the_kit_yaml(tmp_path):
    port = _free_port()
    cfg = tmp_path / "server_config.yaml"
    cfg.write_text(kit_yaml(port))
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([*CLI, "launch", "-c", str(cfg), "--data-dir", str(tmp_path / "data")], stdout=log,
                            stderr=subprocess.STDOUT, env=ENV)  # fmt: skip
    deadline = time.monotonic() + 240
    try:
        while "listening on" not in Path(log.name).read_text():
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
            time.sleep(0.2)
        assert "config key not honoured: proxy_location" in Path(log.name).read_text()
        key = _cli("keys", "create", "kit", "--data-dir", str(tmp_path / "data")).stdout.strip()
        # the socket accepts before the engines finish loading: the status says when they have
        status = {"ready": False}
        while not status["ready"]:
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
            status = httpx.get(f"http://127.0.0.1:{port}/twinkle/v1/server", headers={"X-API-Key": key}).json()
            time.sleep(0.2)
        assert [m["name"] for m in status["base_models"]] == [TEST_MODEL]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
