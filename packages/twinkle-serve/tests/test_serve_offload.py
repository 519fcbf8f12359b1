"""Adapter residency on a real server with the unmodified Tinker SDK: more tenants than the
adapter-memory cap holds live, each tenant's result bit-exact with its run alone (the least recently
used are parked in host memory, and past the parked-memory cap spilled to disk, between their
calls); idle timers park and spill without pressure; the capacity route and the Prometheus metrics
report the tiers and the swaps."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _offload_tenants import (
    LORA,
    RANK,
    TENANT,
    WORKLOADS,
    alone_results,
    assert_bit_equal,
    check_capacity,
    crowded_server,
    one_torch_thread,
    run_tenants,
    saved,
    tenant_keys,
    tokens,
)
from prometheus_client.parser import text_string_to_metric_families

from twinkle.hub import TEST_MODEL

TENANTS, STEPS = 8, 2  # 64 on a cap of 16: reliability/test_reliability_offload.py
LIVE_FIT = 2  # the cap holds this many of the tenants' adapters live


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def reference(start, tmp_path_factory, sft):
    srv, alone, per = alone_results(start, tmp_path_factory.mktemp("offload-ref"), sft, STEPS)
    yield alone, per
    srv.stop()


@pytest.fixture(scope="module")
def crowded(start, tmp_path_factory, reference, sft):
    _alone, per = reference
    srv, cap = crowded_server(start, tmp_path_factory.mktemp("offload"), per, LIVE_FIT)
    keys = tenant_keys(srv, TENANTS)
    workloads = [i % WORKLOADS for i in range(TENANTS)]
    results = run_tenants(srv, keys, workloads, STEPS, sft)
    yield srv, keys[f"{TENANT}-0"], per, cap, workloads, results
    srv.stop()


def capacity(srv, key, **params):
    return httpx.get(
        f"{srv.url}/twinkle/v1/capacity",
        params={"rank": RANK, "train_unembed": False, **params},
        headers={"X-API-Key": key},
    )


def test_more_tenants_than_the_cap_each_equal_their_run_alone(crowded, reference):
    *_, workloads, results = crowded
    alone, _ = reference
    for workload, result in zip(workloads, results):
        assert_bit_equal(result, alone[workload])


def test_capacity_route_counts_tiers_bytes_and_swaps(crowded):
    srv, key, per, cap, *_ = crowded
    check_capacity(srv, key, per, cap, TENANTS, LIVE_FIT, calls_each=2 * STEPS + 1)


def test_capacity_route_needs_a_key_and_a_sane_spec(crowded):
    srv, key, *_ = crowded
    assert httpx.get(f"{srv.url}/twinkle/v1/capacity").status_code == 401
    none = capacity(srv, key, train_attn=False, train_mlp=False)
    assert none.status_code == 400 and "trains nothing" in none.json()["error"]
    assert capacity(srv, key, rank=0).status_code == 422
    # twice the rank, twice the bytes: half as many fit
    assert capacity(srv, key, rank=2 * RANK).json()["fit_max"] == LIVE_FIT // 2


def test_prometheus_reports_tiers_and_swaps(crowded):
    srv, key, *_ = crowded
    body = capacity(srv, key).json()
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{srv.url}/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("twinkle_adapters", (("tier", "spilled"),))] == body["adapters"]["spilled"]
    assert samples[("twinkle_adapter_swaps_total", (("move", "restore"),))] == body["swaps"]["restored"]
    assert samples[("twinkle_adapter_swap_seconds_total", (("move", "park"),))] > 0


def test_idle_adapters_are_parked_then_spilled_and_resume_exactly(start, tmp_path_factory, reference, sft):
    import tinker
    from tinker import types

    alone, _ = reference
    srv = start(tmp_path_factory.mktemp("offload-idle"), adapter_idle_offload_s=0.3, adapter_idle_spill_s=0.3)
    try:
        tenant = f"{TENANT}-0"
        key = srv.create_key(tenant)
        client = tinker.ServiceClient(base_url=srv.url, api_key=key)
        tc = client.create_lora_training_client(base_model=TEST_MODEL, seed=0, **LORA).result()
        losses = []
        for step in range(STEPS):
            losses.append(tc.forward_backward([sft(tokens(0, step))], "cross_entropy").result().metrics["loss:sum"])
            deadline = time.monotonic() + 30
            while capacity(srv, key).json()["adapters"]["spilled"] != 1:  # idle: parked, then on disk
                assert time.monotonic() < deadline, capacity(srv, key).text
                time.sleep(0.1)
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert_bit_equal(saved(srv, tenant, tc, losses, "final"), alone[0])
        swaps = capacity(srv, key).json()["swaps"]
        assert swaps["restored_from_disk"] >= STEPS
    finally:
        srv.stop()
