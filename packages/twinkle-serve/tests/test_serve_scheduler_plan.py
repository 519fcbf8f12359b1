"""The scheduler composes fused passes with the planner (twinkle.model.multi_lora.planner) over typed
work (core/work.py): small heads of several runs share a pass, a batch past fuse_max_tokens runs alone,
runs whose row lengths would make the pass mostly padding do not share one, training and forward-only
heads never share one (the engine runs them as two), and the config's `fusion` section is the planner
the server's scheduler uses; every call is answered with its own StoredAnswer, committed before it is
visible."""

from __future__ import annotations

import json
import threading

import pytest
from pydantic import ValidationError

from twinkle.hub import TEST_MODEL
from twinkle.model.multi_lora.planner import FusionPlanner
from twinkle.serve.backend import RowsPass
from twinkle.serve.config import ServeConfig
from twinkle.serve.core.futures import FutureHub
from twinkle.serve.core.scheduler import Scheduler
from twinkle.serve.core.store import Store
from twinkle.serve.core.work import Call, PassJob, StoredAnswer


def _rows(n_rows: int, length: int) -> list[dict]:
    return [{"input_ids": list(range(length))} for _ in range(n_rows)]


def _serve(
    tmp_path,
    heads: dict[str, list[dict]],
    planner: FusionPlanner | None = None,
    forward_only: frozenset = frozenset(),
    tasks: dict[str, str] | None = None,
):
    """Queue one pass job per run while the worker is held, release it; -> (the passes the engine
    ran, as lists of adapter names, and each run's answer). `tasks`: a run's pass task (default causal_lm)."""
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
        item = RowsPass(queue, rows, queue in forward_only, task=(tasks or {}).get(queue, "causal_lm"))
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


def test_training_and_forward_only_heads_run_as_the_engine_runs_them(tmp_path):
    # forward_backward_many runs a mixed list as one pass per kind: the scheduler composes one kind a pass
    heads = {"a": _rows(1, 16), "b": _rows(1, 16), "c": _rows(1, 16), "d": _rows(1, 16)}
    passes, answers = _serve(tmp_path, heads, forward_only=frozenset({"b", "d"}))
    assert [sorted(p) for p in passes] == [["a", "c"], ["b", "d"]]
    assert answers == {q: {"rows": 1} for q in "abcd"}


def test_embedding_passes_share_a_pass_only_with_their_own_kind(tmp_path):
    # an embedding pass pools hidden states and skips the unembedding: never in a log-prob pass
    heads = {q: _rows(1, 16) for q in "abefg"}
    tasks = dict.fromkeys("efg", "embedding")
    passes, answers = _serve(tmp_path, heads, forward_only=frozenset({"g"}), tasks=tasks)
    assert sorted(sorted(p) for p in passes) == [["a", "b"], ["e", "f"], ["g"]]
    assert answers == {q: {"rows": 1} for q in "abefg"}


def test_max_fuse_caps_a_pass(tmp_path):
    passes, _ = _serve(tmp_path, {q: _rows(1, 8) for q in "abcde"}, FusionPlanner(max_fuse=2))
    assert [len(p) for p in passes] == [2, 2, 1]


def test_the_config_fusion_section_is_the_servers_planner(tmp_path):
    from twinkle.serve.runtime import ServerRuntime

    fusion = {"fuse_max_tokens": 64, "group_max_tokens": 256, "max_padding": 0.5, "max_fuse": 3}
    runtime = ServerRuntime(ServeConfig.model_validate({"models": [{"name": TEST_MODEL}], "fusion": fusion}), tmp_path)
    try:
        runtime.load_models()
        assert runtime.engines[TEST_MODEL].scheduler.planner == FusionPlanner(**fusion)
    finally:
        runtime.close()
    assert ServeConfig().fusion.planner() == FusionPlanner()  # the defaults are the planner's own
    with pytest.raises(ValidationError, match="max_padding"):
        ServeConfig.model_validate({"fusion": {"max_padding": 1.0}})
    with pytest.raises(ValidationError, match="max_fusion"):
        ServeConfig.model_validate({"fusion": {"max_fusion": 4}})  # unknown keys are errors
