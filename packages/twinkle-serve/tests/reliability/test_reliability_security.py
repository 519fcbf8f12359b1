"""Security: nothing on the request path can unpickle or evaluate what a client sends (a scan of the
source), and code inside a model folder is not run unless the operator opts in (a real server)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
from harness import HOST, SUMMARY, ServerProcess, Wire, _cli, create_key, fb_body, sft_pair

import twinkle.client
import twinkle.serve

# The code paths that parse requests: the whole server package, and the wire schema it validates with.
SCANNED = [Path(twinkle.serve.__file__).parent, *(Path(p) for p in twinkle.client.__path__)]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib", "jsonpickle"}


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_calls(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                f"{where}:{node.lineno} import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where}:{node.lineno} from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if isinstance(f, ast.Name) and name in ("eval", "exec", "compile", "__import__"):
                found.append(f"{where}:{node.lineno} {name}()")
            elif owner == "torch" and name == "load" and not _is_true(_kw(node, "weights_only")):
                found.append(f"{where}:{node.lineno} torch.load without weights_only=True")
            elif owner == "yaml" and name in ("load", "unsafe_load", "full_load", "load_all"):
                found.append(f"{where}:{node.lineno} yaml.{name}")
            elif owner in ("np", "numpy") and name == "load" and _is_true(_kw(node, "allow_pickle")):
                found.append(f"{where}:{node.lineno} np.load(allow_pickle=True)")
            elif _is_true(_kw(node, "trust_remote_code")):
                found.append(f"{where}:{node.lineno} trust_remote_code=True")
    return found


def test_the_scan_catches_what_it_looks_for():
    bad = (
        "import pickle\nfrom dill import loads\neval(x)\ntorch.load(f)\ntorch.load(f, weights_only=False)\n"
        "yaml.load(s)\nnp.load(f, allow_pickle=True)\nAutoModel.from_pretrained(p, trust_remote_code=True)\n"
    )
    assert len(unsafe_calls(bad, "probe")) == 8
    assert unsafe_calls("torch.load(f, weights_only=True)\nyaml.safe_load(s)\nmodel.eval()\n", "probe") == []


def test_nothing_on_the_request_path_unpickles_or_evaluates():
    files = [p for root in SCANNED for p in root.rglob("*.py")]
    assert len(files) > 20, files
    found = [hit for p in files for hit in unsafe_calls(p.read_text(), str(p))]
    print(f"\nsecurity scan: {len(files)} modules of twinkle.serve + twinkle.client, unsafe calls: {found}")
    assert not found, found


def evil_model_folder(root: Path) -> tuple[Path, Path]:
    """The embedded tiny model, plus custom code named by config.json's auto_map that writes a marker
    file when imported; its model_type is unknown to transformers, so only that code could load it."""
    from twinkle.hub import TEST_MODEL, resolve_model_path

    folder, marker = root / "evil-model", root / "code-ran"
    shutil.copytree(resolve_model_path(TEST_MODEL), folder)
    (folder / "evil_qwen3.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import Qwen3Config, Qwen3ForCausalLM\n"
        "class EvilConfig(Qwen3Config):\n    model_type = 'evil-qwen3'\n"
        "class EvilForCausalLM(Qwen3ForCausalLM):\n    config_class = EvilConfig\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil_qwen3.EvilConfig", "AutoModelForCausalLM": "evil_qwen3.EvilForCausalLM"}
    config["model_type"] = "evil-qwen3"
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker


def _spawn(srv: ServerProcess) -> None:
    """Start the server without waiting for /healthz (a server that cannot load never says ok)."""
    log = open(srv.log_path, "ab")  # noqa: SIM115 - the child process writes to it after this returns
    srv.proc = subprocess.Popen(
        [
            *_cli(),
            "--host",
            HOST,
            "--port",
            str(srv.port),
            "--data-dir",
            str(srv.data_dir),
            "--config",
            str(srv.config_path),
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()


def test_model_folder_code_runs_only_if_the_operator_opts_in(tmp_path, monkeypatch, launch):
    """Default: loading refuses, the folder's code never runs, and the server says why (503 on the
    API, the log). `trust_remote_code: true` on the model's entry: the same folder loads and trains."""
    from twinkle.serve.config import ModelEntry

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))  # where transformers copies the code
    folder, marker = evil_model_folder(tmp_path)
    assert ModelEntry(name="evil").trust_remote_code is False  # the operator's opt-in defaults to off
    data_dir = tmp_path / "refusing"
    data_dir.mkdir()
    key = create_key(data_dir, "op")
    srv = ServerProcess(data_dir, {"models": [{"name": "evil", "path": str(folder)}]}, key)
    _spawn(srv)
    try:
        deadline, answer = time.monotonic() + 180, None
        while time.monotonic() < deadline and srv.proc.poll() is None:
            try:
                answer = httpx.post(f"{srv.url}/twinkle/v1/models", json={}, headers={"X-API-Key": key}, timeout=5)
                if "could not load" in answer.text:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert answer is not None and answer.status_code == 503, (answer and answer.text, srv.log_tail())
        message = answer.json()["error"]
        assert "ships its own code" in message and "trust_remote_code: true" in message, message
        assert "trust_remote_code: true" in srv.log_tail(20000)
        health = httpx.get(f"{srv.url}/api/v1/healthz", headers={"X-API-Key": key}, timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "failed"  # never ok, and says why
        assert "trust_remote_code: true" in health.json()["error"]
        tinker_route = httpx.post(f"{srv.url}/api/v1/create_model", json={}, headers={"X-API-Key": key}, timeout=5)
        assert tinker_route.status_code == 503 and "could not load" in tinker_route.json()["error"]
    finally:
        srv.stop()
    assert not marker.exists(), "the model folder's code ran without the operator's opt-in"
    # the operator opts in: the same folder loads (its code runs) and trains
    srv, keys = launch(["op"], models=[{"name": "evil", "path": str(folder), "trust_remote_code": True}])
    assert marker.read_text() == "ran"
    w = Wire(srv.url, keys["op"])
    mid = w.create_model(w.session(), base_model="evil")
    out = w.done(
        w.http.post(
            "/api/v1/forward_backward",
            content=fb_body(mid, 1, [sft_pair(list(range(5, 21)))]),
            headers={"content-type": "application/x-protobuf"},
        )
    )
    assert out  # a forward_backward result (protobuf) from the custom-code model
    print(
        f"\ntrust_remote_code: default refused before the folder's code ran (503: {message[:70]}...); "
        "opted in: loaded and trained"
    )
    SUMMARY["model folder code (auto_map)"] = "not run by default (503 naming trust_remote_code); runs when opted in"


BACKENDS_SCRIPT = """
import sys
from twinkle.serve.backend import create_backend
folder, marker = sys.argv[1], sys.argv[2]
from pathlib import Path
kinds = ["multi_lora", "multi_lora on remote groups (local shards)"]


def build(kind, trust):
    if "remote" in kind:  # the Ray path's classes, as plain objects (remote_group=None): what each actor runs
        from twinkle.serve.backend.remote import RemoteBackend

        return RemoteBackend("evil", folder, shard_model_path=folder, trust_remote_code=trust)
    return create_backend("evil", folder, trust_remote_code=trust)


for kind in kinds:
    try:
        build(kind, False)
        print("LOADED-WITHOUT-OPT-IN", kind)
    except ValueError as e:
        assert "trust_remote_code" in str(e), (kind, e)
    assert not Path(marker).exists(), kind
for kind in kinds:
    backend = build(kind, True)
    assert backend.vocab_size > 0, kind
    print("OPTED-IN-OK", kind)
"""


def test_every_backend_passes_the_opt_in_to_every_from_pretrained(tmp_path):
    """multi_lora and the remote-group shards (TrainShard, SamplerShard, the driver's tokenizer)
    each refuse the folder's code by default and run it when the operator opts in. A fresh process, so
    transformers copies the code under this test's HF_MODULES_CACHE and nothing was imported before."""
    import os
    import sys

    folder, marker = evil_model_folder(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", BACKENDS_SCRIPT, str(folder), str(marker)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "hf-modules")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED-WITHOUT-OPT-IN" not in out.stdout, out.stdout
    assert out.stdout.count("OPTED-IN-OK") == 2, out.stdout
    assert marker.read_text() == "ran"
