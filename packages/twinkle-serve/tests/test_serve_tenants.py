"""Auth, tenant isolation, per-tenant limits, and bad requests failing only their own future."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from twinkle.hub import TEST_MODEL

SEQ = [9 + (11 * i) % 80 for i in range(16)]


def test_every_route_needs_a_valid_key(server, keys):
    for method, path in (
        ("get", "/api/v1/healthz"),
        ("post", "/api/v1/client/config"),
        ("get", "/api/v1/training_runs"),
        ("post", "/api/v1/retrieve_future"),
    ):
        for headers in ({}, {"X-API-Key": "tml-not-a-real-key"}, {"X-API-Key": "no-prefix"}):
            r = httpx.request(method, server.url + path, headers=headers, json={})
            assert r.status_code == 401, (path, headers, r.text)
            assert "keys create" in r.json()["error"]
    r = httpx.get(server.url + "/api/v1/healthz", headers={"X-API-Key": keys["alice"]})
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_probes_need_no_key_and_say_nothing_more(server):
    # orchestrators probe without credentials; the detailed status stays behind the key
    assert httpx.get(server.url + "/livez").json() == {"status": "alive"}
    ready = httpx.get(server.url + "/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}


def test_tenants_cannot_see_or_load_each_others_objects(alice, bob, sft):
    import tinker

    tc = alice.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0).result()
    path = tc.save_state("private").result().path
    bob_rest = bob.create_rest_client()
    assert tc.model_id not in {r.training_run_id for r in bob_rest.list_training_runs(limit=100).result().training_runs}
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_training_run(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.list_checkpoints(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.delete_checkpoint(tc.model_id, "weights/private").result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(path).result()
    # publishing makes it loadable by others (read-only: still not listed as theirs)
    alice.create_rest_client().publish_checkpoint_from_tinker_path(path).result()
    copy = bob.create_training_client_from_state(path).result()
    assert copy.forward([sft(SEQ)], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        tc.forward([sft(SEQ)], "cross_entropy").result().metrics["loss:sum"], rel=1e-5
    )


def _raw(server, key, path, body):
    return httpx.post(server.url + "/api/v1" + path, headers={"X-API-Key": key}, json=body, timeout=30)


def test_limits_answer_429_with_retry_after(server, keys):
    key = keys["carol"]
    session = _raw(server, key, "/create_session", {"tags": [], "sdk_version": "raw"}).json()["session_id"]
    sampler = _raw(
        server,
        key,
        "/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "base_model": TEST_MODEL},
    ).json()["sampling_session_id"]
    big = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "num_samples": 1,
        "sampling_params": {"max_tokens": 1},
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5] * 5000}]},
    }
    r = _raw(server, key, "/asample", big)
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 and "4096" in r.json()["error"]
    statuses = []
    for n in range(4):  # carol may hold 3 models
        r = _raw(
            server,
            key,
            "/create_model",
            {"session_id": session, "model_seq_id": n, "base_model": TEST_MODEL, "lora_config": {"rank": 1}},
        )
        statuses.append(r.status_code)
        if r.status_code == 200:  # the model limit counts loaded models: the create finishes before the next
            future = _raw(server, key, "/retrieve_future", {"request_id": r.json()["request_id"]})
            assert future.status_code == 200
    assert statuses == [200, 200, 200, 429]
    # requests/s: erin may make 2 per second; a burst of 10 is partly refused, with Retry-After
    answers = [httpx.get(server.url + "/api/v1/training_runs", headers={"X-API-Key": keys["erin"]}) for _ in range(10)]
    assert answers[0].status_code == 200
    refused = [r for r in answers if r.status_code == 429]
    assert refused and all(int(r.headers["Retry-After"]) >= 1 for r in refused)


def test_bad_requests_fail_only_their_own_future(alice, sft):
    import tinker
    from tinker import types

    tc = alice.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=4).result()
    good = tc.forward([sft(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    bad_token = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 10**6]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    nan_weights = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, float("nan"), 1.0]},
    )
    short = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
    )
    for datum, loss, message in (
        (bad_token, "cross_entropy", "outside the vocabulary"),
        (nan_weights, "cross_entropy", "NaN"),
        (short, "cross_entropy", "shape mismatch"),
        (sft(SEQ), "no_such_loss", "unknown loss_fn"),
        (sft(SEQ), "ppo", "needs loss_fn_inputs"),
    ):
        with pytest.raises(tinker.RequestFailedError, match=message) as err:
            tc.forward_backward([datum], loss).result()
        assert err.value.category == "user"
    # nothing was applied by the failed calls, and the model still trains
    assert tc.forward([sft(SEQ)], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(good, rel=1e-6)
    tc.forward_backward([sft(SEQ)], "cross_entropy")
    assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm:mean"] > 0
    assert np.isfinite(tc.forward([sft(SEQ)], "cross_entropy").result().metrics["loss:sum"])
