"""Native-client training speed against local mode on the same loop: forward_backward +
clip_grad_and_step on the same rows, (a) a local TransformersModel in this process, (b) the
twinkle-client proxy against a real twinkle-server (uvicorn on loopback, in this process), reading
each step's loss before the next call (no pipelining), and (c) reading the losses only at the end
(pipelined: the client queues calls while the server computes). Prints a final JSON line with
`ratio` = pipelined native steps/s / local steps/s, the unpipelined ratio, and the raw numbers.

    uv run python benchmarks/bench_client_native.py [--model twinkle://qwen3-demo] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def rows_for(model_id: str, n: int, length: int) -> list[dict]:
    from transformers import AutoConfig

    from twinkle.hub import resolve_model_path

    vocab = AutoConfig.from_pretrained(resolve_model_path(model_id)).vocab_size
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(3, vocab, (length,), generator=g).tolist()), "labels": ids}
            for _ in range(n)]


def loop(model, rows, steps: int, pipelined: bool) -> float:
    from peft import LoraConfig

    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer(optimizer_cls="AdamW", lr=1e-4)
    model.forward_backward(inputs=rows)["loss"]  # warm-up (and, over HTTP, waits for the set-up)
    model.clip_grad_and_step()
    start, outs = time.perf_counter(), []
    for _ in range(steps):
        out = model.forward_backward(inputs=rows)
        if not pipelined:
            float(out["loss"])
        outs.append(out)
        model.clip_grad_and_step()
    losses = [float(o["loss"]) for o in outs]
    elapsed = time.perf_counter() - start
    assert all(l == l for l in losses)
    return steps / elapsed


def main() -> None:
    from twinkle.hub import TEST_MODEL

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=TEST_MODEL)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = rows_for(args.model, args.batch, args.length)

    import twinkle.serve as ts
    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel as RemoteModel
    from twinkle.mesh import initialize
    from twinkle.model import TransformersModel

    initialize(mode="local", seed=42)
    local = loop(TransformersModel(model_id=args.model), rows, args.steps, pipelined=False)
    server = ts.initialize(mode="http", port=0, data_dir=tempfile.mkdtemp(), block=False, log_level="warning",
                           config={"models": [{"name": args.model}]}).wait_ready()
    try:
        client = TwinkleClient(server.url, server.create_key("bench"))
        unpipelined = loop(RemoteModel(model_id=args.model, client=client), rows, args.steps, pipelined=False)
        pipelined = loop(RemoteModel(model_id=args.model, client=client), rows, args.steps, pipelined=True)
    finally:
        server.stop()
    print(json.dumps({"ratio": round(pipelined / local, 4), "ratio_unpipelined": round(unpipelined / local, 4),
                      "local_steps_per_s": round(local, 3), "native_steps_per_s": round(unpipelined, 3),
                      "native_pipelined_steps_per_s": round(pipelined, 3), "model": args.model,
                      "steps": args.steps, "batch": args.batch, "length": args.length}))


if __name__ == "__main__":
    main()
