"""Native-client training speed against local mode on the same loop: forward_backward +
clip_grad_and_step on the same rows, (a) a local MultiLoraModel in this process (the engine the
server runs, so the ratio measures serving, not a difference of engines), (b) the
twinkle-client proxy against a real twinkle-server (its own process on loopback, see _server.py), reading
each step's loss before the next call (no pipelining), and (c) reading the losses only at the end
(pipelined: the client queues calls while the server computes). Prints a final JSON line with
`ratio` = pipelined native steps/s / local steps/s, the unpipelined ratio, and the raw numbers,
among them what serving adds per step: `overhead_ms_per_step` (wall), and the CPU the client and
the server process spent per step against the local loop's (`*_cpu_ms_per_step`).

Serving costs a fixed amount of CPU per request (HTTP parse and routing, auth, the future's and the
idempotent answer's SQLite rows; a step is 2 submissions and 1 long poll), and on a 2-core machine
that CPU is taken from the step itself. Measured as CPU time on the test model: the server ~2.4 ms a
step, the client ~1.3 ms. Thread hops cost more than their CPU: while the engine's thread runs the
model's Python, each hop to the route thread pool waits on GIL hand-offs. With the step route sync
(two hops) and forward_backward on the pool (one), the ratio was 0.88-0.92; with per-step submissions
queued on the event loop (twinkle/serve/queueing.py) it is 1.02-1.04, the pipelined client now
overlapping its next request's parse with the engine's pass (unpipelined 0.96-0.98).
Measure both, with alternating rounds, on a quiet machine:

    uv run python benchmarks/bench_client_native.py
    uv run python benchmarks/bench_client_native.py --model twinkle://qwen3-demo --steps 12 --rounds 3

The default is 80 steps in 8 rounds: with the earlier 20 steps in 4 rounds (5 steps of ~35 ms a
round) the same quiet machine gave 0.897 and 1.156 on one commit, so the figure was mostly noise.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from _server import start_server


def rows_for(model_id: str, n: int, length: int) -> list[dict]:
    from transformers import AutoConfig

    from twinkle.hub import resolve_model_path

    vocab = AutoConfig.from_pretrained(resolve_model_path(model_id)).vocab_size
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": (ids := torch.randint(3, vocab, (length,), generator=g).tolist()), "labels": ids}
        for _ in range(n)
    ]


def prepare(model, rows):
    from peft import LoraConfig

    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer(optimizer_cls="AdamW", lr=1e-4)
    float(model.forward_backward(inputs=rows)["loss"])  # warm-up (and, over HTTP, waits for the set-up)
    model.clip_grad_and_step()
    return model


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) another process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_steps(model, rows, steps: int, pipelined: bool) -> float:
    """Seconds for `steps` steps, every result read (pipelined: only after the last call)."""
    start, outs = time.perf_counter(), []
    for _ in range(steps):
        out = model.forward_backward(inputs=rows)
        if not pipelined:
            float(out["loss"])
        outs.append(out)
        model.clip_grad_and_step()
    losses = [float(o["loss"]) for o in outs]
    assert all(x == x for x in losses), "NaN loss"
    return time.perf_counter() - start


def main() -> None:
    from twinkle.hub import TEST_MODEL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=TEST_MODEL)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8, help="the three loops alternate in this many rounds")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    rows = rows_for(args.model, args.batch, args.length)

    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel as RemoteModel
    from twinkle.mesh import initialize
    from twinkle.model.multi_lora import MultiLoraModel

    initialize(mode="local", seed=42)
    proc, url, (key,) = start_server(args.model, 1)  # the server process inherits OMP_NUM_THREADS
    seconds = {"local": 0.0, "native": 0.0, "pipelined": 0.0}
    cpu = {"local": 0.0, "client": 0.0, "server": 0.0}  # local loop; client and server in the pipelined loop
    try:
        client = TwinkleClient(url, key)
        models = {
            "local": prepare(MultiLoraModel(model_id=args.model), rows),
            "native": prepare(RemoteModel(model_id=args.model, client=client), rows),
            "pipelined": prepare(RemoteModel(model_id=args.model, client=client), rows),
        }
        per_round = max(1, args.steps // args.rounds)
        for _ in range(args.rounds):  # alternating, so load from other processes hits all three alike
            for name, model in models.items():
                mine, server = time.process_time(), process_cpu(proc.pid)
                seconds[name] += run_steps(model, rows, per_round, pipelined=name == "pipelined")
                if name == "local":
                    cpu["local"] += time.process_time() - mine
                elif name == "pipelined":
                    cpu["client"] += time.process_time() - mine
                    cpu["server"] += process_cpu(proc.pid) - server
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    steps = per_round * args.rounds
    local, unpipelined, pipelined = (steps / seconds[k] for k in ("local", "native", "pipelined"))
    print(
        json.dumps(
            {
                "ratio": round(pipelined / local, 4),
                "ratio_unpipelined": round(unpipelined / local, 4),
                "local_steps_per_s": round(local, 3),
                "native_steps_per_s": round(unpipelined, 3),
                "native_pipelined_steps_per_s": round(pipelined, 3),
                "overhead_ms_per_step": round(1000 / pipelined - 1000 / local, 3),
                **{f"{k}_cpu_ms_per_step": round(1000 * v / steps, 3) for k, v in cpu.items()},
                "model": args.model,
                "steps": steps,
                "threads": args.threads,
                "batch": args.batch,
                "length": args.length,
            }
        )
    )


if __name__ == "__main__":
    main()
