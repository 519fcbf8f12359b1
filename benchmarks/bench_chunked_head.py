"""The loss's unembedding at Qwen3's vocabulary: the chunked head (one sweep per chunk, no full logits)
against whole logits with autograd, time and extra memory of the loss alone.

Both sides start from the same final hidden states `[N, H]` (requires_grad, as a LoRA model's are)
and a frozen head `[V, H]` (a LoRA base's unembedding), and compute the mean token cross-entropy and
its backward into the hidden states. Whole logits: `F.linear`, then `twinkle.loss.LogitsHead` (what
the library ran before the chunked head became its default). Chunked: `twinkle.loss.ChunkedHead`.
Each side runs in a process of its own (peak RSS is that run's alone: the issue saw glibc's arena
layout move peaks by GiBs from run to run), sides alternating, `--rounds` processes each; per process
one warm-up step and `--steps` timed ones. Extra memory = peak RSS during the steps - RSS before
them (inputs allocated in place, so the baseline has no transient). The chunked side is also run
once at `--long` tokens (default 32,768: ~20 GB of fp32 logits for whole logits, which this machine
cannot hold), for memory only.

    uv run python benchmarks/bench_chunked_head.py [--tokens 4096] [--vocab 151936] [--hidden 1024]
        [--dtype fp32|bf16] [--rounds 2] [--steps 2] [--long 32768]

Final line: JSON with `ratio` = chunked seconds / whole-logits seconds per step at `--tokens`
(goal <= 1.0), `cpu_ratio` the same in CPU seconds (all threads; steadier than wall time on a shared
machine), each side's extra memory, and the chunked side's at `--long` (goal <= 1 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(side: str, tokens: int, vocab: int, hidden: int, dtype_name: str, steps: int) -> dict:
    import torch

    from twinkle.loss import ChunkedHead, LogitsHead

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    g = torch.Generator().manual_seed(0)
    hidden_N_H = torch.empty(tokens, hidden, dtype=dtype).normal_(0, 1, generator=g).requires_grad_()
    weight_V_H = torch.empty(vocab, hidden, dtype=dtype).normal_(0, 0.02, generator=g)
    targets_1_N = torch.randint(0, vocab, (1, tokens), generator=g)

    def step() -> float:
        if side == "whole":
            head = LogitsHead(torch.nn.functional.linear(hidden_N_H, weight_V_H)[None])
        else:
            head = ChunkedHead(hidden_N_H[None], weight_V_H)
        loss = -head.target_logps(targets_1_N).mean()
        loss.backward()
        hidden_N_H.grad = None
        return float(loss)

    times, cpu, losses = [], [], []
    rss_before = _rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for i in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "seconds": min(times) if times else None,
        "cpu_seconds": min(cpu) if cpu else None,  # all threads' CPU time: the work, whatever the load
        "loss": losses[-1],
        "extra_gib": (peak - rss_before) / 2**30,
        "baseline_peak_over_rss_gib": (peak_before - rss_before) / 2**30,  # ~0: the baseline was clean
    }


def _spawn(side: str, tokens: int, args, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--tokens", str(tokens), "--vocab", str(args.vocab)]
    cmd += ["--hidden", str(args.hidden), "--dtype", args.dtype, "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout)[-400:], "returncode": out.returncode}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--long", type=int, default=32768, help="chunked side only, memory; 0 skips it")
    p.add_argument("--worker", choices=["whole", "chunked"])
    args = p.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.tokens, args.vocab, args.hidden, args.dtype, args.steps)))
        return
    runs: dict[str, list[dict]] = {"whole": [], "chunked": []}
    for r in range(args.rounds):
        for side in ("whole", "chunked") if r % 2 == 0 else ("chunked", "whole"):
            runs[side].append(_spawn(side, args.tokens, args, args.steps))
            print(side, runs[side][-1], flush=True)
    ok = {s: [x for x in v if "seconds" in x] for s, v in runs.items()}
    best = {s: min(x["seconds"] for x in v) if v else None for s, v in ok.items()}
    best_cpu = {s: min(x["cpu_seconds"] for x in v) if v else None for s, v in ok.items()}
    extra = {s: max(x["extra_gib"] for x in v) if v else None for s, v in ok.items()}
    result = {
        "ratio": best["chunked"] / best["whole"] if best["chunked"] and best["whole"] else None,
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "cpu_ratio": best_cpu["chunked"] / best_cpu["whole"] if best_cpu["chunked"] and best_cpu["whole"] else None,
        "whole_s": best["whole"],
        "chunked_s": best["chunked"],
        "whole_extra_gib": extra["whole"],
        "chunked_extra_gib": extra["chunked"],
        "loss_abs_diff": abs(ok["whole"][0]["loss"] - ok["chunked"][0]["loss"]) if all(ok.values()) else None,
        "load_avg": os.getloadavg()[0],
    }
    if args.long:
        long_run = _spawn("chunked", args.long, args, 0)
        print("chunked", args.long, long_run, flush=True)
        result["long_tokens"] = args.long
        result["chunked_extra_gib_long"] = long_run.get("extra_gib")
        logits_gib = args.long * args.vocab * 4 / 2**30
        result["whole_logits_alone_gib_long"] = logits_gib  # fp32 logits alone, before any backward
    print(json.dumps(result))


if __name__ == "__main__":
    main()
