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


# ---- property tests over the request schemas (issue 43) --------------------------------------------------
# Every numeric field of the Tinker bodies (twinkle.serve.tinker.bodies) and the native schema
# (twinkle.client.schema), found by walking the pydantic models, not listed by hand: a value outside its
# declared range, a non-finite float, or null where the type has no None (what the SDK sends for a NaN)
# is refused (400 / 422) naming the field; and any JSON value in any field gets no 5xx.
SCHEMA_EXAMPLES = int(os.environ.get("RELIABILITY_SCHEMA_EXAMPLES", "30"))  # per schema and property


def _leaves(model, prefix=(), numeric=True) -> list[tuple[tuple, object]]:
    """(path, FieldInfo) of the model's fields, nested models walked: the numeric ones, or all."""
    from typing import get_args

    from pydantic import BaseModel

    out = []
    for name, info in model.model_fields.items():
        kinds = (info.annotation, *get_args(info.annotation))
        nested = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if nested is not None:
            out += _leaves(nested, (*prefix, name), numeric)
        if not numeric or ({int, float} & set(kinds) and bool not in kinds):
            out.append(((*prefix, name), info))
    return out


def _set(body: dict, path: tuple, value) -> dict:
    import copy

    out = copy.deepcopy(body)
    node = out
    for part in path[:-1]:
        node = node.setdefault(part, {}) if isinstance(node.get(part), dict) or part not in node else node[part]
    node[path[-1]] = value
    return out


def _bad_numbers(model, path: tuple, info):
    """Values the field must refuse: null (unless its type allows None), non-finite, outside its range."""
    import math
    from typing import get_args

    from hypothesis import strategies as st

    from twinkle.serve.tinker.bodies import range_of

    kinds = (info.annotation, *get_args(info.annotation))
    options = [] if type(None) in kinds else [st.none()]
    options.append(st.sampled_from([math.nan, math.inf, -math.inf]))
    rng = range_of(model, path)
    if rng is not None and rng.integer:
        options.append(st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()))
    if rng is not None and rng.lo is not None:
        below = st.floats(max_value=rng.lo, exclude_max=not rng.lo_open, allow_nan=False, allow_infinity=False)
        options.append(st.integers(max_value=math.ceil(rng.lo) - 1) if rng.integer else below)
    if rng is not None and rng.hi is not None:
        above = st.floats(min_value=rng.hi, exclude_min=not rng.hi_open, allow_nan=False, allow_infinity=False)
        options.append(st.integers(min_value=math.floor(rng.hi) + 1) if rng.integer else above)
    return st.one_of(options)


@pytest.fixture(scope="module")
def schema_cases(fuzz_server):
    """(api, schema model, method, path, a body the route accepts) for every request schema with numbers."""
    from _util_isolation import NativeWire

    from twinkle.client import schema as S
    from twinkle.hub import TEST_MODEL
    from twinkle.serve.tinker import bodies as b

    srv, keys = fuzz_server
    w, n = Wire(srv.url, keys["other"], timeout=30), NativeWire(srv.url, keys["other"], timeout=30)
    session = w.session()
    mid = w.create_model(session, seed=4)
    saved = w.done(w.post("/save_weights", {"model_id": mid, "path": "schema"}))["path"]
    sampler = w.ok(
        w.post(
            "/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0, "base_model": TEST_MODEL}
        )
    )["sampling_session_id"]
    nmid = n.model()
    n.done(n.add_adapter(nmid))
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
    name = saved.rsplit("/", 1)[-1]
    cases = [
        (
            "tinker",
            b.CreateModelBody,
            "POST",
            "/create_model",
            {"session_id": session, "model_seq_id": 90, "base_model": TEST_MODEL, "lora_config": {"rank": 2}},
        ),
        ("tinker", b.OptimStepBody, "POST", "/optim_step", {"model_id": mid}),
        ("tinker", b.SaveWeightsBody, "POST", "/save_weights", {"model_id": mid, "path": "p"}),
        ("tinker", b.SaveWeightsForSamplerBody, "POST", "/save_weights_for_sampler", {"model_id": mid, "path": "s"}),
        ("tinker", b.LoadWeightsBody, "POST", "/load_weights", {"model_id": mid, "path": saved, "optimizer": False}),
        (
            "tinker",
            b.CreateSamplingSessionBody,
            "POST",
            "/create_sampling_session",
            {"session_id": session, "sampling_session_seq_id": 5, "base_model": TEST_MODEL},
        ),
        (
            "tinker",
            b.ASampleBody,
            "POST",
            "/asample",
            {"sampling_session_id": sampler, "prompt": prompt, "sampling_params": {"max_tokens": 2}},
        ),
        ("tinker", b.TtlBody, "PUT", f"/training_runs/{mid}/checkpoints/weights/{name}/ttl", {"ttl_seconds": None}),
        ("native", S.CreateModelRequest, "POST", "/models", {}),
        (
            "native",
            S.AddAdapterRequest,
            "POST",
            f"/models/{nmid}/add_adapter_to_model",
            {"adapter_name": "x", "lora_config": {"r": 4}},
        ),
        ("native", S.StepRequest, "POST", f"/models/{nmid}/clip_grad_and_step", {}),
        ("native", S.LogRequest, "POST", f"/models/{nmid}/log", {"metrics": {"reward": 1.0}}),
        ("native", S.SampleRequest, "POST", "/sample", {"prompts": [[5, 6]], "sampling_params": {"max_tokens": 2}}),
        (
            "native",
            S.ForwardRequest,
            "POST",
            f"/models/{nmid}/forward_only",
            {"inputs": {"rows": [{"input_ids": [5, 6, 7]}]}},
        ),
    ]
    yield {"tinker": w, "native": n}, cases
    w.close()
    n.close()


