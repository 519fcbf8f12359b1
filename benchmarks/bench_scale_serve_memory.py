"""What a `twinkle-server` holds with 1, 4 and 8 Tinker tenants at the Qwen3-0.6B shape (issue 47), against
the base + adapters + AdamW bytes it must hold: bench_serve_memory on `twinkle://qwen3-0.6b-shape` (random
weights at the published shape; the base counted in the dtype the server holds it in).

    uv run python benchmarks/bench_scale_serve_memory.py

Final line: bench_serve_memory's JSON (`ratio` = the largest (RSS - runtime) / ideal; goal <= 1.2 at 8).
"""

import sys

from bench_serve_memory import main

if __name__ == "__main__":
    sys.argv[1:] = ["--model", "twinkle://qwen3-0.6b-shape", "--tenants", "1,4,8", *sys.argv[1:]]  # --help works
    main()
