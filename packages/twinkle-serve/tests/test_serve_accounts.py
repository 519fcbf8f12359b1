"""copy_weights, join-less REST routes of SDK 0.38: session search / project / trace export, the API key's
own record, usage counted in real tokens (prices: explicitly not tracked) and the audit log."""

from __future__ import annotations

import warnings
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from twinkle.hub import TEST_MODEL

SEQ = [5 + (7 * i) % 60 for i in range(17)]  # 16 training tokens per datum
TENANT = "gina-accounts"


@pytest.fixture(scope="module")
def gina(server, tenant_key, sft):
    """A session that trains 2 steps of 2 datums (64 training tokens), samples once, and saves state."""
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=server.url, api_key=tenant_key, user_metadata={"team": "ranking"})
    tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=2).result()
    for _ in range(2):
        tc.forward_backward([sft(SEQ), sft(SEQ)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("s1").result().path
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampled = sampler.sample(
        types.ModelInput.from_ints(SEQ[:5]), 2, types.SamplingParams(max_tokens=3, seed=1)
    ).result()
    rest = tinker.RestClient(base_url=server.url, api_key=tenant_key)
    return client, tc, state, rest, sum(len(s.tokens) for s in sampled.sequences)


def _get(server, key, path, **params):
    return httpx.get(f"{server.url}/api/v1/{path}", params=params, headers={"X-API-Key": key})


def test_usage_counts_real_tokens(server, gina, tenant_key, keys):
    from tinker import AdminClient

    client, _tc, _, _, sampled_tokens = gina
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    admin = AdminClient(base_url=server.url, api_key=tenant_key)
    usage = admin.get_billing_usage(now - timedelta(hours=1), now + timedelta(hours=1)).result()
    session_id = client.holder.get_session_id()
    mine = [e for e in usage.data if e.session_id == session_id]
    by_kind = {e.event_info.type: e.event_info for e in mine}
    assert by_kind["training"].token_count == 2 * 2 * (len(SEQ) - 1)
    assert by_kind["sampling_prefill"].token_count == 5 and by_kind["sampling_prefill"].cached is False
    assert by_kind["sampling_sample"].token_count == sampled_tokens
    assert all(e.estimated_cost_usd is None and e.base_model == TEST_MODEL for e in mine)  # no invented prices
    assert usage.sessions[session_id].user_metadata == {"team": "ranking"}
    # per key: bob sees none of gina's tokens
    bob = _get(
        server,
        keys["bob"],
        "billing/usage/events",
        starting_on=(now - timedelta(hours=1)).isoformat(),
        ending_before=(now + timedelta(hours=1)).isoformat(),
    ).json()
    assert all(e["session_id"] != session_id for e in bob["data"])
    r = _get(
        server,
        tenant_key,
        "billing/usage/events",
        starting_on=now.isoformat(),
        ending_before=(now + timedelta(days=20)).isoformat(),
    )
    assert r.status_code == 400 and "14 days" in r.json()["error"]
    r = _get(server, tenant_key, "billing/usage/events", starting_on="yesterday", ending_before=now.isoformat())
    assert r.status_code == 400 and "starting_on" in r.json()["error"]
    storage = admin.get_current_checkpoint_storage_usage().result()
    rows = server.runtime.store.db.all("SELECT size_bytes FROM checkpoints WHERE tenant=?", (TENANT,))
    assert storage.data[0].checkpoint_count == len(rows)
    assert storage.data[0].size_bytes == sum(r["size_bytes"] for r in rows) > 0
    assert storage.data[0].estimated_monthly_cost_usd is None
    r = _get(server, tenant_key, "audit")  # the checkpoints counted above, each created today (test_serve_audit_log)
    created = [e for e in r.json()["entries"] if e["event"] == "checkpoint_create"]
    assert r.status_code == 200 and len(created) >= len(rows)


def test_copy_weights(server, gina, tenant_key, keys):
    from safetensors.torch import load_file

    client, _tc, state, rest, _ = gina
    copied = rest.copy_weights(state, "archive").result()
    assert copied.endswith("/weights/s1") and copied != state
    run_id = copied.removeprefix("tinker://").split("/")[0]
    run = rest.get_training_run(run_id).result()
    assert run.base_model == TEST_MODEL and run.user_metadata == {"copied_from": state}
    src, dst = (
        server.runtime.data_dir
        / server.runtime.store.db.one("SELECT dir FROM checkpoints WHERE tinker_path=?", (path,))["dir"]
        for path in (state, copied)
    )
    a, b = load_file(f"{src}/adapter_model.safetensors"), load_file(f"{dst}/adapter_model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # the copy loads like any training checkpoint (same weights as its source)
    resumed = client.create_training_client_from_state(copied).result()
    assert resumed.get_info().model_data.model_name == TEST_MODEL
    # into a session slot
    r = httpx.post(
        f"{server.url}/api/v1/copy_weights",
        headers={"X-API-Key": tenant_key},
        json={"source_path": state, "session_id": client.holder.get_session_id(), "model_seq_id": 77},
    )
    assert r.status_code == 200 and r.json()["tinker_path"].startswith(
        f"tinker://{client.holder.get_session_id()}:train:77/"
    )
    # bad input and other tenants
    r = httpx.post(
        f"{server.url}/api/v1/copy_weights",
        headers={"X-API-Key": keys["bob"]},
        json={"source_path": state, "destination_project_id": "p"},
    )
    assert r.status_code == 404
    r = httpx.post(f"{server.url}/api/v1/copy_weights", headers={"X-API-Key": tenant_key}, json={"source_path": state})
    assert r.status_code == 400 and "destination_project_id" in r.json()["error"]
    r = httpx.post(
        f"{server.url}/api/v1/copy_weights",
        headers={"X-API-Key": tenant_key},
        json={"source_path": "s3://x", "destination_project_id": "p"},
    )
    assert r.status_code == 400 and "tinker://" in r.json()["error"]


def test_session_search_project_and_trace(server, gina, tenant_key, keys, tmp_path):
    from tinker import types

    client, _tc, _, rest, _ = gina
    session_id = client.holder.get_session_id()
    rest.assign_session_project(session_id, "proj-a").result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # search_sessions is marked experimental by the SDK
        page = rest.search_sessions(types.SessionSearchRequest(project_ids=["proj-a"])).result()
        assert [s.session_id for s in page.sessions] == [session_id]
        found = page.sessions[0]
        assert found.project_id == "proj-a" and found.owner == f"twinkle:key:{TENANT}"
        assert found.status.type == "active" and found.checkpoints_count >= 1
        assert found.user_metadata == {"team": "ranking"}
        meta = rest.search_sessions(types.SessionSearchRequest(user_metadata={"team": "other"})).result()
        assert meta.sessions == []
        # paging: one per page, newest first, every session exactly once
        seen, request = [], types.SessionSearchRequest(limit=1)
        while True:
            page = rest.search_sessions(request).result()
            seen += [s.session_id for s in page.sessions]
            if page.next_cursor is None:
                break
            request = request.model_copy(update={"cursor": page.next_cursor})
    expected = [r["session_id"] for r in server.runtime.store.projects.sessions_with_details(TENANT)]
    assert seen == expected and session_id in seen
    r = httpx.post(
        f"{server.url}/api/v1/sessions/search", headers={"X-API-Key": tenant_key}, json={"display_name": "nightly"}
    )
    assert r.status_code == 400 and "display_name" in r.json()["error"]
    r = httpx.post(f"{server.url}/api/v1/sessions/search", headers={"X-API-Key": tenant_key}, json={"limit": 0})
    assert r.status_code == 400 and "limit" in r.json()["error"]
    r = httpx.put(
        f"{server.url}/api/v1/sessions/{session_id}/project",
        headers={"X-API-Key": keys["bob"]},
        json={"project_id": "stolen"},
    )
    assert r.status_code == 404
    r = httpx.put(f"{server.url}/api/v1/sessions/{session_id}/project", headers={"X-API-Key": tenant_key}, json={})
    assert r.status_code == 400 and "project_id" in r.json()["error"]
    # the trace: a signed URL, fetched without a key
    url = rest.export_session_trace(session_id).result()
    trace = httpx.get(url).json()
    names = [e["name"] for e in trace["traceEvents"]]
    assert "session created" in names and "training run created" in names
    assert "training checkpoint saved" in names and "training tokens" in names
    assert httpx.get(url[:-1] + ("0" if url[-1] != "0" else "1")).status_code == 403
    assert _get(server, keys["bob"], f"sessions/{session_id}/trace_export").status_code == 404


def test_api_key_me_and_logout(server):
    key = server.create_key("henry-logout")
    me = _get(server, key, "auth/apikey/me").json()
    assert me["name"] == "henry-logout" and isinstance(me["key_id"], int)
    assert _get(server, "tml-not-a-key", "auth/apikey/me").status_code == 401
    assert httpx.delete(f"{server.url}/api/v1/auth/apikey/me", headers={"X-API-Key": key}).status_code == 200
    assert _get(server, key, "auth/apikey/me").status_code == 401  # revoked: this key, nothing else
