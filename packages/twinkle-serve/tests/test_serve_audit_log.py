"""The audit log through the unmodified SDK: `AdminClient.get_audit_log` (SDK 0.38's home of it) and the
deprecated `RestClient.get_audit_log` read what a key's checkpoints and projects saw, one UTC day at a time;
a read of a published checkpoint by another key shows in the owner's log without naming that key."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import httpx
import pytest

from twinkle.hub import TEST_MODEL

TENANT = "olga-audit"
SEQ = [5 + (3 * i) % 50 for i in range(12)]


@pytest.fixture(scope="module")
def history(server, tenant_key, keys, sft):
    """olga trains, saves, publishes, sets a TTL and a project; bob loads olga's published checkpoint."""
    import tinker
    from tinker import types

    olga = tinker.ServiceClient(base_url=server.url, api_key=tenant_key)
    tc = olga.create_lora_training_client(base_model=TEST_MODEL, rank=4).result()
    tc.forward_backward([sft(SEQ)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("audited").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=tenant_key)
    rest.publish_checkpoint_from_tinker_path(path).result()
    rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    bob = tinker.ServiceClient(base_url=server.url, api_key=keys["bob"])
    bob.create_training_client_from_state(path).result()
    return path, tc.model_id


def test_admin_client_reads_the_days_events_in_order(server, tenant_key, history):
    import tinker

    path, model_id = history
    admin = tinker.AdminClient(base_url=server.url, api_key=tenant_key)
    entries = admin.get_audit_log().result().entries
    mine = [e for e in entries if e.event_details.get("tinker_path") == path]
    assert [e.event for e in mine] == [
        "checkpoint_create",
        "checkpoint_publish",
        "checkpoint_ttl_set",
        "checkpoint_read",
    ]
    created, _, ttl, read = mine
    assert created.event_details["kind"] == "training" and created.event_details["size_bytes"] > 0
    assert ttl.event_details["ttl_seconds"] == 3600
    # bob's load, in olga's log: what was read and why, but not by whom
    assert read.event_details == {
        "tinker_path": path,
        "model_id": model_id,
        "purpose": "load",
        "actor": "another key (published checkpoint)",
    }
    assert "bob" not in str(read.model_dump())
    assert read.tinker_path == path and read.purpose == "load"  # the SDK's deprecated top-level copies
    stamps = [e.timestamp for e in entries]
    assert stamps == sorted(stamps) and all(s.date() == datetime.now(UTC).date() for s in stamps)


def test_the_reader_sees_its_own_read_and_nothing_of_the_owner(server, keys, history):
    import tinker

    path, _ = history
    with pytest.warns(FutureWarning, match="AdminClient.get_audit_log"):  # the deprecated home still answers
        entries = tinker.RestClient(base_url=server.url, api_key=keys["bob"]).get_audit_log().result().entries
    reads = [e for e in entries if e.event_details.get("tinker_path") == path]
    assert [(e.event, e.event_details["actor"]) for e in reads] == [("checkpoint_read", "this key")]


def test_event_type_and_day_select(server, tenant_key, history):
    import tinker

    admin = tinker.AdminClient(base_url=server.url, api_key=tenant_key)
    session_id = history[1].split(":")[0]
    tinker.RestClient(base_url=server.url, api_key=tenant_key).assign_session_project(
        session_id, "audited-project"
    ).result()
    projects = admin.get_audit_log(event_type="projects").result().entries
    assert [(e.event, e.event_details) for e in projects] == [
        ("project_assign", {"session_id": session_id, "project_id": "audited-project"})
    ]
    checkpoints = admin.get_audit_log(event_type="checkpoints").result().entries
    assert checkpoints and all(e.event.startswith("checkpoint_") for e in checkpoints)
    assert admin.get_audit_log(event_type="teams").result().entries == []
    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    assert admin.get_audit_log(day=yesterday).result().entries == []
    assert admin.get_audit_log(day=date(2020, 1, 1)).result().entries == []


def test_bad_filters_are_400s_naming_the_parameter(server, tenant_key):
    for params, word in (({"event_type": "everything"}, "event_type"), ({"day": "yesterday"}, "day")):
        r = httpx.get(f"{server.url}/api/v1/audit", params=params, headers={"X-API-Key": tenant_key})
        assert r.status_code == 400 and word in r.json()["detail"], (params, r.text)
