"""Load: 8 tenants train at once -- 4 through the unmodified Tinker SDK, 4 through Twinkle's native
client -- 100 steps each on the test preset, pipelined, with sampling half-way (see _load_tenants.py).

Proves: no step is lost (every forward_backward and optimizer step of every tenant answers, 100 of
each) or reordered (each tenant's 100 per-step losses and its final adapter equal, within 1e-5, the
same tenant trained alone on a fresh server: loss k depends on every earlier update, in order).
Concurrent forward_backward calls of both APIs share fused multi-adapter passes (the server's status
counts the requests of each API that rode in a pass with other models). Prints throughput and
p50/p99 step latency (submit -> optimizer step answered) into the summary.
"""

from __future__ import annotations

import httpx
import numpy as np
from _load_tenants import STEPS, TENANTS, WINDOW, adapter_diff, alone_reference, loss_tolerance, train_all
from harness import SUMMARY


def test_eight_tenants_lose_and_reorder_nothing(launch):
    alone, alone_wall = alone_reference(launch)
    srv, keys = launch([name for name, _ in TENANTS], limits={"max_models": 4})
    runs, wall = train_all(srv.url, keys, srv.data_dir, concurrent=True)
    (status,) = httpx.get(
        f"{srv.url}/twinkle/v1/server", headers={"X-API-Key": keys[TENANTS[0][0]]}, timeout=30
    ).json()["base_models"]
    fused = status["fused_requests"]
    # native tenants fuse like Tinker ones: both APIs' requests rode in shared passes under this load
    assert status["fused_passes"] > 0 and fused["native"] > 0 and fused["tinker"] > 0, status
    worst_loss, worst_weight = 0.0, 0.0
    for name, _kind in TENANTS:
        got, ref = runs[name], alone[name]
        assert sorted(got.losses) == list(range(STEPS)) and len(got.latencies) == STEPS, name  # nothing lost
        assert got.samples == [2], name
        worst_loss = max(worst_loss, max(abs(got.losses[s] - ref.losses[s]) for s in range(STEPS)))
        worst_weight = max(worst_weight, adapter_diff(got.final.folder, ref.final.folder))
    lat_ms = np.array([x for r in runs.values() for x in r.latencies]) * 1e3
    steps = len(TENANTS) * STEPS
    sdk = sum(kind == "sdk" for _, kind in TENANTS)
    p50, p99 = np.percentile(lat_ms, 50), np.percentile(lat_ms, 99)
    print(
        f"\nload: {len(TENANTS)} tenants ({sdk} tinker SDK, {len(TENANTS) - sdk} native) x {STEPS} steps + sampling; "
        f"{steps} steps in {wall:.1f} s = {steps / wall:.1f} steps/s concurrent (alone, one tenant at a time: "
        f"{steps / alone_wall:.1f}); step latency p50 {p50:.0f} ms p99 {p99:.0f} ms "
        f"(window {WINDOW}); fused passes {status['fused_passes']} carrying {fused['native']} native + "
        f"{fused['tinker']} tinker requests; lost 0, max |loss - alone| {worst_loss:.2e}, max |adapter - alone| {worst_weight:.2e}"
    )
    assert worst_loss <= loss_tolerance(alone), worst_loss  # nothing reordered
    assert worst_weight <= 1e-5, worst_weight
    SUMMARY["steps under load (0 lost, 0 reordered)"] = (
        f"{steps} ({len(TENANTS)} tenants x {STEPS}: {sdk} SDK + {len(TENANTS) - sdk} native; "
        f"{steps / wall:.1f} steps/s, "
        f"p50 {p50:.0f} ms, p99 {p99:.0f} ms; vs alone: loss {worst_loss:.1e}, adapter {worst_weight:.1e})"
    )
