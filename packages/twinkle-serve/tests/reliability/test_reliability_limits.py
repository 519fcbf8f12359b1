"""Limits on a real `twinkle-server`: the per-tenant request rate answers 429 with Retry-After; work
over the input-token rate queues, and only past its max_queue_wait_s answers 429 with Retry-After; a server-wide cap on adapter memory refuses a new adapter with a clear error, on both
APIs and across them (and frees room when a session finishes or a native model closes); request
bodies over `max_request_bytes` answer 413 on both APIs, declared or streamed (chunked)."""

from __future__ import annotations

import json
import time

import pytest
from _util_isolation import NativeWire, native_row
from harness import SUMMARY, Wire, fb_body, sft_pair

from twinkle.hub import TEST_MODEL

BODY_LIMIT = 64 * 1024


def rank8_bytes() -> int:
    from transformers import AutoModelForCausalLM

    from twinkle.hub import TEST_MODEL, resolve_model_path
    from twinkle.serve.backend import LoraSpec
    from twinkle.serve.core.adapter_memory import AdapterMemory

    class _Base:  # what the estimate reads from a backend
        base_module = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL))

    return AdapterMemory(None).estimate(_Base(), LoraSpec(rank=8))


@pytest.fixture(scope="module")
def limited(launch):
    per_adapter = rank8_bytes()
    cap_mb = 3.5 * per_adapter / 2**20  # room for three rank-8 adapters, not four
    srv, keys = launch(
        ["ratey", "tokeny", "big", "plain", "native"],
        max_request_bytes=BODY_LIMIT,
        max_adapter_memory_mb=cap_mb,
        adapter_offload=False,  # the cap refuses instead of parking (parking: test_reliability_offload)
        tenant_limits={
            "ratey": {"requests_per_s": 1.0},
            "tokeny": {"input_tokens_per_s": 20.0, "max_queue_wait_s": 1.0},
        },
    )
    return srv, keys, per_adapter, cap_mb


