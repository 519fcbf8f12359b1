"""More tenants than memory, at scale: 64 Tinker-SDK tenants (their own keys) on a server whose
adapter-memory cap holds 16 adapters live and its parked-memory cap about 16 more (the rest spill to
disk). Every tenant's losses, final weights and Adam moments equal its workload run alone, bit for
bit; every acknowledged step is in them; the capacity route's counts and swap counters add up."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from _offload_tenants import (
    TENANT,
    WORKLOADS,
    alone_results,
    assert_bit_equal,
    check_capacity,
    crowded_server,
    one_torch_thread,
    run_tenants,
    tenant_keys,
)
from harness import SUMMARY

TENANTS, LIVE_FIT, STEPS = 64, 16, 2


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def test_64_tenants_on_a_cap_of_16_each_equal_their_run_alone(start, tmp_path_factory, sft):
    ref, alone, per = alone_results(start, tmp_path_factory.mktemp("offload-ref"), sft, STEPS)
    srv, cap = crowded_server(start, tmp_path_factory.mktemp("offload-64"), per, LIVE_FIT)
    try:
        keys = tenant_keys(srv, TENANTS)
        workloads = [i % WORKLOADS for i in range(TENANTS)]
        began = time.perf_counter()
        results = run_tenants(srv, keys, workloads, STEPS, sft)
        seconds = time.perf_counter() - began
        for workload, result in zip(workloads, results):
            assert_bit_equal(result, alone[workload])
        body = check_capacity(srv, keys[f"{TENANT}-0"], per, cap, TENANTS, LIVE_FIT, calls_each=2 * STEPS + 1)
    finally:
        srv.stop()
        ref.stop()
    swaps = body["swaps"]
    SUMMARY[f"offload: {TENANTS} tenants on a cap of {LIVE_FIT}"] = (
        "all bit-exact with their runs alone; "
        f"tiers {body['adapters']}; {swaps['restored']:.0f} swap-ins ({swaps['restored_from_disk']:.0f} from disk) "
        f"at {1000 * swaps['restore_s'] / max(swaps['restored'], 1):.2f} ms each, "
        f"park {1000 * swaps['park_s'] / max(swaps['parked'], 1):.2f} ms; {seconds:.1f} s of tenant calls"
    )
