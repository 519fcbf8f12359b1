"""32 tenants on one twinkle-server at once -- half through the unmodified Tinker SDK, half through
Twinkle's native client -- against the same work run one tenant at a time on the same server.

Each tenant trains a LoRA (its own seed) for --steps steps of forward_backward + optimizer step on
its own small batch (--batch x --seq tokens), pipelined --window steps ahead, as a client written
the intended way does. "At once": every tenant in its own thread, all started together. "One at a
time": the same tenants, the same steps, one after another. Fairness: each tenant's p99 step
latency (submit -> optimizer step answered) over the median tenant's p99 (goal ≤ 2). Correctness
at this scale (nothing lost, every tenant equals its run alone) is the reliability suite's
test_reliability_scale.py; this measures speed only.

    uv run benchmarks/bench_serve_tenants.py [--tenants 32] [--steps 8] [--model twinkle://qwen3-demo]

Prints a final JSON line: {"speedup": at-once steps/s / one-at-a-time steps/s, "p99_max_over_median": ..., raw numbers}.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections import deque

import numpy as np
from _server import start_server

os.environ.setdefault("TINKER_TELEMETRY", "0")


def tenant_rows(index: int, step: int, batch: int, seq: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(10_000 * index + step)
    return [rng.integers(10, vocab, size=seq + 1).tolist() for _ in range(batch)]


class SdkTenant:
    def __init__(self, url: str, key: str, model: str, index: int):
        import tinker
        from tinker import types

        self.types, self.index = types, index
        self.tc = (
            tinker.ServiceClient(base_url=url, api_key=key)
            .create_lora_training_client(base_model=model, rank=8, seed=index)
            .result()
        )

    def submit(self, rows):
        t = self.types
        data = [
            t.Datum(
                model_input=t.ModelInput.from_ints(r[:-1]),
                loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)},
            )
            for r in rows
        ]
        return self.tc.forward_backward(data, "cross_entropy"), self.tc.optim_step(t.AdamParams(learning_rate=1e-4))


class NativeTenant:
    def __init__(self, url: str, key: str, model: str, index: int):
        from twinkle.client import TwinkleClient
        from twinkle.client.model import TransformersModel

        self.model = TransformersModel(model_id=model, client=TwinkleClient(url, key, timeout=600), seed=index)
        self.model.add_adapter_to_model("default", {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"})
        self.model.set_optimizer("AdamW", lr=1e-4).result(timeout=600)

    def submit(self, rows):
        return self.model.forward_backward(
            inputs=[{"input_ids": r, "labels": r} for r in rows]
        ), self.model.clip_grad_and_step()


def run_tenant(tenant, index: int, steps: int, window: int, shape, latencies: list[float], barrier=None) -> None:
    """`steps` steps, at most `window` unanswered; one latency per step (submit -> optimizer answered)."""
    if barrier is not None:
        barrier.wait()
    pending: deque = deque()
    for step in range(steps):
        pending.append((time.perf_counter(), *tenant.submit(tenant_rows(index, step, *shape))))
        if len(pending) >= window or step == steps - 1:
            while pending and (len(pending) >= window or step == steps - 1):
                t0, fb, opt = pending.popleft()
                fb.result(timeout=600)
                opt.result(timeout=600)
                latencies.append(time.perf_counter() - t0)


def main():
    from transformers import AutoConfig

    from twinkle.hub import DEFAULT_MODEL, resolve_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8, help="per tenant and side")
    ap.add_argument("--window", type=int, default=2, help="steps a tenant submits ahead")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    vocab = AutoConfig.from_pretrained(resolve_model_path(args.model)).vocab_size
    shape = (args.batch, args.seq, vocab)

    proc, url, keys = start_server(args.model, args.tenants)
    try:
        tenants = [(SdkTenant if i % 2 == 0 else NativeTenant)(url, key, args.model, i) for i, key in enumerate(keys)]
        for i, t in enumerate(tenants):  # warm-up: every adapter and optimizer exists on the server
            run_tenant(t, i, 1, 1, shape, [])

        alone = [[] for _ in tenants]
        t0 = time.perf_counter()
        for i, t in enumerate(tenants):
            run_tenant(t, i, args.steps, args.window, shape, alone[i])
        alone_s = time.perf_counter() - t0

        together = [[] for _ in tenants]
        barrier = threading.Barrier(len(tenants) + 1)
        threads = [
            threading.Thread(target=run_tenant, args=(t, i, args.steps, args.window, shape, together[i], barrier))
            for i, t in enumerate(tenants)
        ]
        for th in threads:
            th.start()
        barrier.wait()
        t0 = time.perf_counter()
        for th in threads:
            th.join()
        together_s = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    steps = len(tenants) * args.steps
    assert all(len(x) == args.steps for x in together), "a tenant lost a step"
    p99 = np.array([np.percentile(x, 99) for x in together]) * 1e3
    print(
        json.dumps(
            {
                "speedup": alone_s / together_s,
                "p99_max_over_median": float(p99.max() / np.median(p99)),
                "together_steps_per_s": steps / together_s,
                "one_at_a_time_steps_per_s": steps / alone_s,
                "p99_ms_median_tenant": float(np.median(p99)),
                "p99_ms_worst_tenant": float(p99.max()),
                "tenants": len(tenants),
                "sdk_tenants": (len(tenants) + 1) // 2,
                "steps": args.steps,
                "window": args.window,
                "batch": args.batch,
                "seq": args.seq,
                "model": args.model,
            }
        )
    )


if __name__ == "__main__":
    main()
