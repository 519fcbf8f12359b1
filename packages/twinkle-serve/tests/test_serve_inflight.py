"""Inflight sampling clients (SDK 0.38 `save_weights_and_get_sampling_client(kind="inflight")`) through the
unmodified SDK against the real server: the contract `tinker/types/sampling_client_kind.py` documents.

- an existing inflight client samples with the weights of a later inflight save (log-probs and greedy
  token ids equal a snapshot of each version), and a snapshot client never changes;
- two inflight clients share no KV (`prompt_cache_hit_tokens` of the SDK's SampleResponse), a serialized
  copy of one shares its session's, and a new save opens a new namespace;
- a sample spanning an update completes (on the weights it began with), and the save did not wait for it.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from twinkle.hub import TEST_MODEL

TENANT = "inflight"
PROMPT = [5 + (7 * i) % 60 for i in range(12)]
TARGET = [311, 312, 313, 314]
LONG = 800  # decode steps of the sample that spans an update: longer than a training step and a save


@pytest.fixture(scope="module")
def service(server, tenant_key):
    import tinker

    return tinker.ServiceClient(base_url=server.url, api_key=tenant_key)


@pytest.fixture
def tc(service):
    return service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=3).result()


def train(tc, steps: int = 1) -> None:
    """Adam steps toward PROMPT -> TARGET, large enough that greedy decoding of PROMPT changes."""
    from tinker import types

    seq = PROMPT + TARGET
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [0.0] * (len(PROMPT) - 1) + [1.0] * len(TARGET)},
    )
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.1)).result()


def inflight(tc):
    return tc.save_weights_and_get_sampling_client(kind="inflight").result()


def snapshot(tc):
    return tc.save_weights_and_get_sampling_client().result()


def sample(sc, max_tokens: int = 6, prompt=PROMPT):
    from tinker import types

    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[])
    return sc.sample(types.ModelInput.from_ints(prompt), 1, params).result()


def tokens(sc, max_tokens: int = 6) -> list[int]:
    return list(sample(sc, max_tokens).sequences[0].tokens)


def logprobs(sc) -> np.ndarray:
    from tinker import types

    return np.array(sc.compute_logprobs(types.ModelInput.from_ints(PROMPT + TARGET)).result()[1:], dtype=np.float64)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def session_id(sc) -> str:
    import base64
    import json

    return json.loads(base64.urlsafe_b64decode(sc.get_sampler_handle()))["sampling_session_id"]


def test_an_inflight_client_samples_the_newest_weights_and_a_snapshot_never_changes(tc):
    a = inflight(tc)
    first = snapshot(tc)
    v1_lps, v1_tokens = logprobs(first), tokens(first)
    assert_same(logprobs(a), v1_lps)
    assert tokens(a) == v1_tokens

    train(tc)
    b = inflight(tc)  # the later save: `a` follows it too
    second = snapshot(tc)
    v2_lps, v2_tokens = logprobs(second), tokens(second)
    assert np.abs(v2_lps - v1_lps).max() > 0.1 and v2_tokens != v1_tokens  # the steps changed the weights
    for client in (a, b):
        assert_same(logprobs(client), v2_lps)
        assert tokens(client) == v2_tokens
    assert_same(logprobs(first), v1_lps)  # the snapshot still serves what it captured
    assert tokens(first) == v1_tokens

    train(tc)  # training alone publishes nothing: inflight clients move at the next inflight save
    assert tokens(a) == v2_tokens
    assert_same(logprobs(b), v2_lps)


def test_inflight_clients_share_no_kv_and_each_save_opens_a_namespace(tc, tenant_key):
    from tinker import SamplingClient

    a, b = inflight(tc), inflight(tc)  # no step between: the same weights, two sessions
    reused = len(PROMPT) - 1  # a repeated prompt prefills only its last token
    assert sample(a).prompt_cache_hit_tokens == 0
    assert sample(a).prompt_cache_hit_tokens == reused
    copy = SamplingClient.from_sampler_handle(a.get_sampler_handle(), api_key=tenant_key)
    assert sample(copy).prompt_cache_hit_tokens == reused  # a serialized copy is the same session
    first_b = sample(b)
    assert first_b.prompt_cache_hit_tokens == 0  # the same weights and prompt, another session: no KV shared
    assert sample(b).prompt_cache_hit_tokens == reused
    assert first_b.sequences[0].tokens == sample(a).sequences[0].tokens

    c = inflight(tc)  # still no step: a new save is a new namespace all the same
    assert sample(c).prompt_cache_hit_tokens == 0
    # `a` and `b` keep their namespaces, but KV computed under an earlier version is never reused
    assert sample(a).prompt_cache_hit_tokens == 0
    assert sample(a).prompt_cache_hit_tokens == reused


def test_a_sample_spanning_an_update_completes(server, tc):
    from tinker import types

    rt = server.runtime
    a, first = inflight(tc), snapshot(tc)
    long = types.SamplingParams(max_tokens=LONG, temperature=0.0, stop=[])
    pending = a.sample(types.ModelInput.from_ints(PROMPT), 1, long)
    running_since = time.monotonic()
    while True:  # until the server runs it (a decode in slices: later requests run between its steps)
        row = rt.store.db.one("SELECT request_id FROM sample_requests WHERE sampler_id=?", (session_id(a),))
        place = row and rt.engines[TEST_MODEL].scheduler.where(row["request_id"])
        if place and place.reason.startswith("running"):
            break
        assert time.monotonic() - running_since < 60 and not pending.future().done(), "the long sample never ran"
        time.sleep(0.005)

    train(tc)
    b = inflight(tc)
    assert rt.store.futures.get(row["request_id"], TENANT).status == "pending", "the update waited for the sample"
    assert tokens(a) == tokens(b) != tokens(first)  # a sample starting now runs on the newest version

    out = pending.result().sequences[0].tokens
    assert len(out) == LONG
    assert out == sample(first, LONG).sequences[0].tokens  # it finished on the weights it began with


def test_kind_is_checked(server, tc, tenant_key):
    url, headers = f"{server.url}/api/v1/save_weights_for_sampler", {"X-API-Key": tenant_key}
    bad = {"model_id": tc.model_id, "sampling_session_seq_id": 900, "kind": "live"}
    r = httpx.post(url, json=bad, headers=headers)
    assert r.status_code == 400 and "kind = 'live'" in r.json()["error"] and "'inflight'" in r.json()["error"]
    named = {"model_id": tc.model_id, "path": "named", "kind": "inflight"}
    r = httpx.post(url, json=named, headers=headers)
    assert r.status_code == 400 and "send it without a path" in r.json()["error"]


def test_dmel_chunks_are_refused_by_name(tc):
    """DmelChunk (audio) on every route that takes a ModelInput: a 400 naming it and who would take it."""
    import tinker
    from tinker import types

    audio = types.DmelChunk(dmel=bytes([0, 2, 4, 80]) + bytes(4 * 80))  # a TensorContainer header: uint8 [4, 80]
    model_input = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=PROMPT), audio])
    assert model_input.length == len(PROMPT) + 4
    n = model_input.length
    datum = types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": [7] * n, "weights": [1.0] * n})
    sc = snapshot(tc)
    calls = {
        "forward_backward": lambda: tc.forward_backward([datum], "cross_entropy").result(),
        "forward": lambda: tc.forward([datum], "cross_entropy").result(),
        "sample": lambda: sc.sample(model_input, 1, types.SamplingParams(max_tokens=2)).result(),
        "compute_logprobs": lambda: sc.compute_logprobs(model_input).result(),
    }
    for name, call in calls.items():
        with pytest.raises(tinker.BadRequestError) as err:
            call()
        message = str(err.value)
        assert "DmelChunk (audio as DMel tokens) is refused" in message, name
        assert "only speech model families trained on DMel tokens take it, and this server serves none" in message
