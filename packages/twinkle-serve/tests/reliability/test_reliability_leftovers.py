"""A refused or failed request leaves nothing behind. Each creation path of both APIs is failed
midway inside a real in-process server (the backend call does its work, then raises): afterwards no
half-created adapter, run or checkpoint is listed, the store and the in-memory maps (live adapters,
adapter-memory reservations, the native adapter table) agree, every listing and curve read answers
200 or 404 (never 500), and the same creation then succeeds. Refusals by the per-minute creation
limits leave nothing either, and values the server cannot represent are 400s naming the field.
"""

from __future__ import annotations

import httpx
import pytest
from _util_isolation import NativeWire, native_row
from harness import SUMMARY, Wire

TENANT = "leftovers"


class Boom(RuntimeError):
    """The injected failure."""


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    import twinkle.serve as ts
    from twinkle.hub import TEST_MODEL

    server = ts.initialize(
        mode="http",
        port=0,
        data_dir=tmp_path_factory.mktemp("leftovers"),
        # a memory cap, so every adapter holds a reservation the failure must release
        config={
            "models": [{"name": TEST_MODEL}],
            "max_adapter_memory_mb": 256,
            "tenant_limits": {"burst": {"sessions_per_minute": 3, "adapters_per_minute": 2}},
        },
        block=False,
        log_level="warning",
    ).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def wires(srv):
    key = srv.create_key(TENANT)
    t, n = Wire(srv.url, key), NativeWire(srv.url, key)
    yield t, n
    t.close()
    n.close()


def _a_hidden_fault(error: str) -> bool:
    """The injected failure is the server's: answered as an internal error with the log's reference,
    never with the exception's own text (twinkle.serve.errors.internal_error)."""
    return "internal error" in error and "logged as" in error and "injected failure" not in error


def backend(srv):
    return next(iter(srv.runtime.engines.values())).backend


def fail_after(monkeypatch, srv, method: str):
    """backend.method runs, then raises: the failure comes after the work it was asked to do."""
    be = backend(srv)
    original = getattr(be, method)

    def broken(*args, **kwargs):
        original(*args, **kwargs)
        raise Boom(f"injected failure after {method}")

    monkeypatch.setattr(be, method, broken)


def agree(srv, t: Wire, n: NativeWire) -> None:
    """The store, the live map, the reservations and the backend describe the same adapters."""
    rt, be = srv.runtime, backend(srv)
    live = {mid: rt.live.get(mid) for mid in rt.live.run_ids()}
    for mid, entry in live.items():
        assert rt.store.runs.get(mid) is not None, f"live adapter of a run the store does not have: {mid}"
        assert be.adapter_rank(entry.adapter) is not None, f"live entry without an adapter: {mid}"
    held = set(rt.adapter_memory._held)
    built = {name for name in held if be.adapter_rank(name) is not None}
    assert held == built, f"reservations without an adapter: {held - built}"
    runs = t.ok(t.get("/training_runs", params={"limit": 1000}))["training_runs"]
    for run in runs:
        assert t.get(f"/training_runs/{run['training_run_id']}/checkpoints").status_code == 200
        assert n.get(f"/runs/{run['training_run_id']}/curves").status_code == 200
    assert t.get("/checkpoints").status_code == 200 and n.get("/runs").status_code == 200
    assert n.get("/checkpoints").status_code == 200


def test_tinker_create_model_failing_midway_leaves_no_run(srv, wires, monkeypatch):
    t, n = wires
    session = t.session()
    fail_after(monkeypatch, srv, "create_adapter")
    from twinkle.hub import TEST_MODEL

    body = {"session_id": session, "model_seq_id": 0, "base_model": TEST_MODEL, "lora_config": {"rank": 4}}
    kind, out = t.result(t.ok(t.post("/create_model", body))["request_id"])
    assert kind == "error" and _a_hidden_fault(out["error"]), (kind, out)
    model_id = f"{session}:train:0"
    assert t.get(f"/training_runs/{model_id}").status_code == 404
    assert t.post("/get_info", {"model_id": model_id}).status_code == 404
    assert n.get(f"/runs/{model_id}/curves").status_code == 404
    agree(srv, t, n)
    monkeypatch.undo()
    assert t.create_model(session, seq=0, rank=4) == model_id  # the same id is free again
    agree(srv, t, n)


