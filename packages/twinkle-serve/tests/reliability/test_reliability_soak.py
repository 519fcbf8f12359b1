"""Soak: 100,000 requests of mixed kinds on the tiny model against the real `twinkle-server` process,
sampling its private memory and the sizes of every long-lived structure it keeps (its /metrics
`twinkle_retained_entries`); nothing may grow with the request count.

The mix is mostly cheap requests, so it fits in minutes: long-polls of finished futures (Tinker and
native; before the fix each left an asyncio.Event behind, ~800 B with its deque), unknown futures,
get_info, health, idempotent submissions (each stores an answer row), and a few small
forward_backward + optim_step (1 in 250) and sample (1 in 1,000) calls (futures, curves, usage). The
server's caps are set low so their trimming runs inside the soak: finished futures kept 18 s, 1,000
idempotency answers, 200 curve points per run (thinned every 1,000 steps, so a 100,000-request soak
reaches it only with RELIABILITY_SOAK_REQUESTS raised).

The server runs in its own process, as deployed: this test's client (httpx, its connection pool, the
answers it parses) would otherwise share the measured heap. Measured in one process, the pair grew
24-57 B/request; the server alone, 9 B/request, all of it SQLite's page cache (2 MiB per connection)
filling over the first tens of thousands of requests.

Memory is fitted against the request count after a warm-up of 40% (SQLite's page cache and the
allocator's arenas fill first); the slope must stay under 32 B per request: far below one leaked
object per request (the smallest Python object with the dict slot that would hold it is ~100 B; the
old Event leak was ~800 B). Count: RELIABILITY_SOAK_REQUESTS.
"""

from __future__ import annotations

import os
import re
import time
import uuid

import httpx
from harness import SUMMARY, Wire, fb_body, sft_pair

REQUESTS = int(os.environ.get("RELIABILITY_SOAK_REQUESTS", "100000"))
SAMPLES = 40
SLOPE_BOUND = 32  # bytes per request
SEQ = [5 + (7 * i) % 60 for i in range(12)]
RETAINED = re.compile(r'^twinkle_retained_entries\{structure="([^"]+)"\} (\S+)$', re.M)


def _private_memory(pid: int) -> int:
    """A process's private memory: anonymous resident pages plus those swapped out. Plain RSS also
    counts the mapped libraries' file pages, which the kernel drops and re-reads under memory pressure
    from other jobs (measured here: RSS fell 300 MB mid-soak), so it moves for reasons no request causes."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields.get(k, "0 kB").split()[0]) * 1024 for k in ("RssAnon", "VmSwap"))


def sizes(url: str) -> dict[str, int]:
    """Every long-lived structure of the server that a request or session could add to, as it reports them."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {name: int(float(v)) for name, v in RETAINED.findall(text)}


def _slope(points: list[tuple[int, int]]) -> float:
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / max(sum((x - mx) ** 2 for x, _ in points), 1e-9)


