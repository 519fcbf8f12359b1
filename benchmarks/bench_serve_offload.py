"""The cost of hosting more tenants than memory: --tenants Tinker-SDK tenants (64) training at once on
a twinkle-server whose adapter-memory cap holds --live adapters (16) live and about --parked more in
host memory (the rest spill to disk), against the same tenants' work on an uncapped server.

Each tenant (its own key, in its own thread) runs --steps steps of forward_backward + optim_step,
--window steps ahead. The sides alternate, --repeats times each, on two servers started once. On the
capped server the least recently used adapters are parked (weights + Adam state to host memory) or
spilled and brought back on their next call; its capacity route reports the swaps, and the swap
cost per call comes from there. Correctness (every tenant bit-exact with its run alone) is
packages/twinkle-serve/tests/reliability/test_reliability_offload.py; this measures speed only.

    uv run benchmarks/bench_serve_offload.py [--tenants 64] [--live 16] [--parked 16] [--steps 4] [--model ...]

Prints a final JSON line: {"ratio": capped steps/s / uncapped steps/s, "swap_in_ms": ..., raw numbers}.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import httpx
from _server import start_server
from bench_serve_tenants import SdkTenant, run_tenant

os.environ.setdefault("TINKER_TELEMETRY", "0")
RANK = 8  # SdkTenant's


def capacity(url: str, key: str) -> dict:
    got = httpx.get(f"{url}/twinkle/v1/capacity", params={"rank": RANK}, headers={"X-API-Key": key}, timeout=60)
    got.raise_for_status()
    return got.json()


def run_all(tenants, first_step: int, steps: int, window: int, shape) -> float:
    """Every tenant in its own thread, started together; -> wall seconds."""
    barrier = threading.Barrier(len(tenants) + 1)
    latencies = [[] for _ in tenants]
    threads = [
        threading.Thread(target=run_tenant, args=(t, first_step + i, steps, window, shape, latencies[i], barrier))
        for i, t in enumerate(tenants)
    ]
    for th in threads:
        th.start()
    barrier.wait()
    began = time.perf_counter()
    for th in threads:
        th.join()
    assert all(len(x) == steps for x in latencies), "a tenant lost a step"
    return time.perf_counter() - began


def main():
    from transformers import AutoConfig

    from twinkle.hub import DEFAULT_MODEL, resolve_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tenants", type=int, default=64)
    ap.add_argument("--live", type=int, default=16, help="adapters the cap holds live")
    ap.add_argument("--parked", type=int, default=16, help="adapters the parked-memory cap holds; the rest spill")
    ap.add_argument("--steps", type=int, default=4, help="per tenant, side and repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--window", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    shape = (args.batch, args.seq, AutoConfig.from_pretrained(resolve_model_path(args.model)).vocab_size)

    servers = [start_server(args.model, args.tenants)]
    try:
        per = capacity(servers[0][1], servers[0][2][0])["adapter_bytes"]
        servers.append(
            start_server(
                args.model,
                args.tenants,
                max_adapter_memory_mb=(args.live + 0.5) * per / 2**20,
                max_parked_adapter_memory_mb=(args.parked + 0.5) * per / 2**20,
            )
        )
        sides = {}
        for name, (_, url, keys) in zip(("uncapped", "capped"), servers):
            tenants = [SdkTenant(url, key, args.model, i) for i, key in enumerate(keys)]
            for i, t in enumerate(tenants):  # warm-up: every adapter and its Adam state exist
                run_tenant(t, i, 1, 1, shape, [])
            sides[name] = tenants
        capped_url, capped_key = servers[1][1], servers[1][2][0]
        before = capacity(capped_url, capped_key)["swaps"]
        seconds = {"uncapped": 0.0, "capped": 0.0}
        for repeat in range(args.repeats):
            for name in ("capped", "uncapped") if repeat % 2 == 0 else ("uncapped", "capped"):
                seconds[name] += run_all(sides[name], 1 + repeat * args.steps, args.steps, args.window, shape)
        after = capacity(capped_url, capped_key)
    finally:
        for proc, *_ in servers:
            proc.terminate()
            proc.wait(timeout=60)

    swaps = {k: after["swaps"][k] - before.get(k, 0) for k in after["swaps"]}
    steps = args.tenants * args.steps * args.repeats
    calls = 2 * steps  # forward_backward + optim_step
    print(
        json.dumps(
            {
                "ratio": (steps / seconds["capped"]) / (steps / seconds["uncapped"]),
                "capped_steps_per_s": steps / seconds["capped"],
                "uncapped_steps_per_s": steps / seconds["uncapped"],
                "swap_ins_per_call": swaps["restored"] / calls,
                "swap_in_ms": 1000 * swaps["restore_s"] / max(swaps["restored"], 1),
                "park_ms": 1000 * swaps["park_s"] / max(swaps["parked"], 1),
                "spill_ms": 1000 * swaps["spill_s"] / max(swaps["spilled"], 1),
                "swap_ms_per_call": 1000 * (swaps["restore_s"] + swaps["park_s"] + swaps["spill_s"]) / calls,
                "swap_ins": swaps["restored"],
                "swap_ins_from_disk": swaps["restored_from_disk"],
                "tiers_at_end": after["adapters"],
                "adapter_bytes": per,
                **vars(args),  # the settings: tenants, live, parked, steps, repeats, window, batch, seq, model
            }
        )
    )


if __name__ == "__main__":
    main()
