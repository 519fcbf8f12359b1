"""Fuzzing a real `twinkle-server`: schemathesis over its /openapi.json, and a protobuf fuzzer for
the forward_backward body. Neither may ever get a 5xx or hang (every request has a 30 s timeout).

The Tinker routes read their JSON bodies by hand (the SDK is the specification), so /openapi.json
declares no body for them; the fuzzer adds one, an object with the fields those routes read and
values of any type, so schemathesis exercises the routes' parsing too.

Counts: RELIABILITY_FUZZ_REQUESTS (default 5000, the issue's floor) schemathesis requests over every
operation of both APIs and RELIABILITY_PROTO_FUZZ (default 1000) protobuf bodies: ~100 s together here.
"""

from __future__ import annotations

import os
import random
import time

import httpx
import pytest
from harness import SUMMARY, Wire, fb_body, sft_pair

REQUESTS = int(os.environ.get("RELIABILITY_FUZZ_REQUESTS", "5000"))
PROTO_CASES = int(os.environ.get("RELIABILITY_PROTO_FUZZ", "1000"))
TIME_BUDGET_S = float(os.environ.get("RELIABILITY_FUZZ_SECONDS", "600"))
FIELDS = [
    "session_id",
    "model_id",
    "model_seq_id",
    "base_model",
    "lora_config",
    "path",
    "seq_id",
    "adam_params",
    "optimizer_params",
    "sampling_session_id",
    "sampling_session_seq_id",
    "model_path",
    "prompt",
    "num_samples",
    "sampling_params",
    "request_id",
    "tinker_path",
    "ttl_seconds",
    "reason",
    "optimizer",
    "overwrite",
    "user_metadata",
    "tags",
    "prompt_logprobs",
    "topk_prompt_logprobs",
]
SEQ = [5 + (7 * i) % 60 for i in range(16)]


@pytest.fixture(scope="module")
def fuzz_server(launch):
    # short long-poll: a fuzzed retrieve_future must not sit out the default 25 s
    return launch(["fuzzer", "other"], long_poll_s=1.0, limits={"max_models": 64})


def _with_bodies(spec: dict) -> dict:
    body = {"content": {"application/json": {"schema": {"type": "object", "properties": {f: {} for f in FIELDS}}}}}
    # forward_backward's body is protobuf, which schemathesis cannot write: its own fuzzer covers it
    spec["paths"]["/api/v1/forward_backward"]["post"].pop("requestBody", None)
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            if method in ("post", "put") and "requestBody" not in op and path != "/api/v1/forward_backward":
                op["requestBody"] = body
    return spec


