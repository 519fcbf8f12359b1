"""Limits on a real `twinkle-server`: per-tenant request and input-token rates answer 429 with
Retry-After; a server-wide cap on adapter memory refuses a new adapter with a clear error (and
frees room when a session finishes); request bodies over `max_request_bytes` answer 413."""

from __future__ import annotations

import time

import pytest
from harness import SUMMARY, Wire, fb_body, sft_pair

BODY_LIMIT = 64 * 1024


def rank8_bytes() -> int:
    from transformers import AutoModelForCausalLM

    from twinkle.hub import TEST_MODEL, resolve_model_path
    from twinkle.serve.adapter_memory import AdapterMemory
    from twinkle.serve.backend import LoraSpec

    class _Base:  # what the estimate reads from a backend
        base_module = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL))

    return AdapterMemory(None).estimate(_Base(), LoraSpec(rank=8))


@pytest.fixture(scope="module")
def limited(launch):
    per_adapter = rank8_bytes()
    cap_mb = 3.5 * per_adapter / 2**20  # room for three rank-8 adapters, not four
    srv, keys = launch(["ratey", "tokeny", "big", "plain"], max_request_bytes=BODY_LIMIT, max_adapter_memory_mb=cap_mb,
                       tenant_limits={"ratey": {"requests_per_s": 1.0}, "tokeny": {"input_tokens_per_s": 20.0}})
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


def test_token_rate_answers_429_with_retry_after(limited):
    srv, keys, *_ = limited
    w = Wire(srv.url, keys["tokeny"])
    mid = w.create_model(w.session(), seed=1)
    tokens = list(range(10, 26))  # 15 input tokens: one fits the 20/s bucket, two back to back do not
    first = w.http.post("/api/v1/forward_backward", content=fb_body(mid, 1, [sft_pair(tokens)]),
                        headers={"content-type": "application/x-protobuf"})
    second = w.http.post("/api/v1/forward_backward", content=fb_body(mid, 2, [sft_pair(tokens)]),
                         headers={"content-type": "application/x-protobuf"})
    assert first.status_code == 200 and second.status_code == 429, (first.text, second.text)
    assert int(second.headers["retry-after"]) >= 1 and "input tokens/s" in second.json()["error"]


def test_adapter_memory_cap_refuses_a_new_adapter_clearly(limited):
    srv, keys, per_adapter, cap_mb = limited
    w = Wire(srv.url, keys["big"])
    sid = w.session()
    made = 0
    for seq in range(10):  # other tests' adapters share the cap: fill what is left
        r = w.post("/create_model", {"session_id": sid, "model_seq_id": seq, "lora_config": {"rank": 8}})
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
    while (r := w.post("/create_model", {"session_id": sid2, "model_seq_id": 0,
                                         "lora_config": {"rank": 8}})).status_code == 409:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    w.done(r)
    print(f"\nlimits: adapter cap {cap_mb:.2f} MiB = 3.5 rank-8 adapters of {per_adapter / 2**20:.2f} MiB: "
          f"tenant got {made}, the next refused (409: {message[:60]}...), freed by finishing the session")


def test_bodies_over_the_limit_answer_413(limited):
    srv, keys, *_ = limited
    w = Wire(srv.url, keys["plain"])
    big = b"\x00" * (BODY_LIMIT + 1)
    declared = w.http.post("/api/v1/forward_backward", content=big, headers={"content-type": "application/x-protobuf"})
    assert declared.status_code == 413 and "max_request_bytes" in declared.json()["error"]

    def chunks():  # no Content-Length: counted while streaming
        for _ in range(8):
            yield b"\x00" * (BODY_LIMIT // 4)

    streamed = w.http.post("/api/v1/forward_backward", content=chunks(),
                           headers={"content-type": "application/x-protobuf"})
    assert streamed.status_code == 413, streamed.text
    json_big = w.http.post("/api/v1/create_session", content=b'{"tags": ["' + b"x" * BODY_LIMIT + b'"]}',
                           headers={"content-type": "application/json"})
    assert json_big.status_code == 413
    assert w.post("/create_session", {}).status_code == 200  # the server is fine afterwards
    SUMMARY["limits"] = "429 + Retry-After (requests/s, tokens/s), adapter-memory cap 409, 413 over max_request_bytes"
