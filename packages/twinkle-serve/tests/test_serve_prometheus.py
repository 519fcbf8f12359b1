"""`GET /metrics` scraped from a real server after real Tinker SDK training, parsed with
prometheus_client's own parser: request counts and latency per route template, pass times, queue
depth, fused passes, tokens/s, adapter memory used and capped, 4xx/5xx counts; no key or id in labels."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

CAP_MB = 64.0


@pytest.fixture(scope="module")
def trained(start, tmp_path_factory, sft):
    import tinker
    from tinker import types

    from twinkle.hub import TEST_MODEL

    srv = start(tmp_path_factory.mktemp("prom"), max_adapter_memory_mb=CAP_MB)
    key = srv.create_key("alice")
    client = tinker.ServiceClient(base_url=srv.url, api_key=key)
    tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4).result()
    for _ in range(2):
        fb = tc.forward_backward([sft([5, 6, 7, 8, 9, 10])], "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result(), step.result()
    # a wrong key and an unknown run id: answered 4xx; neither may appear in any label
    httpx.get(f"{srv.url}/api/v1/training_runs/run-secret-id-123", headers={"X-API-Key": "tml-not-a-real-key"})
    httpx.get(f"{srv.url}/api/v1/training_runs/run-secret-id-123", headers={"X-API-Key": key})
    yield srv, key
    srv.stop()


def _scrape(url: str) -> tuple[str, dict]:
    resp = httpx.get(f"{url}/metrics")  # no key: scrapers call without one
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return resp.text, samples


def _value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


def test_requests_are_counted_and_timed_by_route_template(trained):
    srv, key = trained
    text, samples = _scrape(srv.url)
    assert (
        _value(samples, "twinkle_http_requests_total", method="POST", route="/api/v1/forward_backward", status="2xx")
        >= 2
    )
    assert _value(samples, "twinkle_http_request_seconds_count", method="POST", route="/api/v1/forward_backward") >= 2
    run_route = "/api/v1/training_runs/{run_id}"
    assert _value(samples, "twinkle_http_requests_total", method="GET", route=run_route, status="4xx") == 2
    assert "run-secret-id-123" not in text and key not in text and "tml-" not in text


def test_server_gauges_read_the_runtime(trained):
    from twinkle.hub import TEST_MODEL

    srv, _ = trained
    _, samples = _scrape(srv.url)
    assert _value(samples, "twinkle_pass_seconds_count", base_model=TEST_MODEL, fused="false") >= 4
    assert _value(samples, "twinkle_queue_depth", base_model=TEST_MODEL) == 0
    assert _value(samples, "twinkle_fused_passes", base_model=TEST_MODEL) == 0  # one tenant: nothing to fuse
    assert _value(samples, "twinkle_tokens_per_second") > 0
    assert 0 < _value(samples, "twinkle_adapter_memory_bytes") < CAP_MB * 2**20
    assert _value(samples, "twinkle_adapter_memory_cap_bytes") == CAP_MB * 2**20
    assert _value(samples, "twinkle_ready") == 1


def test_retained_entries_count_what_the_long_lived_structures_hold(trained):
    """Each structure reports its own size: the fixture's tenant has one live adapter (and its memory
    reservation), four finished futures plus its create_model, six loss/grad/lr points per step... and
    nothing waiting."""
    srv, _ = trained
    _, samples = _scrape(srv.url)
    retained = {
        dict(labels)["structure"]: v for (name, labels), v in samples.items() if name == "twinkle_retained_entries"
    }
    assert retained["live adapters"] == 1 and retained["adapter reservations"] == 1
    assert retained["future waiters"] == 0 and retained["scheduler queues"] == 0
    assert retained["idempotency in flight"] == 0
    assert retained["futures"] >= 5  # create_model, 2 x (forward_backward, optim_step)
    assert retained["curve points"] >= 2  # at least one curve point per optim_step
    assert retained["rate buckets"] >= 0 and retained["sampler adapters"] == 0
    assert set(retained) == {
        "futures",
        "future waiters",
        "idempotency answers",
        "idempotency in flight",
        "curve points",
        "rate buckets",
        "live adapters",
        "adapter reservations",
        "scheduler queues",
        "sampler adapters",
    }


def test_prefix_cache_counters_are_exported_per_base_model(trained):
    """The same prompt sampled twice: the second prefill reuses the first's KV, and /metrics says so
    with the sampler's own counters."""
    import tinker
    from tinker import types

    from twinkle.hub import TEST_MODEL

    srv, key = trained
    sampler = tinker.ServiceClient(base_url=srv.url, api_key=key).create_sampling_client(base_model=TEST_MODEL).result()
    prompt = types.ModelInput.from_ints(list(range(5, 45)))
    for _ in range(2):  # unseeded: a seeded sample prefills in full (it is a function of its request alone)
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    _, samples = _scrape(srv.url)
    stats = srv.runtime.engines[TEST_MODEL].backend.prefix_cache_stats()
    assert stats["hits"] >= 1 and stats["tokens_reused"] >= 32 and stats["bytes_held"] > 0
    assert _value(samples, "twinkle_prefix_cache_lookups_total", base_model=TEST_MODEL, result="hit") == stats["hits"]
    assert (
        _value(samples, "twinkle_prefix_cache_lookups_total", base_model=TEST_MODEL, result="miss") == stats["misses"]
    )
    assert _value(samples, "twinkle_prefix_cache_tokens_reused_total", base_model=TEST_MODEL) == stats["tokens_reused"]
    assert _value(samples, "twinkle_prefix_cache_bytes", base_model=TEST_MODEL) == stats["bytes_held"]
    assert _value(samples, "twinkle_prefix_cache_budget_bytes", base_model=TEST_MODEL) == stats["budget_bytes"] > 0
    assert _value(samples, "twinkle_prefix_cache_entries", base_model=TEST_MODEL) == stats["entries"] >= 1
    for reason in ("evicted", "invalidated"):
        assert _value(samples, "twinkle_prefix_cache_dropped_total", base_model=TEST_MODEL, reason=reason) >= 0
