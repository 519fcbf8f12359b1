"""Long-context LoRA training: TransformersModel against plain transformers + peft at 4K, 16K, 32K tokens.

Same model (twinkle.hub.TEST_MODEL, whose context is Qwen3's 32,768), same single row of N tokens,
same LoRA (r16, all-linear), same AdamW and gradient clipping. Twinkle runs as a user asks for long
context: `apply_patch("GradientCheckpointing")` and `apply_patch("ChunkedCrossEntropy")` (SDPA is the
model's attention either way). The plain loop is `model(input_ids, labels=...)`, `loss.backward()`.
Each (engine, length) runs in a process of its own under the same memory cap (RLIMIT_DATA, so the
shared machine never swaps), so peak RSS is that run's alone and a run over the cap shows as `oom`.
Per run: tokens/s (below 16K the faster of two timed steps after a warm-up; from 16K the one
step) and peak RSS. Final line: JSON with
`ratio` = twinkle tokens/s / plain tokens/s at the longest length both finish, and every run.

    uv run python benchmarks/bench_long_context.py [--lengths 4096 16384 32768] [--cap-gib 8] [--cp 2]

At the Qwen3-0.6B shape (issue 47: does one 32K-token row at the 151,936 vocabulary train in 24 GiB? add
`--cap-gib 24 --engines twinkle` for Twinkle's side alone):

    uv run python benchmarks/bench_long_context.py --model twinkle://qwen3-0.6b-shape --lengths 32768 --cp 1

`twinkle_cp2` (`--cp 2`, the default; `--cp 1` leaves it out) is the same Twinkle run under torchrun
on 2 processes of 1 thread each, with a DeviceMesh of cp_size=2 (each rank runs half the row;
twinkle.model.context_parallel), its peak RSS the larger rank's (the cap applies per process) and
`peak_rss_total_gib` both ranks'.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


# Below 16K: one warm-up step, then the faster of two timed ones (this machine is shared: the less
# disturbed one). From 16K a step takes tens of seconds of compute: its first step is the measure.
def _steps(n: int) -> int:
    return 3 if n < 16384 else 1


def _timed(times: list[float]) -> float:
    return min(times[1:]) if len(times) > 1 else times[0]


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")


def _row(n: int, vocab: int) -> list[int]:
    return [3 + (i * 7919) % (vocab - 3) for i in range(n)]


def run_twinkle(n: int, model_id: str, mesh=None) -> float:
    from twinkle.model import TransformersModel

    model = TransformersModel(model_id, device_mesh=mesh)
    model.add_adapter_to_model("long", _lora())
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=1e-4)
    model.apply_patch("GradientCheckpointing")
    model.apply_patch("ChunkedCrossEntropy", chunk_size=2048)
    ids = _row(n, model.vocab_size)
    times = []
    for _ in range(_steps(n)):
        t0 = time.perf_counter()
        model.forward_backward([{"input_ids": ids, "labels": ids}])
        model.clip_grad_and_step(1.0)
        times.append(time.perf_counter() - t0)
    return _timed(times)


def run_plain(n: int, model_id: str) -> float:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from twinkle.hub import resolve_model_path

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(resolve_model_path(model_id)), _lora())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.tensor([_row(n, model.get_input_embeddings().num_embeddings)])
    times = []
    for _ in range(_steps(n)):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return _timed(times)


def worker(engine: str, n: int, cap_gib: float, model_id: str) -> None:
    cap = int(cap_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    import torch

    mesh = None
    if engine.startswith("twinkle_cp"):  # a torchrun rank: the 2 cores split between the ranks
        import twinkle.mesh as tm

        torch.set_num_threads(1)
        tm.initialize(mode="local", seed=0)
        mesh = tm.DeviceMesh.from_sizes(dp_size=1, cp_size=int(engine.removeprefix("twinkle_cp")))
    else:
        torch.set_num_threads(2)
    try:
        seconds = run_plain(n, model_id) if engine == "plain" else run_twinkle(n, model_id, mesh)
        out = {"tokens_per_s": n / seconds, "step_s": seconds}
    except (MemoryError, RuntimeError) as e:
        if "memory" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        out = {"oom": True}
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(out))


def _combined(lines: list[dict]) -> dict:
    """One run's numbers; a torchrun run prints one line per rank (they step together)."""
    if len(lines) == 1:
        return lines[0]
    out = dict(lines[0])
    out["peak_rss_gib"] = max(line["peak_rss_gib"] for line in lines)
    out["peak_rss_total_gib"] = sum(line["peak_rss_gib"] for line in lines)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--cap-gib", type=float, default=8.0, help="memory cap of each run (RLIMIT_DATA)")
    parser.add_argument("--cp", type=int, default=2, help="also run Twinkle at this cp_size (torchrun; 1: not)")
    parser.add_argument("--model", default=None, help="model id (default: twinkle.hub.TEST_MODEL)")
    parser.add_argument("--engines", nargs="+", default=["twinkle", "plain"], choices=["twinkle", "plain"])
    parser.add_argument("--worker", nargs=2, metavar=("ENGINE", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from twinkle.hub import TEST_MODEL

        args.model = TEST_MODEL
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.cap_gib, args.model)
        return
    runs = {}
    for n in args.lengths:
        for engine in (*args.engines, *([f"twinkle_cp{args.cp}"] if args.cp > 1 else [])):
            cmd = [sys.executable, __file__, "--worker", engine, str(n), "--cap-gib", str(args.cap_gib)]
            cmd += ["--model", args.model]
            if engine.startswith("twinkle_cp"):
                cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.cp}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            # killed outright (the allocator's failure not even reaching Python) also counts as out of memory
            runs[f"{engine}_{n}"] = _combined(lines) if lines else {"oom": True, "exit": proc.returncode}
            print(f"{engine:8s} {n:6d} tokens: {runs[f'{engine}_{n}']}", flush=True)
    both = [
        n
        for n in args.lengths
        if "tokens_per_s" in runs.get(f"twinkle_{n}", {}) and "tokens_per_s" in runs.get(f"plain_{n}", {})
    ]
    ratio = runs[f"twinkle_{both[-1]}"]["tokens_per_s"] / runs[f"plain_{both[-1]}"]["tokens_per_s"] if both else None
    longest = max(args.lengths)
    rss = {e: runs.get(f"{e}_{longest}", {}).get("peak_rss_gib") for e in ("twinkle", "plain")}
    print(
        json.dumps(
            {
                "ratio": ratio,
                "ratio_at_tokens": both[-1] if both else None,
                "peak_rss_ratio_longest": rss["twinkle"] / rss["plain"] if rss["twinkle"] and rss["plain"] else None,
                "model": args.model,
                "cap_gib": args.cap_gib,
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
