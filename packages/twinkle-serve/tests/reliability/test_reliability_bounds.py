"""Every numeric field of the three APIs (Tinker, native, OpenAI) is bounded, against a real
`twinkle-server`: hypothesis draws values outside each field's range (non-finite, below, above,
past 64 bits, a float for an integer) and every one is refused (400 or 422) naming the field,
before anything is created or queued; then the drawn requests are replayed 8,000 times and the
server's RSS does not grow with them.

The ranges come from `twinkle.client.schema.bounds` (the one table the facades check against); the
server-dependent upper ends are the embedded test model's (LoRA rank <= its widest layer, 96) and
the server's default caps.
"""

from __future__ import annotations

import math
import os
import sqlite3
import time

import pytest
from _util_isolation import NativeWire
from harness import SUMMARY, Wire

from twinkle.client.schema import bounds as B

EXAMPLES = int(os.environ.get("RELIABILITY_BOUNDS_EXAMPLES", "150"))  # per API
REPLAYS = int(os.environ.get("RELIABILITY_BOUNDS_REPLAYS", "8000"))
TINY_WIDTH = 96  # twinkle://qwen3-tiny: hidden 96, so no Linear's min(in, out) is larger
CONTEXT = 32768  # twinkle://qwen3-tiny's max_position_embeddings (Qwen3's own)
SENT: list[tuple[str, str, str, dict]] = []  # (api, method, path, body) the property tests sent: replayed below


def bad_values(rng: B.Range):
    """Values `rng` must refuse: non-finite, just past each end, far past it, a non-integer for an int."""
    from hypothesis import strategies as st

    options = [st.sampled_from([math.nan, math.inf, -math.inf])]
    if rng.integer:
        options.append(st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()))
        if rng.lo is not None:
            options.append(st.integers(max_value=int(rng.lo) - 1))
        if rng.hi is not None:
            options.append(st.integers(min_value=int(rng.hi) + 1))
    else:
        if rng.lo is not None:
            options.append(st.floats(max_value=rng.lo, exclude_max=not rng.lo_open, allow_nan=False))
        if rng.hi is not None:
            options.append(st.floats(min_value=rng.hi, exclude_min=not rng.hi_open, allow_nan=False))
    return st.one_of(options)


def edges(rng: B.Range) -> list:
    """Each end just outside the range, and the non-finite values."""
    out = [math.nan, math.inf]
    if rng.lo is not None:
        out.append(rng.lo if rng.lo_open else (rng.lo - 1 if rng.integer else math.nextafter(rng.lo, -math.inf)))
    if rng.hi is not None:
        out.append(rng.hi if rng.hi_open else (rng.hi + 1 if rng.integer else math.nextafter(rng.hi, math.inf)))
    if rng.integer:
        out += [0.5, 2**64]
    return [v for v in out if not rng.contains(v)]


def _nest(path: str, value) -> dict:
    head, _, rest = path.partition(".")
    return {head: _nest(rest, value) if rest else value}


@pytest.fixture(scope="module")
def bounded(launch):
    srv, keys = launch(["bounds"], long_poll_s=1.0, limits={"max_models": 64})
    key = keys["bounds"]
    tinker, native = Wire(srv.url, key), NativeWire(srv.url, key)
    from harness import HttpWire

    openai = HttpWire(srv.url, key)
    from twinkle.hub import TEST_MODEL

    session = tinker.session()
    model_id = tinker.create_model(session, rank=4)
    sampler = tinker.ok(
        tinker.post(
            "/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0, "base_model": TEST_MODEL}
        )
    )["sampling_session_id"]
    ckpt = tinker.done(tinker.post("/save_weights", {"model_id": model_id, "path": "c0"}))["path"]
    native_id = native.model()
    native.done(native.add_adapter(native_id))
    yield {
        "srv": srv,
        "tinker": tinker,
        "native": native,
        "openai": openai,
        "session": session,
        "model_id": model_id,
        "sampler": sampler,
        "ckpt": ckpt,
        "native_id": native_id,
        "base": TEST_MODEL,
    }
    for w in (tinker, native, openai):
        w.close()