def _send(wires, api: str, method: str, path: str, body: dict):
    import json

    wire = wires[api]  # json.dumps: NaN and Infinity as the literals Python's json writes
    return wire.http.request(
        method, f"{wire.prefix}{path}", content=json.dumps(body), headers={"content-type": "application/json"}
    )


def _examples(strategy, check) -> int:
    """Run `check(example)` on SCHEMA_EXAMPLES draws of `strategy` (reproducible); -> how many ran."""
    from hypothesis import HealthCheck, given, settings

    ran = []

    @settings(
        max_examples=SCHEMA_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def one(example):
        ran.append(1)
        check(example)

    one()
    return len(ran)


def test_no_schema_accepts_a_number_outside_its_range_a_non_finite_float_or_a_null(schema_cases):
    from hypothesis import strategies as st

    wires, cases = schema_cases
    wrong, sent, fields = [], 0, 0
    for api, model, method, path, body in cases:
        leaves = _leaves(model)
        if model.__name__ == "LogRequest":  # dict values: the metric's own range (any finite number)
            leaves.append((("metrics", "reward"), None))
        if not leaves:  # no number in this body (native ForwardRequest, since its unread seq_id went)
            continue
        fields += len(leaves)
        non_finite = st.sampled_from([float("nan"), float("inf"), float("-inf")])
        draw = st.one_of(
            [st.tuples(st.just(p), non_finite if info is None else _bad_numbers(model, p, info)) for p, info in leaves]
        )

        def refused(case, api=api, method=method, path=path, body=body):
            where, value = case
            r = _send(wires, api, method, path, _set(body, where, value))
            if r.status_code not in (400, 422) or where[-1] not in r.text:
                wrong.append((api, path, ".".join(where), repr(value), r.status_code, r.text[:200]))

        sent += _examples(draw, refused)
    print(
        f"\nschema ranges: {sent} bad values over {fields} numeric fields of {len(cases)} schemas; accepted {len(wrong)}"
    )
    assert not wrong, wrong[:10]
    SUMMARY["schema properties: bad numbers refused naming the field"] = f"{sent} over {fields} fields, 0 accepted"


def test_no_value_in_any_schema_field_gets_a_5xx_or_a_server_error(schema_cases):
    """Any JSON value in any field: never a 5xx, and a request that was accepted and then failed fails
    as the tenant's ("user" category, a message about the input), never as the server's."""
    from hypothesis import strategies as st

    wires, cases = schema_cases
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20), st.integers(min_value=2**63)
    )
    values = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )
    failures, sent, accepted = [], 0, []
    for api, model, method, path, body in cases:
        leaves = [p for p, _ in _leaves(model, numeric=False)]

        def answered(case, api=api, method=method, path=path, body=body):
            where, value = case
            r = _send(wires, api, method, path, _set(body, where, value))
            if r.status_code >= 500:
                failures.append((api, path, ".".join(where), repr(value)[:80], r.status_code, r.text[:200]))
            elif r.status_code == 200 and "request_id" in r.text:
                accepted.append((api, path, ".".join(where), repr(value)[:80], r.json()["request_id"]))

        sent += _examples(st.tuples(st.sampled_from(leaves), values), answered)
    categories: dict[str, int] = {}
    for api, path, where, value, request_id in accepted:
        category = _failure_category(wires, api, request_id)
        categories[category] = categories.get(category, 0) + 1
        if category not in ("none", "user"):
            failures.append((api, path, where, value, f"future {category}"))
    print(
        f"\nschema fields fuzzed: {sent} requests over {len(cases)} schemas; {len(accepted)} accepted, their "
        f"futures {categories}; 5xx or server-category failures: {len(failures)}"
    )
    assert not failures, failures[:10]
    assert _alive(wires)
    SUMMARY["schema properties: any value in any field, 0 5xx, 0 server failures"] = (
        f"{sent} requests over {len(cases)} schemas ({len(accepted)} futures)"
    )


def _failure_category(wires, api: str, request_id: str) -> str:
    """How an accepted request ended: "none" (it succeeded), its failure's category, or "pending"."""
    if api == "tinker":
        kind, out = wires["tinker"].result(request_id, 120)
        return out.get("category", "none") if kind == "error" else "none"
    out = wires["native"].wait(request_id, 120)
    return out.get("category") or "none" if out["status"] == "failed" else "none"


def _alive(wires) -> bool:
    return wires["tinker"].get("/healthz").status_code == 200
