"""`GET /metrics`: the server's operational metrics in Prometheus' text format, with its own client.

Labels carry only what an operator configured or what the code names: the route *template*
(`/api/v1/training_runs/{run_id}`, never the id), the method, the status class and the base model.
No key, tenant, id or request content ever becomes a label, so a scrape reveals nothing about
tenants and its cardinality stays fixed. Like `/livez`, it needs no key: scrapers call without one.

Request counts and latencies come from an ASGI middleware; pass times from the scheduler (through
`ServerMetrics.observe_pass`); queue depth, fused passes, tokens/s and adapter memory are read from
the runtime at scrape time, so the hot path carries no extra bookkeeping for them.

`twinkle_retained_entries{structure=...}` counts what each long-lived structure holds (futures,
idempotency answers, curve points, rate buckets, queues, adapters): every one is bounded by a cap or a
retention window, so under steady load each is flat, and one that climbs with the request count is a
leak an operator can see before memory does. Components register their own count (`retain`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Steps of the tiny CPU models take milliseconds, a large model's seconds.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """One registry per server (tests run several servers in one process)."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "twinkle_http_requests", "HTTP requests answered", ["method", "route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "twinkle_http_request_seconds",
            "Time to answer an HTTP request",
            ["method", "route"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.passes = Histogram(
            "twinkle_pass_seconds",
            "Time of one model pass on a worker (fused or single)",
            ["base_model", "fused"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.retained: dict[str, Callable[[], int]] = {}

    def retain(self, structure: str, count: Callable[[], int]) -> None:
        """Report `count()` as `twinkle_retained_entries{structure=...}` at every scrape."""
        self.retained[structure] = count

    def observe_pass(self, base_model: str, seconds: float, n_requests: int) -> None:
        self.passes.labels(base_model, "true" if n_requests > 1 else "false").observe(seconds)

    def watch(self, rt) -> None:
        self.registry.register(_RuntimeCollector(rt, self.retained))


class _RuntimeCollector:
    def __init__(self, rt, retained: dict[str, Callable[[], int]]):
        self.rt, self.retained = rt, retained

    def collect(self):
        rt = self.rt
        depth = GaugeMetricFamily("twinkle_queue_depth", "Requests waiting for a worker", labels=["base_model"])
        fused = GaugeMetricFamily(
            "twinkle_fused_passes", "Passes that served several tenants at once", labels=["base_model"]
        )
        for name, engine in rt.engines.items():
            depth.add_metric([name], engine.scheduler.depth())
            fused.add_metric([name], engine.scheduler.fused_passes)
        yield depth
        yield fused
        yield GaugeMetricFamily(
            "twinkle_tokens_per_second", "Tokens processed per second, last minute", value=rt.throughput.tokens_per_s()
        )
        yield GaugeMetricFamily(
            "twinkle_adapter_memory_bytes", "Adapter memory reserved by live adapters", value=rt.adapter_memory.used()
        )
        cap = rt.adapter_memory.cap
        yield GaugeMetricFamily(
            "twinkle_adapter_memory_cap_bytes", "max_adapter_memory_mb (-1: no cap)", value=-1 if cap is None else cap
        )
        yield GaugeMetricFamily("twinkle_ready", "1 once the base models are loaded", value=int(rt.ready.is_set()))
        yield from _residency_metrics(rt.adapter_memory.report())
        yield from _prefix_cache_metrics(
            {name: engine.backend.prefix_cache_stats() for name, engine in rt.engines.items()}
        )
        retained = GaugeMetricFamily(
            "twinkle_retained_entries", "Entries a long-lived structure holds (bounded)", labels=["structure"]
        )
        for structure, count in sorted(self.retained.items()):
            retained.add_metric([structure], count())
        yield retained


def _residency_metrics(report: dict):
    """Adapters per residency tier, and the moves between tiers with the seconds they took."""
    tiers = GaugeMetricFamily("twinkle_adapters", "Adapters per residency tier", labels=["tier"])
    for tier, n in report["adapters"].items():
        tiers.add_metric([tier], n)
    yield tiers
    swaps = report["swaps"]
    moves = CounterMetricFamily("twinkle_adapter_swaps", "Adapter moves between residency tiers", labels=["move"])
    seconds = CounterMetricFamily("twinkle_adapter_swap_seconds", "Seconds spent moving adapters", labels=["move"])
    for move, count, timer in (
        ("park", "parked", "park_s"),
        ("spill", "spilled", "spill_s"),
        ("restore", "restored", "restore_s"),
    ):
        moves.add_metric([move], swaps.get(count, 0))
        seconds.add_metric([move], swaps.get(timer, 0.0))
    yield moves
    yield seconds


def _prefix_cache_metrics(stats: dict[str, dict[str, int]]):
    """Each base model's sampler prefix cache (shared by sample and compute_logprobs): lookups by
    result, prompt tokens whose prefill it saved, entries dropped, and what it holds against its budget.
    A model whose sampler runs in another process (a Ray sampler group) reports nothing here."""
    lookups = CounterMetricFamily(
        "twinkle_prefix_cache_lookups",
        "Prompts looked up in the sampler's prefix cache",
        labels=["base_model", "result"],
    )
    reused = CounterMetricFamily(
        "twinkle_prefix_cache_tokens_reused",
        "Prompt tokens whose prefill the prefix cache saved",
        labels=["base_model"],
    )
    dropped = CounterMetricFamily(
        "twinkle_prefix_cache_dropped",
        "Entries dropped: evicted for the byte budget, or invalidated (their adapter's weights changed)",
        labels=["base_model", "reason"],
    )
    held = GaugeMetricFamily(
        "twinkle_prefix_cache_bytes", "Bytes of KV (and hidden states) the prefix cache holds", labels=["base_model"]
    )
    budget = GaugeMetricFamily(
        "twinkle_prefix_cache_budget_bytes", "The prefix cache's byte budget (0: off)", labels=["base_model"]
    )
    entries = GaugeMetricFamily("twinkle_prefix_cache_entries", "Prefixes the cache holds", labels=["base_model"])
    for model, s in stats.items():
        if not s:
            continue
        lookups.add_metric([model, "hit"], s["hits"])
        lookups.add_metric([model, "miss"], s["misses"])
        reused.add_metric([model], s["tokens_reused"])
        dropped.add_metric([model, "evicted"], s["evictions"])
        dropped.add_metric([model, "invalidated"], s["invalidations"])
        held.add_metric([model], s["bytes_held"])
        budget.add_metric([model], s["budget_bytes"])
        entries.add_metric([model], s["entries"])
    yield from (lookups, reused, dropped, held, budget, entries)


class RequestMetrics:
    """ASGI middleware: count and time every HTTP request by route template and status class."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def send_and_see(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.requests.labels(method, route, f"{status[0] // 100}xx").inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - start)


def build_metrics_router(metrics: ServerMetrics) -> APIRouter:
    r = APIRouter(tags=["probes"])

    @r.get("/metrics", summary="Prometheus metrics (no key needed; no tenant data in labels)")
    def scrape():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return r