def tinker_cases(f):
    """(field named in the refusal, its range, value -> (method, path, body))."""
    mid, s, base = f["model_id"], f["session"], f["base"]
    ckpt_name = f["ckpt"].rsplit("/", 1)[-1]

    def create(field):
        return lambda v: (
            "POST",
            "/create_model",
            {"session_id": s, "model_seq_id": 99, "base_model": base, "lora_config": {"rank": 4, **_nest(field, v)}},
        )

    def sample(field):
        return lambda v: (
            "POST",
            "/asample",
            {
                "sampling_session_id": f["sampler"],
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
                **({"num_samples": v} if field == "num_samples" else {"sampling_params": {"max_tokens": 2, field: v}}),
            },
        )

    cases = [
        ("lora_config.rank", B.LORA_RANK.below(TINY_WIDTH), create("rank")),
        ("lora_config.seed", B.SEED, create("seed")),
        ("num_samples", B.NUM_SAMPLES, sample("num_samples")),
        ("ttl_seconds", B.TTL_SECONDS, lambda v: ("POST", "/save_weights", {"model_id": mid, "ttl_seconds": v})),
        ("seq_id", B.SEQ_ID, lambda v: ("POST", "/save_weights", {"model_id": mid, "seq_id": v})),
        (
            "ttl_seconds",
            B.TTL_SECONDS,
            lambda v: ("PUT", f"/training_runs/{mid}/checkpoints/weights/{ckpt_name}/ttl", {"ttl_seconds": v}),
        ),
    ]
    for name, rng in (("temperature", B.TEMPERATURE), ("top_p", B.TOP_P), ("top_k", B.TOP_K), ("seed", B.SEED)):
        cases.append((f"sampling_params.{name}", rng, sample(name)))
    cases.append(("sampling_params.max_tokens", B.MAX_TOKENS.below(CONTEXT - 2), sample("max_tokens")))
    for name, rng in (
        ("learning_rate", B.LEARNING_RATE),
        ("beta1", B.BETA),
        ("beta2", B.BETA),
        ("eps", B.EPS),
        ("weight_decay", B.WEIGHT_DECAY),
        ("grad_clip_norm", B.TINKER_GRAD_CLIP),
    ):
        cases.append(
            (
                f"adam_params.{name}",
                rng,
                lambda v, n=name: ("POST", "/optim_step", {"model_id": mid, "adam_params": {n: v}}),
            )
        )
    return cases


def native_cases(f):
    mid = f["native_id"]

    def adapter(field):
        return lambda v: (
            "POST",
            f"/models/{mid}/add_adapter_to_model",
            {"adapter_name": "x", "lora_config": {"r": 4, **_nest(field, v)}}
            if field != "gradient_accumulation_steps"
            else {"adapter_name": "x", "gradient_accumulation_steps": v},
        )

    def sample(field):
        return lambda v: ("POST", "/sample", {"prompts": [[5, 6]], "sampling_params": {"max_tokens": 2, field: v}})

    cases = [
        ("seed", B.SEED, lambda v: ("POST", "/models", {"seed": v})),
        ("lora_config.r", B.LORA_RANK.below(TINY_WIDTH), adapter("r")),
        ("lora_config.lora_alpha", B.LORA_ALPHA, adapter("lora_alpha")),
        ("lora_config.lora_dropout", B.LORA_DROPOUT, adapter("lora_dropout")),
        ("gradient_accumulation_steps", B.GRAD_ACCUMULATION, adapter("gradient_accumulation_steps")),
        ("max_grad_norm", B.GRAD_CLIP, lambda v: ("POST", f"/models/{mid}/clip_grad_and_step", {"max_grad_norm": v})),
        ("metrics.reward", B.METRIC, lambda v: ("POST", f"/models/{mid}/log", {"metrics": {"reward": v}})),
        ("sampling_params.max_tokens", B.MAX_TOKENS.below(CONTEXT - 2), sample("max_tokens")),
    ]
    for name, rng in (
        ("temperature", B.TEMPERATURE),
        ("top_p", B.TOP_P),
        ("top_k", B.TOP_K),
        ("seed", B.SEED),
        ("num_samples", B.NUM_SAMPLES),
    ):
        cases.append((f"sampling_params.{name}", rng, sample(name)))
    for name, rng in (("lr", B.LEARNING_RATE), ("eps", B.EPS), ("weight_decay", B.WEIGHT_DECAY)):
        cases.append(
            (
                f"kwargs.{name}",
                rng,
                lambda v, n=name: ("POST", f"/models/{mid}/set_optimizer", {"name": "AdamW", "kwargs": {n: v}}),
            )
        )
    cases.append(
        (
            "kwargs.betas[1]",
            B.BETA,
            lambda v: ("POST", f"/models/{mid}/set_optimizer", {"name": "AdamW", "kwargs": {"betas": [0.9, v]}}),
        )
    )
    return cases


