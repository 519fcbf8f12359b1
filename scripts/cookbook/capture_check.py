"""What the cookbook's capture/ recorded of a recipe run inside `capture_to_store` (boot.py): every sampled
sequence as a row of its store (SQLite, `capture.sqlite`), with its run and the sampler it came from.
The RL loop saves new sampler weights each step, so a row's step is the order of its sampler; the rows'
token count is compared with the tokens the recipe itself logged (env/all/ac_tokens_per_turn x turns)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from recipes import metrics


def summary(store: Path, run_id: str, log: Path) -> dict:
    db = store / "capture.sqlite"
    if not db.exists():
        return {"capture": f"no store at {db}"}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute("SELECT run_id, sampling_session_id, sampled_tokens, logprobs FROM wire_rows").fetchall()
    ops = [json.loads(p).get("op") for (p,) in con.execute("SELECT payload FROM annotations ORDER BY cursor")]
    con.close()
    samplers = sorted({r[1] for r in rows}, key=lambda s: int(str(s).rsplit(":", 1)[-1]))
    per_step = {}
    complete = 0
    for run, sampler, tokens_json, logprobs_json in rows:
        tokens, logprobs = json.loads(tokens_json or "null"), json.loads(logprobs_json or "null")
        step = samplers.index(sampler)
        per_step[step] = per_step.get(step, 0) + len(tokens or [])
        complete += run == run_id and bool(tokens) and logprobs is not None and len(logprobs) == len(tokens)
    logged = [
        round(m["env/all/ac_tokens_per_turn"] * m["env/all/turns_per_episode"] * m.get("env/all/total_episodes", 0))
        for m in metrics(log)
        if "env/all/ac_tokens_per_turn" in m
    ]
    return {
        "captured_rows": len(rows),
        "rows_with_run_tokens_logprobs": complete,
        "captured_tokens_per_step": [per_step[k] for k in sorted(per_step)],
        "logged_tokens_per_step": logged,
        "train_ops": {op: ops.count(op) for op in set(ops)},
    }
