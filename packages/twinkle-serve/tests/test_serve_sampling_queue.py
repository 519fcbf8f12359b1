"""`retrieve_futures`, `cancel_future` and `join_sampling_session`: through the unmodified SDK (with
the server's flags `sample_use_retrieve_futures` / `sample_join_sampling_session` switched on for one
client) and as raw HTTP shaped exactly as the SDK sends them."""

from __future__ import annotations

import pickle
import threading

import httpx
import pytest

from twinkle.hub import TEST_MODEL
from twinkle.serve.core.work import Call, StoredAnswer

PROMPT = [5 + (7 * i) % 60 for i in range(8)]


def _post(server, key, path, body):
    return httpx.post(f"{server.url}/api/v1/{path}", json=body, headers={"X-API-Key": key}, timeout=60)


def _asample_body(sampler_id, seq_id=0):
    from tinker import types

    # what SamplingClient._send_asample_request posts
    req = types.SampleRequest(
        sampling_session_id=sampler_id,
        seq_id=seq_id,
        num_samples=1,
        prompt=types.ModelInput.from_ints(PROMPT),
        sampling_params=types.SamplingParams(max_tokens=4, seed=3),
    )
    return req.model_dump(mode="json", exclude_none=True)


@pytest.fixture
def queue_flags(monkeypatch):
    """A ServiceClient made inside sees the session completion queue and clone joining switched on."""
    from twinkle.serve.tinker import routes, sampling_queue

    monkeypatch.setitem(routes.CLIENT_CONFIG, "sample_use_retrieve_futures", True)
    monkeypatch.setitem(routes.CLIENT_CONFIG, "sample_join_sampling_session", True)
    polls = []
    real = sampling_queue.retrieve_futures

    async def counted(rt, tenant, body):
        polls.append(body)
        return await real(rt, tenant, body)

    monkeypatch.setattr(sampling_queue, "retrieve_futures", counted)
    return polls


def test_sdk_samples_through_the_completion_queue_and_clones_join(server, keys, alice, queue_flags):
    import tinker
    from tinker import types

    params = types.SamplingParams(max_tokens=5, seed=9, temperature=1.0)
    prompt = types.ModelInput.from_ints(PROMPT)
    expected = alice.create_sampling_client(base_model=TEST_MODEL).result().sample(prompt, 2, params).result()
    client = tinker.ServiceClient(base_url=server.url, api_key=keys["alice"])
    sampler = client.create_sampling_client(base_model=TEST_MODEL).result()
    futures = [sampler.sample(prompt, 2, params) for _ in range(3)]
    for f in futures:
        assert [s.tokens for s in f.result().sequences] == [s.tokens for s in expected.sequences]
    assert any(p.target.sampling_session_id == sampler._sampling_session_id for p in queue_flags)
    clone = pickle.loads(pickle.dumps(sampler))  # a shadow client: the server allocates its clone id
    out = clone.sample(prompt, 2, params).result()
    assert [s.tokens for s in out.sequences] == [s.tokens for s in expected.sequences]
    assert clone._cloned_sampler_id == 1
    assert any(p.target.cloned_sampler_id == 1 for p in queue_flags)


def test_retrieve_futures_raw_cursor_and_acks(server, keys, alice):
    sampler_id = alice.create_sampling_client(base_model=TEST_MODEL).result()._sampling_session_id
    key = keys["alice"]
    ids = [_post(server, key, "asample", _asample_body(sampler_id, seq)).json()["request_id"] for seq in range(2)]
    seen, cursor = set(), 0
    while len(seen) < 2:
        r = _post(
            server,
            key,
            "retrieve_futures",
            {
                "target": {"type": "sampling_session", "sampling_session_id": sampler_id, "cloned_sampler_id": 0},
                "prev_cursor": cursor,
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["cursor"] >= cursor
        for c in body["completions"]:
            assert c["state"] == "finished" and c["response_payload_uncompressed_size"] > 0
            seen.add(c["request_id"])
        cursor = body["cursor"]
    assert seen == set(ids)
    # past the cursor nothing is new; an immediate (timeout 0) poll answers at once
    again = _post(
        server,
        key,
        "retrieve_futures",
        {
            "target": {"sampling_session_id": sampler_id},
            "prev_cursor": cursor,
            "timeout": 0,
            "retrieved_request_ids": ids,
        },
    ).json()
    assert again == {"completions": [], "cursor": cursor}
    # acknowledged ids are forgotten: from cursor 0 they are not reported again
    assert (
        _post(server, key, "retrieve_futures", {"target": {"sampling_session_id": sampler_id}, "timeout": 0}).json()[
            "completions"
        ]
        == []
    )
    # the results themselves stay retrievable
    r = _post(server, key, "retrieve_future", {"request_id": ids[0]})
    assert r.headers["content-type"] == "application/x-protobuf"


def test_retrieve_futures_isolation_and_bad_input(server, keys, alice):
    sampler_id = alice.create_sampling_client(base_model=TEST_MODEL).result()._sampling_session_id
    r = _post(server, keys["bob"], "retrieve_futures", {"target": {"sampling_session_id": sampler_id}})
    assert r.status_code == 404 and sampler_id in r.json()["error"]
    r = _post(server, keys["alice"], "retrieve_futures", {"prev_cursor": 0})
    assert r.status_code == 400 and "target" in r.json()["error"]
    r = _post(
        server, keys["alice"], "retrieve_futures", {"target": {"sampling_session_id": sampler_id}, "prev_cursor": -1}
    )
    assert r.status_code == 400 and "prev_cursor" in r.json()["error"]
    r = _post(server, keys["bob"], "join_sampling_session", {"sampling_session_id": sampler_id})
    assert r.status_code == 404
    r = _post(server, keys["alice"], "join_sampling_session", {"sampling_session_id": sampler_id})
    assert r.status_code == 200 and r.json()["client_counter"] >= 1


def test_cancel_future_drops_a_queued_sample(server, keys, alice):
    rt = server.runtime
    engine = rt.engines[TEST_MODEL]
    sampler_id = alice.create_sampling_client(base_model=TEST_MODEL).result()._sampling_session_id
    release = threading.Event()
    blocker = rt.hub.create("alice")  # holds the worker so the sample stays queued
    engine.scheduler.submit(Call("test-blocker", None, blocker, lambda: (release.wait(60), StoredAnswer.json({}))[1]))
    try:
        queued = _post(server, keys["alice"], "asample", _asample_body(sampler_id)).json()["request_id"]
        assert _post(server, keys["bob"], "cancel_future", {"request_id": queued}).status_code == 404
        r = _post(server, keys["alice"], "cancel_future", {"request_id": queued})  # the SDK's body, exactly
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
    finally:
        release.set()
    failed = _post(server, keys["alice"], "retrieve_future", {"request_id": queued}).json()
    assert "cancelled" in failed["error"] and failed["category"] == "user"
    # a finished sample is left alone, and says so; a training future cannot be cancelled
    done = _post(server, keys["alice"], "asample", _asample_body(sampler_id, 1)).json()["request_id"]
    _post(server, keys["alice"], "retrieve_future", {"request_id": done})
    assert _post(server, keys["alice"], "cancel_future", {"request_id": done}).json()["status"] == "finished"
    r = _post(server, keys["alice"], "cancel_future", {"request_id": blocker})
    assert r.status_code == 400 and "only sampling" in r.json()["error"]
    r = _post(server, keys["alice"], "cancel_future", {"request_id": 5})
    assert r.status_code == 400 and "request_id" in r.json()["error"]
