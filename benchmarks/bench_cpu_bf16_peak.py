"""The CPU's fastest number format: bf16 against fp32 matmul peak, in the same process.

Square matmuls (2048 x 2048 by default) on a fixed number of torch threads (2), the two dtypes
alternating round by round so that load on the machine hits both alike; each dtype's best round is
its peak. What the CPU offers for bf16 is read, not assumed: the AVX-512 BF16 and AMX flags from
/proc/cpuinfo and torch's own CPU capability. Machines of the same kind may lack AMX, and without
it (or AVX-512 BF16) bf16 matmuls run through conversions and can be slower than fp32. The bf16
result is also checked against the fp32 one (relative error of the product, for information).

    uv run python benchmarks/bench_cpu_bf16_peak.py [--size 2048] [--threads 2] [--rounds 5]

Final line: JSON with `ratio` = bf16 GFLOP/s / fp32 GFLOP/s, both peaks, and the detected features.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

FLAGS = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16", "avx512_fp16")


def cpu_features() -> dict:
    info = Path("/proc/cpuinfo")
    flags = set()
    model = ""
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            elif line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    return {
        "cpu": model,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **{f: f in flags for f in FLAGS},
    }


def best_gflops(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    a @ b  # warm: picks the kernel, faults in the output
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / best / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="fp32 and bf16 alternate this many times")
    parser.add_argument("--repeats", type=int, default=4, help="matmuls per dtype per round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    a32 = torch.randn(args.size, args.size, generator=gen)
    b32 = torch.randn(args.size, args.size, generator=gen)
    pairs = {"fp32": (a32, b32), "bf16": (a32.bfloat16(), b32.bfloat16())}
    peaks = {"fp32": 0.0, "bf16": 0.0}
    for i in range(args.rounds):
        for name in ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32"):
            peaks[name] = max(peaks[name], best_gflops(*pairs[name], args.repeats))
    exact = a32.double() @ b32.double()
    rel_err = {
        name: float(
            (a.float() @ b.float() if name == "fp32" else (a @ b).float()).double().sub(exact).norm() / exact.norm()
        )
        for name, (a, b) in pairs.items()
    }
    result = {
        "ratio": peaks["bf16"] / peaks["fp32"],
        "bf16_gflops": peaks["bf16"],
        "fp32_gflops": peaks["fp32"],
        "size": args.size,
        "threads": args.threads,
        "rounds": args.rounds,
        # the bf16 product's error includes rounding the inputs to bf16 (8-bit mantissa)
        "bf16_rel_err": rel_err["bf16"],
        "fp32_rel_err": rel_err["fp32"],
        "torch": torch.__version__,
        "load_avg": os.getloadavg()[0],
        **cpu_features(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