def test_schemathesis_no_5xx_no_hang(fuzz_server):
    import schemathesis
    from hypothesis import HealthCheck, given, seed, settings

    srv, keys = fuzz_server
    spec = _with_bodies(httpx.get(f"{srv.url}/openapi.json", timeout=30).json())
    schema = schemathesis.openapi.from_dict(spec)
    # DELETE /auth/apikey/me revokes the calling key (`tinker auth logout`): fuzzed, it would end the run
    operations = [
        op
        for op in (r.ok() for r in schema.get_all_operations())
        if (op.method.upper(), op.path) != ("DELETE", "/api/v1/auth/apikey/me")
    ]
    statuses: dict[int, int] = {}
    failures: list[str] = []
    sent = 0
    started = time.monotonic()
    per_op = max(5, REQUESTS // len(operations) // 3)
    rounds = 0

    def one(case):
        nonlocal sent
        if sent >= REQUESTS or time.monotonic() - started > TIME_BUDGET_S:
            return
        headers = {"X-API-Key": keys["fuzzer"]} if random.random() < 0.9 else {}
        try:
            r = case.call(base_url=srv.url, headers=headers, timeout=30)
        except Exception as e:
            failures.append(f"{case.method} {case.formatted_path}: {type(e).__name__}: {e}")
            return
        finally:
            sent += 1
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code >= 500:
            failures.append(
                f"{case.method} {case.formatted_path} -> {r.status_code}: {r.text[:200]} "
                f"(body {getattr(case, 'body', None)!r:.200})"
            )

    while sent < REQUESTS and time.monotonic() - started < TIME_BUDGET_S and rounds < 50:
        for op in operations:
            settings_ = settings(
                max_examples=per_op,
                deadline=None,
                database=None,
                derandomize=False,
                suppress_health_check=list(HealthCheck),
            )
            seed(rounds * 1000 + operations.index(op))(settings_(given(op.as_strategy())(one)))()
        rounds += 1
    elapsed = time.monotonic() - started
    print(
        f"\nschemathesis: {sent} requests over {len(operations)} operations in {elapsed:.0f} s; "
        f"statuses {dict(sorted(statuses.items()))}; 5xx/hangs: {len(failures)}"
    )
    assert not failures, failures[:20]
    assert sent >= REQUESTS, f"only {sent} of {REQUESTS} requests within {TIME_BUDGET_S:.0f} s"
    assert srv.proc.poll() is None
    SUMMARY["requests fuzzed (schemathesis), 0 5xx"] = f"{sent} over {len(operations)} operations"


def _mutations(valid: bytes, mid: str, rng: random.Random):
    """Random bytes, truncations, bit flips, wrong dtypes, wrong shapes."""
    from twinkle.serve.tinker import wire_proto as pb

    kind = rng.randrange(6)
    if kind == 0:
        return "random bytes", bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 400)))
    if kind == 1:
        return "truncated", valid[: rng.randrange(0, len(valid))]
    if kind == 2:
        b = bytearray(valid)
        for _ in range(rng.randrange(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return "bit flips", bytes(b)
    tokens, inputs = sft_pair(SEQ)
    if kind == 3:
        dtype = rng.choice([0, pb.DTYPE_BFLOAT16, 9, 77])  # unset, unsupported, unknown
        return "wrong dtype", fb_body(mid, 0, [(tokens, inputs)], dtypes={"weights": dtype, "target_tokens": dtype})
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(valid)
    t = msg.data[0].loss_fn_inputs["weights"]
    del t.shape[:]
    t.shape.extend(rng.choice([[4, 5], [0], [len(tokens) + 1], [-1], [2**40, 2**40], [1, 1, 1, 1, 1, 1, 1, 1]]))
    if kind == 5:
        t.dense = t.dense[: rng.randrange(0, len(t.dense))]
    return "wrong shape", msg.SerializeToString()


def test_protobuf_forward_backward_fuzz_gets_only_4xx(fuzz_server):
    srv, keys = fuzz_server
    w = Wire(srv.url, keys["fuzzer"], timeout=30)
    mid = w.create_model(w.session(), seed=3)
    valid = fb_body(mid, 0, [sft_pair(SEQ)])
    rng = random.Random(20261129)
    kinds: dict[str, int] = {}
    answers: dict[str, int] = {}
    wrong = []
    for _ in range(PROTO_CASES):
        kind, body = _mutations(valid, mid, rng)
        kinds[kind] = kinds.get(kind, 0) + 1
        r = w.http.post("/api/v1/forward_backward", content=body, headers={"content-type": "application/x-protobuf"})
        if r.status_code == 200:  # accepted: the shape/dtype problem must surface as a user error, not a result
            got, out = w.result(r.json()["request_id"], 60)
            label = f"future {got}:{out.get('category') if isinstance(out, dict) else ''}"
            # a mutation may still be a valid request (then it trains); what may never happen is a server
            # error, or a wrong dtype / shape being accepted as data
            refused = got == "error" and out["category"] == "user"
            if (got == "error" and not refused) or (kind in ("wrong dtype", "wrong shape") and not refused):
                wrong.append((kind, label, out if isinstance(out, dict) else len(out)))
        else:
            label = str(r.status_code)
            if not 400 <= r.status_code < 500:
                wrong.append((kind, r.status_code, r.text[:200]))
        answers[label] = answers.get(label, 0) + 1
    print(f"\nprotobuf fuzz: {PROTO_CASES} forward_backward bodies {kinds}; answers {answers}")
    assert not wrong, wrong[:10]
    assert srv.proc.poll() is None
    SUMMARY["forward_backward protobuf bodies fuzzed"] = f"{PROTO_CASES}, only 4xx or user-category errors"