def test_tinker_load_into_a_new_model_failing_midway_leaves_no_run(srv, wires, monkeypatch):
    t, n = wires
    session = t.session()
    source = t.create_model(session, seq=0, rank=4)
    path = t.done(t.post("/save_weights", {"model_id": source, "path": "ok"}))["path"]
    fail_after(monkeypatch, srv, "load_checkpoint")
    body = {"path": path, "session_id": session, "model_seq_id": 1, "optimizer": False}
    kind, out = t.result(t.ok(t.post("/load_weights", body))["request_id"])
    assert kind == "error" and _a_hidden_fault(out["error"]), (kind, out)
    assert t.get(f"/training_runs/{session}:train:1").status_code == 404
    agree(srv, t, n)
    monkeypatch.undo()
    assert t.done(t.post("/load_weights", body))["model_id"] == f"{session}:train:1"
    agree(srv, t, n)


def test_a_save_failing_midway_lists_no_checkpoint_and_keeps_the_previous(srv, wires, monkeypatch):
    t, n = wires
    model_id = t.create_model(t.session(), rank=4)
    first = t.done(t.post("/save_weights", {"model_id": model_id, "path": "keep"}))["path"]
    be = backend(srv)
    original = be.save_checkpoint

    def half_written(name, folder, training_state):
        original(name, folder, training_state)  # the files are written to the staging folder...
        raise Boom("injected failure after writing the files")  # ...and the save fails before it is recorded

    monkeypatch.setattr(be, "save_checkpoint", half_written)
    for name in ("keep", "fresh"):  # overwriting an existing one, and a new one
        body = {"model_id": model_id, "path": name, "overwrite": True}
        kind, out = t.result(t.ok(t.post("/save_weights", body))["request_id"])
        assert kind == "error" and _a_hidden_fault(out["error"])
    listed = [c["tinker_path"] for c in t.ok(t.get(f"/training_runs/{model_id}/checkpoints"))["checkpoints"]]
    assert listed == [first]
    folder = srv.runtime.data_dir / "tenants" / TENANT / model_id.replace(":", "_") / "weights"
    assert sorted(p.name for p in folder.iterdir()) == ["keep"]  # no staging folder left
    monkeypatch.undo()
    fresh = t.post("/load_weights", {"path": first, "session_id": t.session(), "model_seq_id": 0})
    assert t.done(fresh)["type"] == "load_weights"  # the previous checkpoint still loads
    agree(srv, t, n)


def test_native_adapter_failing_midway_is_not_half_added(srv, wires, monkeypatch):
    t, n = wires
    model_id = n.model()
    fail_after(monkeypatch, srv, "add_lora")
    out = n.wait(n.ok(n.add_adapter(model_id, "a"))["request_id"])
    assert out["status"] == "failed" and _a_hidden_fault(out["error"])
    assert srv.runtime.live.get(model_id) is None
    agree(srv, t, n)
    monkeypatch.undo()
    assert n.done(n.add_adapter(model_id, "a"))["adapter_name"] == "a"  # not "already exists"
    step = n.post(f"/models/{model_id}/forward_backward", {"inputs": {"rows": [native_row()]}})
    assert n.done(step)["loss"] > 0
    fail_after(monkeypatch, srv, "add_lora")  # a second adapter failing leaves the first in place
    out = n.wait(n.ok(n.add_adapter(model_id, "b"))["request_id"])
    assert out["status"] == "failed"
    assert srv.runtime.live.get(model_id) is not None
    agree(srv, t, n)


