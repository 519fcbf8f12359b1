"""The dashboard's JSON routes without a browser: a run page's per-token loss is loss:sum over the
weighted tokens (not the sum), MFU is "n/a" with its reason, a supervised run has no reward series;
posted samples are bounded and owner-only; operator keys come from `keys create --operator` (an
additive migration: older keys stay tenant keys) and only they read the operator summary.
The CLI side is apps/twinkle-server/tests/test_server_cli_operator.py."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import httpx
import pytest

from twinkle.hub import TEST_MODEL
from twinkle.serve.core.store import VERSION, Store
from twinkle.serve.keys import KeyStore

FIXTURE = Path(__file__).parent / "fixtures" / "store_v3.sqlite"
TOKENS = [9 + (3 * i) % 50 for i in range(16)]


@pytest.fixture(scope="module")
def run(server):
    import tinker
    from tinker import types

    key = server.create_key("dash-api")
    tc = (
        tinker.ServiceClient(base_url=server.url, api_key=key)
        .create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=2)
        .result()
    )
    weights = [0.0] * 5 + [1.0] * 7 + [0.5] * 3  # 15 targets; what loss:sum sums over weighs 8.5
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": weights},
    )
    sums = []
    for _ in range(3):
        sums.append(tc.forward_backward([datum, datum], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return key, tc.model_id, [s / 17.0 for s in sums]


def test_run_page_series_are_per_token_and_honest(server, run):
    key, model_id, per_token = run
    page = httpx.get(f"{server.url}/twinkle/v1/dashboard/runs/{model_id}", headers={"X-API-Key": key}).json()
    assert [p["value"] for p in page["series"]["loss_per_token"]] == pytest.approx(per_token, rel=1e-6)
    assert [p["step"] for p in page["series"]["loss_per_token"]] == [1, 2, 3]
    assert [p["value"] for p in page["series"]["lr"]] == pytest.approx([1e-2] * 3)
    assert len(page["series"]["grad_norm"]) == 3 and all(p["value"] > 0 for p in page["series"]["grad_norm"])
    assert [p["step"] for p in page["series"]["step_time_s"]] == [2, 3]  # a step time needs the step before
    assert all(p["value"] > 0 for p in page["series"]["tokens_per_s"])
    # MFU per step: each pass's FLOPs over its wall time, as a fraction of the measured matmul peak
    assert page["mfu"] is None and [0 < p["value"] < 1 for p in page["series"]["mfu"]] == [True] * 3
    assert "reward" not in page["series"] and "loss_tokens" not in page["series"]
    summary = httpx.get(f"{server.url}/twinkle/v1/dashboard/summary", headers={"X-API-Key": key}).json()
    (mine,) = summary["runs"]
    assert mine["loss_per_token"] == pytest.approx(per_token[-1], rel=1e-6)
    assert mine["curves"]["loss"][-1]["value"] == pytest.approx(per_token[-1] * 17.0, rel=1e-6)  # stored: the sum


def test_samples_are_bounded_and_keep_the_newest(server, run):
    key, model_id, _ = run
    url, h = f"{server.url}/twinkle/v1/dashboard/runs/{model_id}/samples", {"X-API-Key": key}
    too_long = httpx.post(url, headers=h, json={"samples": [{"prompt": "x" * 4001, "completion": "y"}]})
    assert too_long.status_code == 422 and "prompt" in too_long.text
    too_many = httpx.post(url, headers=h, json={"samples": [{"prompt": "p", "completion": "c"}] * 21})
    assert too_many.status_code == 422 and "samples" in too_many.text
    assert httpx.post(url, headers=h, json={"samples": []}).status_code == 422
    for batch in range(3):
        body = {"samples": [{"prompt": f"p{batch}-{i}", "completion": "c", "reward": i / 10} for i in range(10)]}
        assert httpx.post(url, headers=h, json=body).json()["kept"] == min(10 * (batch + 1), 20)
    kept = httpx.get(url, headers=h).json()
    assert len(kept) == 20 and kept[0]["prompt"] == "p2-9" and kept[-1]["prompt"] == "p1-0"  # newest first
    assert kept[0]["reward"] == pytest.approx(0.9)


def test_operator_summary_needs_an_operator_key(server, run):
    key, model_id, _ = run
    url = f"{server.url}/twinkle/v1/operator/summary"
    r = httpx.get(url, headers={"X-API-Key": key})
    assert r.status_code == 403 and "dash-api" in r.json()["error"] and "--operator" in r.json()["error"]
    op = server.runtime.keys.create("dash-api-op", operator=True)
    snap = httpx.get(url, headers={"X-API-Key": op}).json()
    assert "dash-api" in snap["tenants"] and any(r["model_id"] == model_id for r in snap["runs"])
    assert set(snap["queue"]) == {"depth", "pending_futures", "oldest_waiting_s"}
    assert snap["adapters"]["adapters"]["live"] >= 1 and snap["rss_bytes"] > 0
    assert set(snap["base_dtypes"].values()) == {"fp32"}  # the test model: 'auto' keeps it in fp32
    # an operator key is also a tenant key: its own (empty) dashboard works
    assert httpx.get(f"{server.url}/twinkle/v1/dashboard/summary", headers={"X-API-Key": op}).json()["runs"] == []


def test_a_v4_database_gains_roles_and_keeps_its_keys(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "twinkle.db")
    old = [r[0] for r in sqlite3.connect(tmp_path / "twinkle.db").execute("SELECT name FROM api_keys")]
    store = Store(tmp_path)
    assert store.version == VERSION >= 5
    assert {r["name"]: r["role"] for r in store.keys.list()} == dict.fromkeys(old, "tenant")
    keys = KeyStore(store)
    op, tenant = keys.create("root", operator=True), keys.create("plain")
    assert keys.is_operator(op) and not keys.is_operator(tenant) and keys.tenant_for(op) == "root"
    keys.revoke("root")
    assert not keys.is_operator(op)
    store.close()
