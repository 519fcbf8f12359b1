"""Long work runs in slices on the scheduler (core/slices.py): a sliced call hands the engine back at its
step boundaries whenever other work is due, so a short request queued behind a long one on another
queue finishes first while the long one goes on; its own queue's later requests still wait for it; a
cancel stops it at its next step (running or paused), and a queued one is dropped. Driven through the
real Scheduler and FutureHub with plain Python work (the model-level slicing is test_serve_micro_batches)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from twinkle.serve.core import slices
from twinkle.serve.core.futures import FutureHub
from twinkle.serve.core.scheduler import Scheduler
from twinkle.serve.core.store import Store
from twinkle.serve.core.work import Call, StoredAnswer

STEP_S = 0.005


@pytest.fixture
def world(tmp_path):
    store = Store(tmp_path)
    hub = FutureHub(store)
    scheduler = Scheduler(hub)
    yield store, hub, scheduler
    scheduler.stop()
    store.close()


def _outcome(store, request_id: str, deadline_s: float = 60) -> tuple[str, dict]:
    end = time.monotonic() + deadline_s
    while (row := store.futures.get(request_id, "t")).status == "pending":
        assert time.monotonic() < end, f"{request_id} still pending"
        time.sleep(0.005)
    return row.status, json.loads(row.payload)


class Long:
    """A sliced call of `steps` steps of STEP_S each, a step boundary after each; records when each ran."""

    def __init__(self, steps: int):
        self.steps, self.ran = steps, []
        self.started = threading.Event()

    def __call__(self) -> StoredAnswer:
        self.started.set()
        for _ in range(self.steps):
            time.sleep(STEP_S)  # stands in for a decode step (the GIL is free, as in a forward)
            self.ran.append(time.monotonic())
            slices.step()
        return StoredAnswer.json({"steps": len(self.ran)})


def test_short_work_runs_between_the_steps_of_long_work(world):
    store, hub, scheduler = world
    long = Long(200)  # ~1 s alone
    long_id = hub.create("t")
    scheduler.submit(Call("sampler", None, long_id, long, sliced=True))
    assert long.started.wait(30)
    ran_at: list[float] = []
    shorts = []
    for i in range(5):
        time.sleep(0.02)
        shorts.append(hub.create("t"))
        scheduler.submit(
            Call(f"trainer{i}", None, shorts[-1], lambda: (ran_at.append(time.monotonic()), StoredAnswer.json({}))[1])
        )
        status, _ = _outcome(store, shorts[-1])
        assert status == "complete"
    status, out = _outcome(store, long_id)
    assert status == "complete" and out == {"steps": 200}
    # every short request ran while the long one still had steps to go: between its steps, not after them
    assert len(ran_at) == 5 and all(t < long.ran[-1] for t in ran_at), (ran_at, long.ran[-1])
    assert sum(1 for t in long.ran if t > ran_at[-1]) > 50


def test_a_queue_keeps_its_order_behind_its_sliced_head(world):
    store, hub, scheduler = world
    long, order = Long(40), []
    long_id = hub.create("t")
    scheduler.submit(Call("run", 1, long_id, lambda: (order.append("long"), long())[1], sliced=True))
    assert long.started.wait(30)
    after = hub.create("t")  # the same run's next request: after the long one, however many pauses it takes
    scheduler.submit(Call("run", 2, after, lambda: (order.append("after"), StoredAnswer.json({}))[1]))
    other = hub.create("t")
    scheduler.submit(Call("other", None, other, lambda: (order.append("other"), StoredAnswer.json({}))[1]))
    for request_id in (long_id, after, other):
        assert _outcome(store, request_id)[0] == "complete"
    assert order.index("long") < order.index("after")
    assert order.index("other") < order.index("after")  # it ran while the long one was paused


def test_cancel_stops_running_and_paused_work_at_its_next_step(world):
    store, hub, scheduler = world
    running, paused = Long(10_000), Long(10_000)  # ~50 s each if never stopped
    ids = {"running": hub.create("t"), "paused": hub.create("t")}
    scheduler.submit(Call("a", None, ids["running"], running, sliced=True))
    scheduler.submit(Call("b", None, ids["paused"], paused, sliced=True))
    assert running.started.wait(30) and paused.started.wait(30)  # both started: they take turns
    assert scheduler.cancel(ids["running"]) == "stopping" and scheduler.cancel(ids["paused"]) == "stopping"
    for kind in ("running", "paused"):
        status, failure = _outcome(store, ids[kind])
        assert status == "failed" and failure["category"] == "user", failure
        assert failure["error"].startswith("cancelled by the client while it ran: stopped after"), failure
    assert len(running.ran) < 10_000 and len(paused.ran) < 10_000  # both stopped long before their end
    assert scheduler.cancel(ids["running"]) is None  # done: nothing left to cancel
    # the engine is free: a new request runs at once
    free = hub.create("t")
    scheduler.submit(Call("c", None, free, lambda: StoredAnswer.json({"ok": True})))
    assert _outcome(store, free) == ("complete", {"ok": True})


def test_a_queued_request_is_dropped_and_a_whole_one_runs_on(world):
    store, hub, scheduler = world
    gate, held = threading.Event(), threading.Event()
    whole = hub.create("t")
    scheduler.submit(Call("a", None, whole, lambda: (held.set(), gate.wait(30), StoredAnswer.json({}))[2]))
    assert held.wait(30)
    queued = hub.create("t")
    scheduler.submit(Call("b", None, queued, Long(1), sliced=True))
    assert scheduler.cancel(queued) == "dropped" and scheduler.pending("b") == 0
    assert scheduler.cancel(whole) == "running"
    gate.set()
    assert _outcome(store, whole)[0] == "complete"


def test_new_jobs_first_turns_do_not_add_up_for_fresh_work(world):
    """A new sliced job's first turn lets a short request end unpaused, but fresh work that has already
    waited a turn's length (SLICE_S) does not wait through several new jobs' first turns in a row: each
    of three long jobs started together runs one step, then the short request runs."""
    from twinkle.serve.core.scheduler import SLICE_S

    store, hub, scheduler = world
    gate, held = threading.Event(), threading.Event()
    whole = hub.create("t")
    scheduler.submit(Call("busy", None, whole, lambda: (held.set(), gate.wait(30), StoredAnswer.json({}))[2]))
    assert held.wait(30)
    longs = [Long(1_000) for _ in range(3)]
    ids = [hub.create("t") for _ in longs]
    for i, (long, request_id) in enumerate(zip(longs, ids)):
        scheduler.submit(Call(f"long{i}", None, request_id, long, sliced=True))
    steps_before = []
    short = hub.create("t")
    scheduler.submit(
        Call("short", None, short, lambda: (steps_before.append([len(x.ran) for x in longs]), StoredAnswer.json({}))[1])
    )
    time.sleep(2 * SLICE_S)  # the short request has waited longer than a first turn's grace
    gate.set()
    assert _outcome(store, short)[0] == "complete"
    assert steps_before == [[1, 1, 1]], steps_before
    for request_id in ids:
        scheduler.cancel(request_id)
        assert _outcome(store, request_id)[0] == "failed"
