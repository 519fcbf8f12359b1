"""Tinker-SDK training steps/s through twinkle-server vs the same steps in-process (local mode).

One step = forward_backward (cross_entropy, batch B x T) + optim_step (AdamW) on a LoRA of the
embedded default model. Server side: `twinkle-server` in its own process, as users run it, driven by
the unmodified tinker SDK with both calls submitted before either is awaited (the SDK's intended
pipelining). Local side: the same backend class, called directly in this process's main thread.
Then the same with 4 tenants at once (4 SDK clients in threads vs 4 adapters in turn).

The server runs in its own process (benchmarks/_server.py says why).

    python benchmarks/bench_serve_tinker.py [--model twinkle://qwen3-demo] [--steps 6] [--batch 8] [--seq 128]

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


def local_steps(backend, adapters, rows, steps):
    from twinkle.serve.backend import AdamParams, Datum

    data = [Datum(r[:-1], {"target_tokens": np.array(r[1:]), "weights": np.ones(len(r) - 1, np.float32)})
            for r in rows]
    start = time.perf_counter()
    for _ in range(steps):
        for name in adapters:
            backend.forward_backward(name, data, "cross_entropy", {}, False)
            backend.optim_step(name, AdamParams(learning_rate=1e-4))
    return steps * len(adapters) / (time.perf_counter() - start)


def sdk_steps(url, key, model, rows, steps, barrier=None):
    import tinker
    from tinker import types

    data = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                        loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)}) for r in rows]
    client = tinker.ServiceClient(base_url=url, api_key=key)
    tc = client.create_lora_training_client(base_model=model, rank=16, seed=0).result()
    tc.forward_backward(data, "cross_entropy").result()  # warm-up
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    if barrier is not None:
        barrier.wait()
    start = time.perf_counter()
    pending = []
    for _ in range(steps):
        pending.append(tc.forward_backward(data, "cross_entropy"))
        pending.append(tc.optim_step(types.AdamParams(learning_rate=1e-4)))
    for f in pending:
        f.result()
    return steps / (time.perf_counter() - start), time.perf_counter() - start


def main():
    import torch

    from twinkle.hub import DEFAULT_MODEL, resolve_model_path
    from twinkle.serve.backend import LoraSpec, create_backend

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch_threads = int(os.environ.setdefault("OMP_NUM_THREADS", "2"))  # the server process inherits it
    torch.set_num_threads(torch_threads)

    proc, url, keys = start_server(args.model, 4)
    backend = create_backend("multi_lora", args.model, resolve_model_path(args.model))  # what the server runs
    rows = make_batch(args.batch, args.seq, backend.vocab_size, 0)
    for i in range(4):
        backend.create_adapter(f"local{i}", LoraSpec(rank=16, seed=0))
    local_steps(backend, ["local0"], rows, 1)  # warm-up

    # interleave local and server runs so load changes on the machine hit both alike
    local_1 = local_steps(backend, ["local0"], rows, args.steps)
    server_1, _ = sdk_steps(url, keys[0], args.model, rows, args.steps)
    local_4 = local_steps(backend, [f"local{i}" for i in range(4)], rows, args.steps)
    barrier, rates = threading.Barrier(4), [None] * 4

    def tenant(i):
        rates[i] = sdk_steps(url, keys[i], args.model, rows, args.steps, barrier)

    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server_4 = 4 * args.steps / max(r[1] for r in rates)  # aggregate steps/s over the slowest tenant's window
    proc.terminate()
    proc.wait(timeout=60)
    result = {"ratio": server_1 / local_1, "ratio_4_tenants": server_4 / local_4,
              "server_steps_per_s": server_1, "local_steps_per_s": local_1,
              "server_4_tenants_steps_per_s": server_4, "local_4_adapters_steps_per_s": local_4,
              "local_step_ms": 1000 / local_1, "model": args.model, "torch_threads": torch_threads,
              "batch": args.batch, "seq": args.seq, "steps": args.steps}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
