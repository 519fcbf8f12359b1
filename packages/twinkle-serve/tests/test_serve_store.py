"""The store's schema versioning: a database written by the first release (kept as a fixture, made by
that release's server after Tinker and native training, checkpoints, sampling and curves) upgrades in
place and serves its runs, checkpoints and keys; a newer database is refused; a fresh one is current."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from twinkle.serve.core.store import VERSION, Store
from twinkle.serve.keys import KeyStore

FIXTURE = Path(__file__).parent / "fixtures" / "store_v0.sqlite"
NATIVE, TINKER = "eea08458a0be49ceb77a:train:0", "6a7e82a598684ca3a32c:train:0"


@pytest.fixture
def upgraded(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "twinkle.db")
    assert sqlite3.connect(tmp_path / "twinkle.db").execute("PRAGMA user_version").fetchone()[0] == 0
    store = Store(tmp_path)
    yield store
    store.close()


def test_a_first_release_database_upgrades_and_keeps_its_runs(upgraded):
    assert upgraded.version == VERSION >= 3
    runs = {r.model_id: r for r in upgraded.runs.list("alice", 10)}
    assert set(runs) == {NATIVE, TINKER}
    assert runs[NATIVE].api == "native" and runs[NATIVE].name == "native-run" and runs[NATIVE].lora["adapters"] == ["a"]
    assert runs[TINKER].api == "tinker" and runs[TINKER].lora["rank"] == 4 and runs[TINKER].user_metadata == {"k": "v"}
    assert upgraded.runs.owned(TINKER, "bob") is None  # still scoped by tenant


def test_checkpoint_folders_become_relative_to_the_data_dir(upgraded):
    ckpts = {c.name: c for c in upgraded.checkpoints.of_tenant("alice")}
    assert set(ckpts) == {"step1", "n1"}
    assert ckpts["step1"].dir == "tenants/alice/6a7e82a598684ca3a32c_train_0/weights/step1"
    assert ckpts["n1"].checkpoint_id == "weights/n1" and ckpts["n1"].size_bytes == 25065


def test_keys_curves_and_samplers_survive(upgraded):
    keys = KeyStore(upgraded)
    assert [k["name"] for k in keys.list()] == ["alice", "bob"] and keys.count() == 2
    curves = upgraded.curves.of(NATIVE)
    assert curves["reward"][0]["value"] == 0.5 and len(curves["loss"]) == 1
    assert upgraded.samplers.owned("6a7e82a598684ca3a32c:sample:0", "alice").ephemeral


def test_the_v3_tables_exist_and_work_after_the_upgrade(upgraded):
    tables = {r["name"] for r in upgraded.db.all("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"custom_losses", "sample_requests", "sampler_clients", "session_projects", "usage"} <= tables
    session = upgraded.runs.get(TINKER).session_id
    assert upgraded.projects.of(session) == "default"  # an old session is in the default project
    upgraded.projects.set(session, "p1")
    upgraded.usage.add("alice", session, "m", {"training": 7}, None)
    upgraded.usage.add("alice", session, "m", {"training": 5}, None)
    assert [u["tokens"] for u in upgraded.usage.of_session(session)] == [12]
    assert [upgraded.sample_requests.join("s") for _ in range(2)] == [1, 2]
    details = {r["session_id"]: r for r in upgraded.projects.sessions_with_details("alice")}
    assert details[session]["project_id"] == "p1" and details[session]["checkpoints_count"] == 1  # step1


def test_reopening_runs_no_migration_twice(tmp_path):
    Store(tmp_path).close()
    store = Store(tmp_path)  # a second open finds it current (an ALTER run twice would raise)
    assert store.version == VERSION
    store.close()


def test_a_database_from_a_newer_server_is_refused(tmp_path):
    db = sqlite3.connect(tmp_path / "twinkle.db")
    db.execute(f"PRAGMA user_version = {VERSION + 1}")
    db.close()
    with pytest.raises(RuntimeError, match="newer than this server"):
        Store(tmp_path)


def test_a_v3_database_upgrades_to_per_run_usage_and_quotas(tmp_path):
    """store_v3.sqlite: the first release's database as the previous release (schema 3) left it, with
    token usage it counted. Version 4 keeps that usage and adds per-run usage and per-key quotas."""
    shutil.copy(FIXTURE.with_name("store_v3.sqlite"), tmp_path / "twinkle.db")
    assert sqlite3.connect(tmp_path / "twinkle.db").execute("PRAGMA user_version").fetchone()[0] == 3
    store = Store(tmp_path)
    assert store.version == VERSION >= 4
    assert store.usage.totals("alice") == {"training": 1234, "sampling_sample": 56}
    assert store.quotas.get("alice") == {"tokens_per_day": None, "storage_bytes": None, "adapters": None}
    store.quotas.set("alice", tokens_per_day=5000, adapters=2)
    store.quotas.set("alice", adapters=None)  # one field changed, the others kept
    writes = store.db.writes
    store.usage.add("alice", None, "m", {"training": 10}, TINKER)
    store.usage.add("alice", None, "m", {"training": 5}, TINKER)
    assert store.db.writes == writes + 2  # the hour's bucket and the run's total in one transaction each
    runs = {r["model_id"]: r for r in store.usage.of_runs("alice")}
    assert runs[TINKER]["training"] == 15 and runs[NATIVE]["training"] == 0
    assert runs[TINKER]["checkpoint_bytes"] == sum(c.size_bytes for c in store.checkpoints.of_run(TINKER, "alice"))
    store.close()
    store = Store(tmp_path)  # quotas are in the database: a restarted server keeps them
    assert store.quotas.get("alice") == {"tokens_per_day": 5000, "storage_bytes": None, "adapters": None}
    store.close()
