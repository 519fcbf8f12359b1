"""Run benchmarks the one common way, record their final JSON lines, rebuild the Results table in docs/benchmarks.md.

    uvx nox -s bench -- bench_model_sft_step bench_serve_tinker     # named ones
    uvx nox -s bench                                                # all of them (long)
    uvx nox -s bench -- --render                                    # only rebuild the Results table

Each benchmark runs as its own process (`python benchmarks/NAME.py`, its output streamed), exactly as
its docstring says to run it. Its last stdout line must be a JSON object with a top-level `ratio` or
`speedup`; that object is appended to `benchmarks/results.jsonl` with the date, the commit and the
machine's load average, and the Results table (docs/benchmarks.md) takes each benchmark's newest record. A row
for a benchmark with no record yet is left as it was.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.jsonl"
RESULTS_DOC = HERE.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def benchmark_names(wanted: list[str]) -> list[str]:
    known = sorted(p.stem for p in HERE.glob("bench_*.py"))
    names = [w.removesuffix(".py").removeprefix("benchmarks/") for w in wanted] or known
    names = [n if n.startswith("bench_") else f"bench_{n}" for n in names]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def run_one(name: str) -> dict:
    load_before = os.getloadavg()[0]
    proc = subprocess.Popen([sys.executable, str(HERE / f"{name}.py")], stdout=subprocess.PIPE, text=True)
    last = ""
    for line in proc.stdout:
        sys.stdout.write(line)
        last = line.strip() or last
    if proc.wait() != 0:
        raise SystemExit(f"{name} exited with {proc.returncode}")
    try:
        result = json.loads(last)
    except ValueError:
        raise SystemExit(f"{name}: its last line is not JSON: {last[:200]!r}") from None
    if "ratio" not in result and "speedup" not in result:
        raise SystemExit(f"{name}: its JSON has neither 'ratio' nor 'speedup'")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    return {
        "benchmark": name,
        "date": datetime.date.today().isoformat(),
        "commit": commit.strip(),
        "load_avg": round(max(load_before, os.getloadavg()[0]), 2),
        "cpus": os.cpu_count(),
        "result": result,
    }


def newest_records() -> dict[str, dict]:
    if not RESULTS.exists():
        return {}
    records = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    return {r["benchmark"]: r for r in records}


def _headline(result: dict) -> str:
    key = "speedup" if "speedup" in result else "ratio"
    scalars = [
        (k, v) for k, v in result.items() if k != key and isinstance(v, int | float) and not isinstance(v, bool)
    ][:5]
    raw = ", ".join(f"{k} {v:.4g}" for k, v in scalars)
    return f"**{key} {result[key]:.3f}**" + (f"; {raw}" if raw else "")


def render(records: dict[str, dict]) -> None:
    text = RESULTS_DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    table, tail = rest.split(END, 1)
    lines = table.strip("\n").splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = cells[0].strip("`").removesuffix(".py")
        if name in records and len(cells) == 3:
            r = records[name]
            goal = re.search(r"\((?:goal )?[≥≤][^)]*\)", cells[2])  # the goal is the table's, kept
            load = f"load {r['load_avg']:.1f} on {r['cpus']} cores"
            result = _headline(r["result"]) + (f" {goal.group(0)}" if goal else "")
            lines[i] = f"| `{name}.py` | {cells[1]} | {result} ({r['date']}, {r['commit']}, {load}) |"
    RESULTS_DOC.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="benchmark names (bench_ prefix optional); none: all")
    parser.add_argument("--render", action="store_true", help="only rebuild the Results table")
    args = parser.parse_args()
    if not args.render:
        for name in benchmark_names(args.names):
            record = run_one(name)
            with RESULTS.open("a") as f:
                f.write(json.dumps(record) + "\n")
    render(newest_records())
    print(f"docs/benchmarks.md Results table rebuilt from {RESULTS.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
