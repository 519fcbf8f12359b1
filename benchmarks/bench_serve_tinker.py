"""Tinker-SDK training steps/s through twinkle-server vs the same steps in-process (local mode).

One step = forward_backward (cross_entropy, batch B x T) + optim_step (AdamW) on a LoRA of the
embedded default model. Server side: `twinkle-server` in its own process, as users run it, driven by
the unmodified tinker SDK with both calls submitted before either is awaited (the SDK's intended
pipelining). Local side: the same backend class, called directly in this process's main thread.
Then the same with 4 tenants at once: 4 SDK clients in threads against the local engine's own fused
path (the 4 adapters' forward_backward in one fused pass, then each adapter's optimizer step), so
the 4-tenant ratio measures serving, not fusion.

The server runs in its own process (benchmarks/_server.py says why).

    uv run benchmarks/bench_serve_tinker.py [--model twinkle://qwen3-demo] [--steps 12] [--rounds 3] [--batch 8] [--seq 128]

Prints a final JSON line: {"ratio": server/local steps/s (1 tenant), "ratio_4_tenants": ..., raw numbers}.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np
from _server import start_server

os.environ.setdefault("TINKER_TELEMETRY", "0")


def make_batch(batch, seq, vocab, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, size=seq + 1).tolist() for _ in range(batch)]


def local_seconds(backend, adapters, rows, steps) -> float:
    """Steps of every adapter in `adapters`; several adapters' forward_backward run as one fused pass."""
    from twinkle.serve.backend import AdamParams
    from twinkle.serve.tinker.datums import Datum, forward_result, training_pass

    data = [Datum(r[:-1], {"target_tokens": np.array(r[1:]), "weights": np.ones(len(r) - 1, np.float32)}) for r in rows]
    start = time.perf_counter()
    for _ in range(steps):
        # the checks and the shift each step, as the server's Tinker layer does them
        passes = [training_pass(name, data, "cross_entropy", {}, False, backend) for name in adapters]
        for outcome in backend.forward_backward_many(passes):
            forward_result(outcome)
        for name in adapters:
            backend.optim_step(name, AdamParams(learning_rate=1e-4))
    return time.perf_counter() - start


class SdkTenant:
    """One Tinker-SDK training client on the server, warmed up; `seconds(steps)` times pipelined steps."""

    def __init__(self, url, key, model, rows):
        import tinker
        from tinker import types

        self.types = types
        self.data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(r[:-1]),
                loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)},
            )
            for r in rows
        ]
        self.tc = (
            tinker.ServiceClient(base_url=url, api_key=key)
            .create_lora_training_client(base_model=model, rank=16, seed=0)
            .result()
        )
        self.seconds(1)  # warm-up

    def seconds(self, steps, barrier=None) -> float:
        if barrier is not None:
            barrier.wait()
        start, pending = time.perf_counter(), []
        for _ in range(steps):  # both calls of every step submitted before anything is awaited
            pending.append(self.tc.forward_backward(self.data, "cross_entropy"))
            pending.append(self.tc.optim_step(self.types.AdamParams(learning_rate=1e-4)))
        for f in pending:
            f.result()
        return time.perf_counter() - start


def main():
    import torch

    from twinkle.hub import DEFAULT_MODEL, resolve_model_path
    from twinkle.serve.backend import LoraSpec, create_backend

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--steps", type=int, default=12, help="per side and case, split over --rounds")
    ap.add_argument("--rounds", type=int, default=3, help="local and server alternate this many times")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch_threads = int(os.environ.setdefault("OMP_NUM_THREADS", "2"))  # the server process inherits it
    torch.set_num_threads(torch_threads)

    proc, url, keys = start_server(args.model, 4)
    try:
        backend = create_backend(args.model, str(resolve_model_path(args.model)))  # what the server runs
        rows = make_batch(args.batch, args.seq, backend.vocab_size, 0)
        for i in range(4):
            backend.create_adapter(f"local{i}", LoraSpec(rank=16, seed=0))
        local_seconds(backend, ["local0"], rows, 1)  # warm-up
        local_seconds(backend, [f"local{i}" for i in range(4)], rows, 1)
        tenants = [SdkTenant(url, key, args.model, rows) for key in keys]
        per_round = max(1, args.steps // args.rounds)
        seconds = {"local_1": 0.0, "server_1": 0.0, "local_4": 0.0, "server_4": 0.0}
        for _ in range(args.rounds):  # alternating, so load changes on the machine hit both sides alike
            seconds["local_1"] += local_seconds(backend, ["local0"], rows, per_round)
            seconds["server_1"] += tenants[0].seconds(per_round)
            seconds["local_4"] += local_seconds(backend, [f"local{i}" for i in range(4)], rows, per_round)
            barrier, spans = threading.Barrier(4), [0.0] * 4

            def run(i, spans=spans, barrier=barrier):
                spans[i] = tenants[i].seconds(per_round, barrier)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds["server_4"] += max(spans)  # the 4 tenants' aggregate, over the slowest one's window
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    steps = per_round * args.rounds
    rate = {k: steps * (4 if k.endswith("_4") else 1) / v for k, v in seconds.items()}
    print(
        json.dumps(
            {
                "ratio": rate["server_1"] / rate["local_1"],
                "ratio_4_tenants": rate["server_4"] / rate["local_4"],
                "server_steps_per_s": rate["server_1"],
                "local_steps_per_s": rate["local_1"],
                "server_4_tenants_steps_per_s": rate["server_4"],
                "local_4_adapters_fused_steps_per_s": rate["local_4"],
                "local_step_ms": 1000 / rate["local_1"],
                "model": args.model,
                "torch_threads": torch_threads,
                "batch": args.batch,
                "seq": args.seq,
                "steps": steps,
                "rounds": args.rounds,
            }
        )
    )


if __name__ == "__main__":
    main()
