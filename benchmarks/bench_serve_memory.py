"""What a running `twinkle-server` holds with 8 and with 32 tenants, against what it must hold.

A real server process per measurement (benchmarks/_server.py), driven through the unmodified
Tinker SDK: N LoRA tenants on twinkle://qwen3-demo (ranks 8/16/32 cycling; attention, MLP and
unembedding, as the SDK asks by default), each trained 2 steps (forward_backward + AdamW
optim_step, so every tenant holds its optimizer state). Then the benchmark waits 12 s (the server
idles; what it does then is its own business: it hands freed memory back after TRIM_AFTER_IDLE_S = 10 s
of quiet) and reads the server process's RSS from /proc,
nothing trimmed or collected by the benchmark.
- runtime: the same server on twinkle://qwen3-tiny (0.2M parameters) after one tenant's 2 steps:
  Python, torch, transformers, uvicorn and the warmed code paths, which every server pays whatever
  its model; the server's memory for the work is RSS - runtime.
- ideal: the base model's parameter bytes + every tenant's LoRA factors and AdamW state
  (exp_avg, exp_avg_sq, step), computed by building the same adapters locally.
Final line: JSON with `ratio` = the larger of (RSS - runtime) / ideal at 8 and 32 tenants (goal <= 1.2).
`--model twinkle://qwen3-0.6b-shape --tenants 1,4,8` measures it at the size people train (issue 47):
the base then counts at the dtype the server holds it in (bf16 where the CPU multiplies bf16 fast).

    uv run python benchmarks/bench_serve_memory.py [--tenants 8,32] [--model twinkle://qwen3-demo]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from _server import start_server

MODEL, RUNTIME_MODEL = "twinkle://qwen3-demo", "twinkle://qwen3-tiny"
RANKS, ROWS, SEQ, STEPS = (8, 16, 32), 2, 64, 2


def tree_rss(pid: int) -> int:
    """RSS of a process and its children (bytes)."""
    total, pending = 0, [pid]
    while pending:
        p = pending.pop()
        with open(f"/proc/{p}/statm") as f:
            total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                pending += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return total


def rank_of(i: int) -> int:
    return RANKS[i % len(RANKS)]


def served_rss(model: str, tenants: int) -> int:
    """The server's RSS serving `model` after `tenants` tenants' STEPS steps and its idle release."""
    import tinker
    from tinker import types

    proc, url, keys = start_server(model, 1)
    try:
        service = tinker.ServiceClient(base_url=url, api_key=keys[0])
        clients = [
            service.create_lora_training_client(base_model=model, rank=rank_of(i), seed=i).result()
            for i in range(tenants)
        ]
        rows = [[(7 * i + j) % 800 + 3 for j in range(SEQ + 1)] for i in range(ROWS)]
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(r[:-1]),
                loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * SEQ},
            )
            for r in rows
        ]
        for _ in range(STEPS):
            pending = []
            for client in clients:  # every tenant's step in flight at once: the server fuses them
                pending.append(client.forward_backward(data, "cross_entropy"))
                pending.append(client.optim_step(types.AdamParams(learning_rate=1e-4)))
            for future in pending:
                future.result()
        time.sleep(12.0)  # past the server's own idle release (TRIM_AFTER_IDLE_S)
        return tree_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)


def ideal_bytes(model: str, tenants: int) -> tuple[int, int]:
    """(base parameter bytes, adapters + AdamW state bytes) for the same tenants, built locally."""
    import torch
    from peft import LoraConfig

    from twinkle.model.multi_lora import MultiLoraModel
    from twinkle.serve.backend.base import LoraSpec
    from twinkle.serve.backend.multi_lora_backend import LORA_ALPHA

    engine = MultiLoraModel(model)
    base = sum(p.numel() * p.element_size() for p in engine.base.parameters())
    names = [f"t{i}" for i in range(tenants)]
    for i, name in enumerate(names):
        targets = LoraSpec(rank=rank_of(i)).target_modules(engine.base)
        engine.add_adapter_to_model(name, LoraConfig(r=rank_of(i), lora_alpha=LORA_ALPHA, target_modules=targets))
        engine.set_optimizer("AdamW", adapter_name=name, lr=1e-4)
    engine.forward_backward_fused({n: [{"input_ids": list(range(3, 3 + SEQ))}] for n in names})
    for name in names:
        engine.clip_grad_and_step(adapter_name=name)
    with torch.no_grad():
        adapters = sum(engine.adapters[n].parameter_bytes() for n in names)
    return base, adapters


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tenants", default="8,32")
    parser.add_argument("--model", default=MODEL)
    args = parser.parse_args()
    mib = 1 << 20
    runtime = served_rss(RUNTIME_MODEL, 1)
    result = {"benchmark": "serve_memory", "model": args.model, "runtime_rss_mib": round(runtime / mib, 1)}
    ratios = []
    for tenants in (int(t) for t in args.tenants.split(",")):
        rss = served_rss(args.model, tenants)
        base, adapters = ideal_bytes(args.model, tenants)
        ratio = (rss - runtime) / (base + adapters)
        ratios.append(ratio)
        result[f"tenants_{tenants}"] = {
            "rss_mib": round(rss / mib, 1),
            "held_mib": round((rss - runtime) / mib, 1),
            "base_mib": round(base / mib, 1),
            "adapters_adamw_mib": round(adapters / mib, 1),
            "ratio": round(ratio, 3),
        }
        print(json.dumps({f"tenants_{tenants}": result[f"tenants_{tenants}"]}), flush=True)
    result["load_avg"] = os.getloadavg()[0]
    result["ratio"] = round(max(ratios), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
