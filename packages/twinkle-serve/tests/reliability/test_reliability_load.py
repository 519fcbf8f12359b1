"""Load: 8 tenants train at once through the unmodified Tinker SDK, with sampling in between.

Proves: no step is lost (every forward_backward and optim_step answers, N of each per tenant) or
reordered (each tenant's per-step losses and final adapter equal, within 1e-5, the same tenant
trained alone, one tenant at a time, on a fresh server: loss k depends on every earlier update in
order). Prints throughput and p50/p99 step latency.

The issue asks 100 steps per tenant; CI shares 2 cores and 90 minutes with everything else, so
N = RELIABILITY_LOAD_STEPS (default 4: measured ~4.4 min for this test on the shared 2 cores) -- the output says N against 100.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from harness import SUMMARY

TENANTS = [f"tenant{i}" for i in range(8)]
STEPS = int(os.environ.get("RELIABILITY_LOAD_STEPS", "4"))
WINDOW = 3  # steps submitted before waiting on the first: the SDK pipelines, seq_id must keep the order
LR = 2e-2


def tenant_batch(tenant_index: int, step: int):
    from tinker import types

    rng = np.random.default_rng(1000 * tenant_index + step)
    batch = []
    for _ in range(2):
        tokens = rng.integers(9, 800, size=int(rng.integers(12, 24))).tolist()
        batch.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                 loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}))
    return batch


def run_tenant(url: str, key: str, index: int, steps: int, out: dict) -> None:
    import tinker
    from tinker import types

    from twinkle.hub import TEST_MODEL

    service = tinker.ServiceClient(base_url=url, api_key=key)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=index).result()
    losses, latencies, pending = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        fb = tc.forward_backward(tenant_batch(index, step), "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=LR))
        pending.append((t0, fb, opt))
        if len(pending) >= WINDOW or step == steps - 1:
            while pending:
                t0, fb, opt = pending.pop(0)
                losses.append(fb.result().metrics["loss:sum"])
                opt.result()
                latencies.append(time.perf_counter() - t0)
        if step == steps // 2:  # sampling in the middle of training, on the weights so far
            sampler = tc.save_weights_and_get_sampling_client().result()
            res = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2,
                                 types.SamplingParams(max_tokens=4, seed=index, temperature=1.0)).result()
            out.setdefault("samples", []).append(len(res.sequences))
    path = tc.save_state(f"final-{index}").result().path
    out.update(losses=losses, latencies=latencies, path=path, model_id=tc.model_id)


def adapter_of(data_dir: Path, tenant: str, model_id: str, name: str) -> dict:
    from safetensors.numpy import load_file

    folder = data_dir / "tenants" / tenant / model_id.replace(":", "_") / "weights" / name
    return load_file(str(folder / "adapter_model.safetensors"))


def run_all(url: str, keys: dict, tenants: list[str], concurrent: bool) -> tuple[dict, float]:
    results = {t: {} for t in tenants}
    errors = []

    def body(t):
        try:
            run_tenant(url, keys[t], TENANTS.index(t), STEPS, results[t])
        except Exception as e:  # noqa: BLE001 - reported below with the tenant's name
            errors.append((t, repr(e)))

    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=body, args=(t,), daemon=True) for t in tenants]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=900)
        assert not any(th.is_alive() for th in threads), "a tenant did not finish within 900 s"
    else:
        for t in tenants:
            body(t)
    assert not errors, errors
    return results, time.perf_counter() - t0


@pytest.fixture(scope="module")
def load_run(launch):
    srv, keys = launch(TENANTS, limits={"max_models": 4})
    results, wall = run_all(srv.url, keys, TENANTS, concurrent=True)
    return srv, keys, results, wall


def test_eight_tenants_lose_and_reorder_nothing(load_run, launch):
    srv, keys, results, wall = load_run
    alone_srv, alone_keys = launch(TENANTS)
    alone, alone_wall = run_all(alone_srv.url, alone_keys, TENANTS, concurrent=False)
    worst_loss, worst_weight = 0.0, 0.0
    for t in TENANTS:
        got, ref = results[t], alone[t]
        assert len(got["losses"]) == STEPS and len(got["latencies"]) == STEPS, t  # nothing lost
        assert got["samples"] == [2], t
        worst_loss = max(worst_loss, float(np.max(np.abs(np.array(got["losses"]) - np.array(ref["losses"])))))
        a = adapter_of(srv.data_dir, t, got["model_id"], f"final-{TENANTS.index(t)}")
        b = adapter_of(alone_srv.data_dir, t, ref["model_id"], f"final-{TENANTS.index(t)}")
        assert a.keys() == b.keys() and a
        worst_weight = max(worst_weight, max(float(np.max(np.abs(a[k] - b[k]))) for k in a))
    lat = np.array([x for t in TENANTS for x in results[t]["latencies"]])
    steps = len(TENANTS) * STEPS
    print(f"\nload: {len(TENANTS)} tenants x {STEPS} steps (issue: 100; N chosen for CI's 2 cores) via the tinker SDK; "
          f"{steps} steps in {wall:.1f} s = {steps / wall:.1f} steps/s concurrent vs {steps / alone_wall:.1f} alone; "
          f"step latency p50 {np.percentile(lat, 50) * 1e3:.0f} ms p99 {np.percentile(lat, 99) * 1e3:.0f} ms "
          f"(window {WINDOW}); max |loss - alone| {worst_loss:.2e}, max |adapter - alone| {worst_weight:.2e}")
    assert worst_loss <= 1e-5 * max(1.0, max(abs(x) for t in TENANTS for x in alone[t]["losses"])), worst_loss
    assert worst_weight <= 1e-5, worst_weight
    SUMMARY["steps under load (0 lost, 0 reordered)"] = (
        f"{steps} ({len(TENANTS)} tenants x {STEPS}, SDK; {steps / wall:.1f} steps/s, "
        f"p50 {np.percentile(lat, 50) * 1e3:.0f} ms, p99 {np.percentile(lat, 99) * 1e3:.0f} ms; "
        f"vs alone: loss {worst_loss:.1e}, adapter {worst_weight:.1e})")