def openai_cases(f):
    base = f["base"]

    def completion(field):
        return lambda v: ("POST", "/v1/completions", {"model": base, "prompt": "hi", "max_tokens": 2, field: v})

    def chat(field):
        return lambda v: (
            "POST",
            "/v1/chat/completions",
            {
                "model": base,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                **({"logprobs": True} if field == "top_logprobs" else {}),
                field: v,
            },
        )

    openai_temperature = B.Range(lo=0, hi=2)  # OpenAI's own documented range
    return [
        ("temperature", openai_temperature, completion("temperature")),
        ("top_p", B.TOP_P, completion("top_p")),
        ("n", B.Range(lo=1, hi=64, integer=True), completion("n")),
        ("seed", B.SEED, completion("seed")),
        ("max_tokens", B.MAX_TOKENS.below(CONTEXT - 1), completion("max_tokens")),
        ("logprobs", B.Range(lo=0, hi=20, integer=True), completion("logprobs")),
        ("max_completion_tokens", B.MAX_TOKENS.below(CONTEXT - 8), chat("max_completion_tokens")),
        ("top_logprobs", B.Range(lo=0, hi=20, integer=True), chat("top_logprobs")),
        ("temperature", openai_temperature, chat("temperature")),
    ]


def _send(wire, method: str, path: str, body: dict):
    import json

    # allow_nan: the client sends NaN/Infinity literals as Python's json does (the server must refuse them)
    return wire.http.request(
        method, f"{wire.prefix}{path}", content=json.dumps(body), headers={"content-type": "application/json"}
    )


def _refusal_names(r, field: str, api: str) -> str | None:
    """None if `r` is a proper refusal naming `field`, else what is wrong with it."""
    if r.status_code not in (400, 422):
        return f"status {r.status_code}: {r.text[:300]}"
    body = r.json()
    if api == "openai":
        message, param = body["error"]["message"], body["error"]["param"]
        return None if field in (param or "") or field in message else f"field not named: {body}"
    text = body["error"] if isinstance(body.get("error"), str) else str(body)
    leaf = field.split(".")[-1].split("[")[0]
    return None if leaf in text else f"field {field!r} not named: {text[:300]}"


def _futures(srv) -> int:
    con = sqlite3.connect(f"file:{srv.data_dir / 'twinkle.db'}?mode=ro", uri=True)
    try:
        return con.execute("SELECT COUNT(*) FROM futures").fetchone()[0]
    finally:
        con.close()


def _rss(pid: int) -> int:
    """The process's private memory: anonymous resident pages plus those swapped out. Plain RSS also
    counts the mapped libraries' file pages, which the kernel drops and re-reads under memory pressure
    from other jobs (measured here: RSS fell 300 MB mid-soak), so it moves for reasons no request causes."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields.get(k, "0 kB").split()[0]) * 1024 for k in ("RssAnon", "VmSwap"))


def _state(f) -> tuple:
    """What a refused request must not change: futures, runs, checkpoints, the native model's adapters."""
    runs = f["tinker"].ok(f["tinker"].get("/training_runs", params={"limit": 1000}))["cursor"]["total_count"]
    ckpts = len(f["tinker"].ok(f["tinker"].get("/checkpoints", params={"limit": 1000}))["checkpoints"])
    return _futures(f["srv"]), runs, ckpts


@pytest.mark.parametrize("api", ["tinker", "native", "openai"])
def test_every_out_of_range_numeric_field_is_refused_naming_it(bounded, api):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    f = bounded
    cases = {"tinker": tinker_cases, "native": native_cases, "openai": openai_cases}[api](f)
    wire = f["openai"] if api == "openai" else f[api]
    before = _state(f)
    sent, problems, drawn = [], [], []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data):
        field, rng, build = data.draw(st.sampled_from(cases))
        value = data.draw(bad_values(rng))
        assert not rng.contains(value)  # the strategy's own claim, checked
        method, path, body = build(value)
        r = _send(wire, method, path, body)
        sent.append((api, method, path, body))
        drawn.append(field)
        problem = _refusal_names(r, field, api)
        if problem:
            problems.append((field, value, problem))
        assert problem is None, (field, value, problem)

    for field, rng, build in cases:  # every field's edges once, whatever hypothesis draws
        for value in edges(rng):
            r = _send(wire, *build(value))
            sent.append((api, *build(value)))
            assert _refusal_names(r, field, api) is None, (field, value, _refusal_names(r, field, api))
    t0 = time.monotonic()
    check()
    print(f"{api}: {len(drawn)} drawn requests in {time.monotonic() - t0:.1f} s")
    assert not problems
    assert _state(f) == before  # nothing created, nothing queued
    SUMMARY[f"bounds: {api} out-of-range values refused (400/422, field named)"] = (
        f"{len(sent)} of {len(sent)} over {len({c[0] for c in cases})} fields"
    )
    SENT.extend(sent)


