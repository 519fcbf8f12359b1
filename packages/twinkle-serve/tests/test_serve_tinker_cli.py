"""Every `tinker` CLI subcommand that touches runs, checkpoints and sessions, run as the real console
script (a subprocess with TINKER_BASE_URL / TINKER_API_KEY) against a real server, outputs asserted.

`checkpoint download` and `checkpoint push-hf` run in test_serve_external_weights.py (push-hf against a
local stand-in of the Hub upload API). A guard test lists the SDK's own subcommands, so one added by a
new SDK release fails here until it is driven.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from twinkle.hub import TEST_MODEL

sys.path.insert(0, str(Path(__file__).parent))
from _tinker_cli import run_cli, run_cli_json

TENANT = "ivan-cli"
SEQ = [5 + (7 * i) % 60 for i in range(12)]
DRIVEN = {
    "run": {"list", "info"},
    "checkpoint": {"list", "info", "publish", "unpublish", "set-ttl", "delete", "download", "push-hf"},
    "session": {"export-trace"},
}


@pytest.fixture(scope="module")
def ivan(server, tenant_key, sft):
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=server.url, api_key=tenant_key)
    tc = client.create_lora_training_client(
        base_model=TEST_MODEL, rank=4, seed=4, user_metadata={"purpose": "cli"}
    ).result()
    tc.forward_backward([sft(SEQ)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    paths = {name: tc.save_state(name).result().path for name in ("c1", "c2")}
    paths["s1"] = tc.save_weights_for_sampler("s1").result().path
    return client, tc, paths


def cli(server, key, *args):
    return run_cli_json(server.url, key, *args)


def test_the_sdk_has_no_undriven_subcommand():
    import importlib

    for group, driven in DRIVEN.items():
        commands = set(importlib.import_module(f"tinker.cli.commands.{group}").cli.commands)
        assert commands == driven, f"tinker {group}: {sorted(commands - driven)} not driven by these tests"


def test_run_list_and_info(server, ivan, tenant_key, keys):
    _, tc, paths = ivan
    runs = cli(server, tenant_key, "run", "list")["runs"]
    assert [r["training_run_id"] for r in runs] == [tc.model_id]
    assert runs[0]["base_model"] == TEST_MODEL and runs[0]["lora_rank"] == 4 and runs[0]["model_owner"] == TENANT
    info = cli(server, tenant_key, "run", "info", tc.model_id)
    assert info["training_run_id"] == tc.model_id and info["user_metadata"] == {"purpose": "cli"}
    assert info["last_checkpoint"]["tinker_path"] == paths["c2"]
    assert info["last_sampler_checkpoint"]["tinker_path"] == paths["s1"]
    denied = run_cli(server.url, keys["bob"], "run", "info", tc.model_id, check=False)
    assert denied.returncode != 0 and "not found" in denied.stderr.lower()


def test_checkpoint_list_info_publish_ttl_delete(server, ivan, tenant_key):
    _, tc, paths = ivan
    listed = cli(server, tenant_key, "checkpoint", "list", "--run-id", tc.model_id)
    assert listed["run_id"] == tc.model_id
    assert {c["tinker_path"]: c["checkpoint_type"] for c in listed["checkpoints"]} == {
        paths["c1"]: "training",
        paths["c2"]: "training",
        paths["s1"]: "sampler",
    }
    everything = cli(server, tenant_key, "checkpoint", "list")["checkpoints"]
    assert {c["tinker_path"] for c in everything} == set(paths.values())
    info = cli(server, tenant_key, "checkpoint", "info", paths["c1"])
    assert info["checkpoint_id"] == "weights/c1" and info["lora_rank"] == 4 and info["public"] is False
    assert info["size_bytes"] > 0

    # (each CLI process costs seconds: the state the next commands set is read back from the server's store)
    def row():
        return server.runtime.store.db.one(
            "SELECT public, expires_at FROM checkpoints WHERE tinker_path=?", (paths["c1"],)
        )

    run_cli(server.url, tenant_key, "checkpoint", "publish", paths["c1"])
    assert row()["public"] == 1
    run_cli(server.url, tenant_key, "checkpoint", "unpublish", paths["c1"])
    assert row()["public"] == 0
    run_cli(server.url, tenant_key, "checkpoint", "set-ttl", paths["c1"], "--ttl", "7200")
    assert 7000 < row()["expires_at"] - datetime.now(UTC).timestamp() <= 7200
    run_cli(server.url, tenant_key, "checkpoint", "set-ttl", paths["c1"], "--remove")
    assert row()["expires_at"] is None

    run_cli(server.url, tenant_key, "checkpoint", "delete", paths["c2"], "--yes")
    run_cli(
        server.url, tenant_key, "checkpoint", "delete", "--run-id", tc.model_id, "--type", "sampler_weights", "--yes"
    )
    remaining = cli(server, tenant_key, "checkpoint", "list", "--run-id", tc.model_id)["checkpoints"]
    assert [c["tinker_path"] for c in remaining] == [paths["c1"]]
    gone = run_cli(server.url, tenant_key, "checkpoint", "info", paths["c2"], check=False)
    assert gone.returncode != 0 and "not found" in gone.stderr.lower()


def test_session_export_trace(server, ivan, tenant_key, keys, tmp_path):
    client, tc, _ = ivan
    session_id = client.holder.get_session_id()
    out = cli(server, tenant_key, "session", "export-trace", session_id, "--output", str(tmp_path / "t.pftrace"))
    assert out["destination"] == str(tmp_path / "t.pftrace") and out["file_size_bytes"] > 0
    events = json.loads((tmp_path / "t.pftrace").read_text())["traceEvents"]
    created = [e for e in events if e["name"] == "training run created"]
    assert [e["args"]["model_id"] for e in created] == [tc.model_id]
    url = run_cli(server.url, keys["bob"], "session", "export-trace", session_id, "--url-only", check=False)
    assert url.returncode != 0 and "not found" in url.stderr.lower()  # another tenant's session


def test_model_list_and_billing(server, ivan, tenant_key):
    models = cli(server, tenant_key, "model", "list")["models"]
    assert [m["model_name"] for m in models] == [TEST_MODEL] and models[0]["trainable"] is True
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0).timestamp()
    start = datetime.fromtimestamp(now - 3600, UTC).isoformat().replace("+00:00", "Z")
    end = datetime.fromtimestamp(now + 3600, UTC).isoformat().replace("+00:00", "Z")
    usage = cli(server, tenant_key, "billing", "usage", start, end)
    training = [row for row in usage["data"] if row["event_info"]["type"] == "training"]
    assert sum(row["event_info"]["token_count"] for row in training) == len(SEQ) - 1