def test_request_rate_answers_429_with_retry_after(limited):
    srv, keys, *_ = limited
    w = Wire(srv.url, keys["ratey"])
    answers = [w.post("/create_session", {}) for _ in range(4)]
    codes = [r.status_code for r in answers]
    assert codes[0] == 200 and 429 in codes, codes
    refused = next(r for r in answers if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1 and "requests/s" in refused.json()["error"]
    time.sleep(int(refused.headers["retry-after"]))
    assert w.post("/create_session", {}).status_code == 200  # Retry-After was honest


def test_token_rate_queues_work_and_answers_429_only_past_the_longest_wait(limited):
    srv, keys, *_ = limited
    w = Wire(srv.url, keys["tokeny"])
    mid = w.create_model(w.session(), seed=1)
    tokens = list(range(10, 26))  # 15 input tokens: the 2nd waits 0.5 s for the 20/s rate, the 3rd 1.25 s

    def send(seq):
        return w.http.post(
            "/api/v1/forward_backward",
            content=fb_body(mid, seq, [sft_pair(tokens)]),
            headers={"content-type": "application/x-protobuf"},
        )

    first, second, third = send(1), send(2), send(3)
    assert first.status_code == second.status_code == 200, (first.text, second.text)  # the 2nd is queued
    assert third.status_code == 429, third.text  # its turn is past max_queue_wait_s: nothing accepted
    error = third.json()["error"]
    assert "input tokens/s" in error and "max_queue_wait_s (1 s)" in error, error
    assert int(third.headers["retry-after"]) >= 1
    w.done(first), w.done(second)
    time.sleep(int(third.headers["retry-after"]))
    assert send(3).status_code == 200  # Retry-After was honest


def test_adapter_memory_cap_refuses_a_new_adapter_clearly(limited):
    srv, keys, per_adapter, cap_mb = limited
    w = Wire(srv.url, keys["big"])
    sid = w.session()
    made = 0
    for seq in range(10):  # other tests' adapters share the cap: fill what is left
        r = w.post(
            "/create_model",
            {"session_id": sid, "model_seq_id": seq, "base_model": TEST_MODEL, "lora_config": {"rank": 8}},
        )
        if r.status_code != 200:
            break
        w.done(r)
        made += 1
    assert made >= 1 and r.status_code == 409, (made, r.status_code, r.text)
    message = r.json()["error"]
    assert "adapter memory is full" in message and "max_adapter_memory_mb" in message, message
    # finishing the session frees its adapters: a new one fits again
    w.ok(w.post(f"/sessions/{sid}/finish", {}))
    sid2 = w.session()
    deadline = time.monotonic() + 60
    while (
        r := w.post(
            "/create_model",
            {"session_id": sid2, "model_seq_id": 0, "base_model": TEST_MODEL, "lora_config": {"rank": 8}},
        )
    ).status_code == 409:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    w.done(r)
    print(
        f"\nlimits: adapter cap {cap_mb:.2f} MiB = 3.5 rank-8 adapters of {per_adapter / 2**20:.2f} MiB: "
        f"tenant got {made}, the next refused (409: {message[:60]}...), freed by finishing the session"
    )


def _wait_until_admitted(send, deadline_s: float = 60):
    """`send()` again while it answers 409 (freeing runs on the worker, after queued work)."""
    deadline = time.monotonic() + deadline_s
    while (r := send()).status_code == 409:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    return r


def test_native_adapters_count_against_the_same_cap(limited):
    srv, keys, _per_adapter, cap_mb = limited
    n, w = NativeWire(srv.url, keys["native"]), Wire(srv.url, keys["native"])
    mid = n.model(seed=1)
    n.done(n.add_adapter(mid, "a0", r=8))
    ckpt = n.done(n.post(f"/models/{mid}/save", {"adapter_name": "a0", "name": "c0"}))["path"]
    made, r = 1, None
    for i in range(1, 20):  # native rank-8 all-linear adapters until the shared cap refuses one
        r = n.add_adapter(mid, f"a{i}", r=8)
        if r.status_code != 200:
            break
        n.done(r)
        made += 1
    assert r.status_code == 409, (made, r.status_code, r.text)
    message = r.json()["error"]
    assert "adapter memory is full" in message and "max_adapter_memory_mb" in message, message
    # loading a checkpoint as a new adapter builds one too: refused the same way
    loaded = n.post(f"/models/{mid}/load", {"path": ckpt, "adapter_name": "from_ckpt"})
    assert loaded.status_code == 409 and "adapter memory is full" in loaded.json()["error"], loaded.text
    # one account across both APIs: a Tinker adapter is refused while the native ones hold the memory
    sid = w.session()
    tinker = w.post(
        "/create_model", {"session_id": sid, "model_seq_id": 0, "base_model": TEST_MODEL, "lora_config": {"rank": 8}}
    )
    assert tinker.status_code == 409 and "adapter memory is full" in tinker.json()["error"], tinker.text
    # closing the native model frees its adapters' share: the Tinker adapter fits again
    n.done(n.http.delete(f"/twinkle/v1/models/{mid}"))
    w.done(
        _wait_until_admitted(
            lambda: w.post(
                "/create_model",
                {"session_id": sid, "model_seq_id": 0, "base_model": TEST_MODEL, "lora_config": {"rank": 8}},
            )
        )
    )
    w.ok(w.post(f"/sessions/{sid}/finish", {}))
    mid2 = n.model(seed=2)  # and, once that session is finished, a native one again
    n.done(_wait_until_admitted(lambda: n.add_adapter(mid2, "again", r=8)))
    print(
        f"\nlimits (native): {made} native rank-8 adapters fit the {cap_mb:.2f} MiB cap, the next add and a "
        "checkpoint load were refused (409), and so was a Tinker adapter; closing the model freed them"
    )


def _chunks(total: int, parts: int = 8):
    """A body with no Content-Length (httpx streams a generator chunked): counted while streaming."""
    for _ in range(parts):
        yield b"\x00" * (total // parts)


def test_bodies_over_the_limit_answer_413(limited):
    srv, keys, *_ = limited
    w, n = Wire(srv.url, keys["plain"]), NativeWire(srv.url, keys["plain"])
    big = b"\x00" * (BODY_LIMIT + 1)
    declared = w.http.post("/api/v1/forward_backward", content=big, headers={"content-type": "application/x-protobuf"})
    assert declared.status_code == 413 and "max_request_bytes" in declared.json()["error"]
    streamed = w.http.post(
        "/api/v1/forward_backward", content=_chunks(2 * BODY_LIMIT), headers={"content-type": "application/x-protobuf"}
    )
    assert streamed.status_code == 413 and "max_request_bytes" in streamed.json()["error"], streamed.text
    json_big = w.http.post(
        "/api/v1/create_session",
        content=b'{"tags": ["' + b"x" * BODY_LIMIT + b'"]}',
        headers={"content-type": "application/json"},
    )
    assert json_big.status_code == 413
    # the native API: a model with an adapter, then oversized bodies on its typed (pydantic) routes
    mid = n.model(seed=3)
    n.done(n.add_adapter(mid))
    rows = {"inputs": {"rows": [native_row([5] * (BODY_LIMIT // 2))]}}  # ~3 bytes a token in JSON: over
    native = {
        "declared": n.post(f"/models/{mid}/forward_backward", rows),
        "streamed": n.http.post(
            f"/twinkle/v1/models/{mid}/forward_backward",
            content=_chunks(2 * BODY_LIMIT),
            headers={"content-type": "application/json"},
        ),
        "streamed, create": n.http.post(
            "/twinkle/v1/models", content=_chunks(2 * BODY_LIMIT), headers={"content-type": "application/json"}
        ),
    }
    wrong = {
        k: (r.status_code, r.text[:120])
        for k, r in native.items()
        if r.status_code != 413 or "max_request_bytes" not in r.json()["error"]
    }
    assert not wrong, wrong
    # bodies under the limit still work, streamed or not, and the server is fine afterwards
    small = n.http.post(
        f"/twinkle/v1/models/{mid}/forward_backward",
        headers={"content-type": "application/json"},
        content=iter([b'{"inputs": {"rows": [', json.dumps(native_row()).encode(), b"]}}"]),
    )
    assert n.wait(n.ok(small)["request_id"])["status"] == "complete"
    assert w.post("/create_session", {}).status_code == 200
    SUMMARY["limits"] = (
        "429 + Retry-After (requests/s; tokens/s only past max_queue_wait_s, queued before), adapter-memory cap 409 (Tinker and native, one "
        "account), 413 over max_request_bytes (declared or chunked, both APIs)"
    )