def test_refused_requests_do_not_grow_the_server(bounded):
    """Replay the drawn refusals; RSS fitted against the request count stays flat (< 64 B/request,
    well below one leaked Python object, ~100 B or more, per request)."""
    f = bounded
    if not SENT:
        pytest.skip("runs after the property tests (it replays what they drew)")
    wires = {"tinker": f["tinker"], "native": f["native"], "openai": f["openai"]}
    pid = f["srv"].proc.pid
    before = _state(f)
    samples = []
    for i in range(REPLAYS):
        api, method, path, body = SENT[i % len(SENT)]
        r = _send(wires[api], method, path, body)
        assert r.status_code in (400, 422), (path, body, r.status_code, r.text[:200])
        if i % 250 == 0:
            samples.append((i, _rss(pid)))
    slope = _slope(samples[len(samples) // 4 :])  # after the warm-up quarter (allocator arenas, caches)
    assert _state(f) == before
    SUMMARY["bounds: server private memory slope over refused requests"] = (
        f"{slope:.1f} B/request over {REPLAYS} (bound 64)"
    )
    assert slope < 64, samples


def _slope(points: list[tuple[int, int]]) -> float:
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-9)


def test_requests_over_the_per_request_budget_are_refused_before_queueing(bounded):
    """caps.max_request_tokens (default 32,768, twinkle.serve.core.cost): a training pass costs rows x
    longest row, a sampling request prompt + num_samples x max_tokens; over the budget is a 400 on every
    API naming the cost, the budget and the config key, and nothing is queued. The issue's probes, each
    accepted before: 2 x 20,000 Tinker training tokens, 5,000 x 40 native rows, 8 x 5,000 samples (also
    an OpenAI stream, refused before its first byte)."""
    from harness import fb_body, sft_pair

    f = bounded
    budget = 1 << 15
    tinker, native, openai = f["tinker"], f["native"], f["openai"]
    long = [5 + (7 * i) % 700 for i in range(20_001)]
    row40 = {"input_ids": [5 + i for i in range(40)], "labels": [5 + i for i in range(40)]}
    many = {"num_samples": 8, "sampling_params": {"max_tokens": 5_000}}
    chat = {"model": f["base"], "messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 5_000}
    before = _state(f)
    cases = [
        (
            "tinker forward_backward",
            lambda: tinker.http.post(
                "/api/v1/forward_backward",
                content=fb_body(f["model_id"], 90, [sft_pair(long)] * 2),
                headers={"content-type": "application/x-protobuf"},
            ),
            "training request costs 40002 tokens",  # 2 rows of 20,001: the inputs and the last target
        ),
        (
            "tinker asample",
            lambda: tinker.post(
                "/asample",
                {"sampling_session_id": f["sampler"], "prompt": {"chunks": [{"tokens": [5, 6]}]}, **many},
            ),
            "sampling request costs 40002 tokens",
        ),
        (
            "native forward_backward",
            lambda: native.post(f"/models/{f['native_id']}/forward_backward", {"inputs": {"rows": [row40] * 5_000}}),
            "training request costs 200000 tokens",
        ),
        (
            "native sample",
            lambda: native.post(
                "/sample", {"prompts": [[5, 6]], "sampling_params": {"max_tokens": 5_000, "num_samples": 8}}
            ),
            "sampling request costs 40002 tokens",
        ),
        ("openai chat", lambda: openai.post("/v1/chat/completions", chat), "sampling request costs"),
        ("openai chat stream", lambda: openai.post("/v1/chat/completions", {**chat, "stream": True}), "costs"),
        (
            "openai completions",
            lambda: openai.post("/v1/completions", {"model": f["base"], "prompt": [5, 6], "n": 8, "max_tokens": 5_000}),
            "sampling request costs 40002 tokens",
        ),
    ]
    wrong = {}
    for label, send, words in cases:
        r = send()
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        error = body.get("error")
        message = error.get("message", "") if isinstance(error, dict) else str(error)
        named = all(w in message for w in (words, f"budget of {budget} tokens", "caps.max_request_tokens"))
        if r.status_code != 400 or not named:
            wrong[label] = (r.status_code, r.text[:300])
    assert not wrong, wrong
    assert _state(f) == before  # refused before anything was queued
    SUMMARY["bounds: requests over the per-request token budget"] = (
        f"{len(cases)} of {len(cases)} refused with 400 naming cost, budget ({budget}) and caps.max_request_tokens "
        "(Tinker, native, OpenAI; training and sampling)"
    )