def test_creations_past_the_per_minute_limits_answer_429_and_leave_nothing(srv):
    from twinkle.hub import TEST_MODEL

    t = Wire(srv.url, srv.create_key("burst"))
    sessions = [t.post("/create_session", {}) for _ in range(4)]
    assert [r.status_code for r in sessions] == [200, 200, 200, 429]
    assert int(sessions[-1].headers["retry-after"]) >= 1 and "sessions created per minute" in sessions[-1].text
    session = sessions[0].json()["session_id"]
    answers = [
        t.post(
            "/create_model",
            {"session_id": session, "model_seq_id": i, "base_model": TEST_MODEL, "lora_config": {"rank": 2}},
        )
        for i in range(3)
    ]
    assert [r.status_code for r in answers] == [200, 200, 429]
    assert "adapters created per minute" in answers[-1].text
    listed = {r["training_run_id"] for r in t.ok(t.get("/training_runs"))["training_runs"]}
    assert listed == {f"{session}:train:0", f"{session}:train:1"}  # the refused one is not listed
    t.close()
    SUMMARY["leftovers: creation paths failed midway, store and maps agree"] = "5 paths, 0 leftovers"


def test_values_the_server_cannot_represent_are_400s_naming_the_field(srv, wires):
    t, n = wires
    model_id = t.create_model(t.session(), rank=4)
    path = t.done(t.post("/save_weights", {"model_id": model_id, "path": "ttl"}))["path"]
    name = path.rsplit("/", 1)[-1]
    r = t.http.put(f"/api/v1/training_runs/{model_id}/checkpoints/weights/{name}/ttl", json={"ttl_seconds": 10**15})
    assert r.status_code == 400 and "ttl_seconds" in r.json()["error"]
    assert t.ok(t.get(f"/training_runs/{model_id}/checkpoints"))["checkpoints"][0]["expires_at"] is None
    r = n.post("/models", {"seed": 2**64})
    assert r.status_code == 422 and r.json()["error"].startswith("seed = 18446744073709551616")
    r = t.post("/optim_step", {"model_id": model_id, "adam_params": {"learning_rate": 10**400}})
    assert r.status_code == 400 and "adam_params.learning_rate" in r.json()["error"]
    r = httpx.post(
        f"{srv.url}/api/v1/get_info",
        content=b"[" * 100_000 + b"]" * 100_000,
        headers={"X-API-Key": t.http.headers["x-api-key"], "content-type": "application/json"},
    )
    assert r.status_code == 400 and "nests deeper" in r.json()["error"]


def test_polling_finished_futures_leaves_no_event(tmp_path):
    """FutureHub keeps an asyncio.Event only while a poll waits: 1,000 finished futures polled twice
    each leave none (before the fix: one per future), and a waiter still wakes when its future finishes."""
    import asyncio

    from twinkle.serve.core.futures import FutureHub
    from twinkle.serve.core.store import Store

    store = Store(tmp_path)
    hub = FutureHub(store)

    async def run():
        hub.bind_loop(asyncio.get_running_loop())
        ids = [hub.create("t") for _ in range(1000)]
        for request_id in ids:
            hub.complete_json(request_id, {"ok": True})
        for request_id in ids * 2:
            assert (await hub.wait(request_id, "t", 1.0)).status == "complete"
        assert await hub.wait("unknown", "t", 0.01) is None
        pending = hub.create("t")
        waiters = [asyncio.create_task(hub.wait(pending, "t", 30.0)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert hub.waiting() == 1  # one Event shared by the three polls
        asyncio.get_running_loop().call_later(0.05, hub.complete_json, pending, {"ok": 1})
        rows = await asyncio.gather(*waiters)
        assert [r.status for r in rows] == ["complete"] * 3

    asyncio.run(run())
    assert hub.waiting() == 0
    store.close()