def test_soak_mixed_requests_grow_nothing(launch):
    from twinkle.hub import TEST_MODEL

    srv, keys = launch(
        ["soak"],
        long_poll_s=1.0,
        futures_keep_hours=0.005,
        caps={"idempotency_max_rows": 1000, "max_curve_points": 200},
    )
    pid = srv.proc.pid
    t = Wire(srv.url, keys["soak"], timeout=60)
    native = t.http  # the native routes share the client (one keep-alive connection)
    session = t.session()
    model_id = t.create_model(session, rank=2)
    sampler = t.ok(
        t.post(
            "/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 0, "base_model": TEST_MODEL}
        )
    )["sampling_session_id"]
    done_ids = []
    for _ in range(20):
        r = t.ok(t.http.post("/api/v1/forward_backward", content=fb_body(model_id, 0, [sft_pair(SEQ)])))
        t.result(r["request_id"])
        done_ids.append(r["request_id"])
    prompt = {"chunks": [{"type": "encoded_text", "tokens": SEQ[:4]}]}
    sample = {"sampling_session_id": sampler, "prompt": prompt, "sampling_params": {"max_tokens": 2}}

    counts: dict[str, int] = {}
    points, size_trace = [], []
    every = max(REQUESTS // SAMPLES, 1)
    start = time.monotonic()
    for i in range(REQUESTS):
        slot = i % 100
        if i % 250 == 0:  # the expensive kinds, rarely: they are what a soak of cheap requests leaves untested
            kind = "forward_backward"
            r = t.http.post("/api/v1/forward_backward", content=fb_body(model_id, 0, [sft_pair(SEQ)]))
            done_ids[i % 20] = t.ok(r)["request_id"]  # polled below once it finishes (pending: try_again)
            step = t.post("/optim_step", {"model_id": model_id, "adam_params": {"learning_rate": 1e-4}})
            done_ids[(i + 1) % 20] = t.ok(step)["request_id"]  # a training loop steps; gradients never pile up
        elif i % 1000 == 125:
            kind, r = "asample", t.post("/asample", sample)
            t.result(t.ok(r)["request_id"])
        elif slot < 45:
            kind, r = "tinker retrieve_future (finished)", t.post("/retrieve_future", {"request_id": done_ids[i % 20]})
        elif slot < 55:
            kind, r = "tinker retrieve_future (unknown)", t.post("/retrieve_future", {"request_id": uuid.uuid4().hex})
        elif slot < 72:
            kind, r = "tinker get_info", t.post("/get_info", {"model_id": model_id})
        elif slot < 82:
            kind, r = "native futures (finished)", native.get(f"/twinkle/v1/futures/{done_ids[i % 20]}?timeout=0")
        elif slot < 91:
            kind, r = "healthz", t.get("/healthz")
        else:
            kind = "idempotent get_info"
            r = t.post("/get_info", {"model_id": model_id}, headers={"X-Idempotency-Key": uuid.uuid4().hex})
        assert r.status_code in (200, 404), (kind, r.status_code, r.text[:200])
        assert r.status_code == 404 or "unknown" not in kind
        counts[kind] = counts.get(kind, 0) + 1
        if i % every == 0:
            points.append((i, _private_memory(pid)))
            size_trace.append(sizes(srv.url))
    wall = time.monotonic() - start
    t.result(done_ids[-1])
    time.sleep(1.5)  # the last long-polls return
    final = sizes(srv.url)
    t.close()

    slope = _slope(points[2 * len(points) // 5 :])  # after the warm-up: SQLite's page cache and malloc arenas
    SUMMARY["soak: requests, wall time"] = f"{REQUESTS} mixed in {wall:.0f} s ({REQUESTS / wall:.0f}/s, under load)"
    SUMMARY["soak: private memory slope after warm-up"] = f"{slope:.2f} B/request (bound {SLOPE_BOUND})"
    SUMMARY["soak: largest long-lived maps at the end"] = ", ".join(f"{k} {v}" for k, v in final.items())
    print(counts, final, points[:: max(len(points) // 10, 1)])
    assert final["future waiters"] == 0 and final["idempotency in flight"] == 0
    assert final["idempotency answers"] <= 1000 + 1000 // 10  # the cap, plus the writes between two trims
    # per curve (loss, grad_norm, lr) the cap, plus the steps until the next thinning
    assert final["curve points"] <= 3 * (200 + 1000) + 3
    # futures: bounded by the retention window (18 s) times the rate, not by the request count
    assert final["futures"] < 3 * max(s["futures"] for s in size_trace[: len(size_trace) // 2] or [final])
    for name in ("rate buckets", "scheduler queues", "live adapters", "adapter reservations", "sampler adapters"):
        assert final[name] <= max(s[name] for s in size_trace[:2]) + 1, (name, final[name], size_trace[:2])
    assert slope < SLOPE_BOUND, f"private memory grows {slope:.1f} B/request (bound {SLOPE_BOUND}): {points}"
