"""The scheduler composes fused passes with the planner's cost model (twinkle.model.multi_lora.planner)
over typed work (core/work.py): small heads of several runs share a pass, a batch past
fuse_max_tokens runs alone, runs whose row lengths would make the pass mostly padding do not share
one; every call is answered with its own StoredAnswer, committed before it is visible."""

from __future__ import annotations

import json
import threading

from twinkle.model.multi_lora.planner import FusionPlanner
from twinkle.serve.backend import RowsPass
from twinkle.serve.core.futures import FutureHub
from twinkle.serve.core.scheduler import Scheduler
from twinkle.serve.core.store import Store
from twinkle.serve.core.work import Call, PassJob, StoredAnswer


def _rows(n_rows: int, length: int) -> list[dict]:
    return [{"input_ids": list(range(length))} for _ in range(n_rows)]


def _serve(tmp_path, heads: dict[str, list[dict]], planner: FusionPlanner | None = None):
    """Queue one pass job per run while the worker is held, release it; -> (the passes the engine
    ran, as lists of adapter names, and each run's answer)."""
    store = Store(tmp_path)
    hub = FutureHub(store)
    passes: list[list[str]] = []

    def runner(items):
        passes.append([item.adapter for item in items])
        return [{"rows": len(item.rows)} for item in items]

    scheduler = Scheduler(hub, fuse_runner=runner, planner=planner)
    gate, held = threading.Event(), threading.Event()

    def hold():
        held.set()
        gate.wait(60)
        return StoredAnswer.json({})

    scheduler.submit(Call("gate", None, hub.create("t"), hold))
    assert held.wait(60)
    ids = {}
    for queue, rows in heads.items():
        item = RowsPass(queue, rows, False)
        job = PassJob(item, lambda out: StoredAnswer.json(out), "native")
        ids[queue] = hub.create("t")
        scheduler.submit(Call(queue, 1, ids[queue], lambda item=item: StoredAnswer.json(runner([item])[0]), job))
    gate.set()
    answers = {}
    for queue, request_id in ids.items():
        while (row := store.futures.get(request_id, "t")).status == "pending":
            threading.Event().wait(0.01)
        answers[queue] = json.loads(row.payload)
    scheduler.stop()
    store.close()
    return passes, answers


def test_small_heads_of_several_runs_share_one_pass(tmp_path):
    passes, answers = _serve(tmp_path, {"a": _rows(2, 20), "b": _rows(1, 19), "c": _rows(3, 18)})
    assert [sorted(p) for p in passes] == [["a", "b", "c"]]  # the first queue first, then the plan's order
    assert answers == {"a": {"rows": 2}, "b": {"rows": 1}, "c": {"rows": 3}}


def test_a_batch_past_fuse_max_tokens_runs_alone(tmp_path):
    # 30 rows x 20 tokens = 600 padded tokens > fuse_max_tokens (512)
    passes, answers = _serve(tmp_path, {"big": _rows(30, 20), "b": _rows(1, 20), "c": _rows(1, 20)})
    assert passes == [["big"], ["b", "c"]]
    assert answers["big"] == {"rows": 30}


def test_lengths_that_would_make_the_pass_mostly_padding_do_not_share_it(tmp_path):
    # one row of 100 and one of 10: 200 padded tokens, 110 real -> 45 % padding > max_padding 0.25
    passes, _ = _serve(tmp_path, {"long": _rows(1, 100), "short": _rows(1, 10)})
    assert passes == [["long"], ["short"]]
    # a planner that allows the padding fuses them
    passes, _ = _serve(
        tmp_path / "loose", {"long": _rows(1, 100), "short": _rows(1, 10)}, FusionPlanner(max_padding=0.5)
    )
    assert passes == [["long", "short"]]
