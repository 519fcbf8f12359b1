"""A retried submission (same X-Idempotency-Key, as the Tinker SDK sends on retries) runs once."""

from __future__ import annotations

import httpx

from twinkle.hub import TEST_MODEL


def _post(url, key, path, body, idem=None):
    headers = {"X-API-Key": key, **({"X-Idempotency-Key": idem} if idem else {})}
    return httpx.post(url + "/api/v1" + path, headers=headers, json=body, timeout=60)


def _futures(server, tenant):
    server.runtime.store.db.flush()  # a created future may still be journaled (store/db.py)
    return server.runtime.store.db.one("SELECT COUNT(*) AS n FROM futures WHERE tenant=?", (tenant,))["n"]


def _model(url, key):
    session = _post(url, key, "/create_session", {"tags": [], "sdk_version": "raw"}).json()["session_id"]
    created = _post(
        url,
        key,
        "/create_model",
        {"session_id": session, "model_seq_id": 0, "base_model": TEST_MODEL, "lora_config": {"rank": 2, "seed": 0}},
    ).json()
    assert _post(url, key, "/retrieve_future", {"request_id": created["request_id"]}).status_code == 200
    return created["model_id"]


def test_the_sdk_sends_the_header_we_honour(server, keys):
    from tinker._client import AsyncTinker

    from twinkle.serve.idempotency import HEADER

    assert AsyncTinker(base_url=server.url, api_key=keys["alice"])._idempotency_header.lower().encode() == HEADER


def test_a_retried_submit_runs_once_and_gets_the_same_future(server, keys):
    url, key = server.url, keys["alice"]
    model_id = _model(url, key)
    step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    before = _futures(server, "alice")
    first = _post(url, key, "/optim_step", step, idem="retry-1")
    again = _post(url, key, "/optim_step", step, idem="retry-1")
    assert first.status_code == again.status_code == 200
    assert again.json()["request_id"] == first.json()["request_id"]
    assert again.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
    assert _futures(server, "alice") == before + 1  # the retry queued nothing
    # the same key from another tenant is another request
    bob_model = _model(url, keys["bob"])
    other = _post(url, keys["bob"], "/optim_step", {**step, "model_id": bob_model}, idem="retry-1")
    assert other.status_code == 200 and other.json()["request_id"] != first.json()["request_id"]
    # a new key is a new request
    fresh = _post(url, key, "/optim_step", {**step, "seq_id": 2}, idem="retry-2")
    assert fresh.json()["request_id"] != first.json()["request_id"]
    assert _futures(server, "alice") == before + 2


def test_a_reused_key_on_another_request_is_409_and_refusals_are_not_stored(server, keys):
    url, key = server.url, keys["alice"]
    model_id = _model(url, key)
    step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    assert _post(url, key, "/optim_step", step, idem="k-409").status_code == 200
    clash = _post(url, key, "/optim_step", {**step, "seq_id": 7}, idem="k-409")
    assert clash.status_code == 409 and "already used for a different request" in clash.json()["error"]
    # a 4xx accepted nothing: its retry (same key) runs afresh
    bad = _post(url, key, "/optim_step", {**step, "model_id": "no-such-model"}, idem="k-404")
    assert bad.status_code == 404
    assert _post(url, key, "/optim_step", {**step, "model_id": "no-such-model"}, idem="k-404").status_code == 404
    assert "idempotent-replayed" not in bad.headers
    assert _post(url, key, "/optim_step", {**step, "seq_id": 3}, idem="k-404").status_code == 200
    assert _post(url, key, "/optim_step", step, idem="x" * 201).status_code == 400


def test_a_retry_after_a_restart_gets_the_stored_answer(start, tmp_path):
    server = start(tmp_path)
    key = server.create_key("dora")
    try:
        model_id = _model(server.url, key)
        step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
        first = _post(server.url, key, "/optim_step", step, idem="across-restart").json()["request_id"]
        assert _post(server.url, key, "/retrieve_future", {"request_id": first}).json()["type"] == "optim_step"
    finally:
        server.stop()
    server = start(tmp_path)
    try:
        again = _post(server.url, key, "/optim_step", step, idem="across-restart")
        assert again.status_code == 200 and again.json()["request_id"] == first
        assert _post(server.url, key, "/retrieve_future", {"request_id": first}).json()["type"] == "optim_step"
    finally:
        server.stop()
