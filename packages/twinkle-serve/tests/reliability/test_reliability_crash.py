"""Crash: the load of test_reliability_load (8 tenants, 4 through the Tinker SDK and 4 through the
native client, 100 steps each, sampling half-way) with a checkpoint every few steps, while the real
server is `kill -9`ed at 10 seeded random points of that load and restarted on the same data dir.
Tenants carry on as a user would: poll what was in flight, then resume from their last acknowledged
checkpoint (weights and optimizer state) and replay the steps after it. Checked:

- the SQLite database passes `PRAGMA integrity_check` after every kill;
- after every restart, every checkpoint acknowledged so far is byte-identical on disk and every
  training run ever created is still listed; each resume loads its checkpoint bit-exact (weights and
  optimizer state saved right after the load equal the checkpoint's), and at the end every
  acknowledged checkpoint loads bit-exact;
- every future in flight at a kill answers, after the restart, either its completed result (a loss
  equal to the one the tenant trained alone got at that step, a checkpoint that is really there) or a
  clear error saying the server restarted -- never a silently wrong result, never an endless wait;
- nothing is lost or reordered across the kills: each tenant's 100 losses and final adapter equal,
  within 1e-5, the same tenant trained alone on a fresh server.
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading
import time
import traceback

import httpx
import numpy as np
import pytest
from _load_tenants import (
    STEPS,
    TENANTS,
    Ack,
    NativeClient,
    TenantRun,
    adapter_diff,
    alone_reference,
    bit_equal,
    checkpoint_tensors,
    files_digest,
    folder_of,
    loss_tolerance,
)
from harness import SUMMARY, Wire

KILLS = int(os.environ.get("RELIABILITY_KILLS", "10"))
CHECKPOINT_EVERY = 5
SEED = 1129


class Generation:
    """Counts kills and server restarts; a tenant that lost the server waits here for the next one."""

    def __init__(self):
        self.n, self.kills, self._cond = 0, 0, threading.Condition()

    def bump(self) -> None:
        with self._cond:
            self.n += 1
            self._cond.notify_all()

    def wait_past(self, n: int, timeout: float = 300) -> int:
        with self._cond:
            assert self._cond.wait_for(lambda: self.n > n, timeout), "the server did not come back"
            return self.n


def went_away(e: Exception) -> bool:
    """The connection failed: the server is down (the native client gave up after its few retries)."""
    import tinker

    return isinstance(e, (httpx.TransportError, tinker.APIConnectionError))


def says_restarted(e: Exception) -> bool:
    """The clear error a request caught by a restart gets (in flight: server category; sent to a model
    the restart unloaded: user category, "resume it")."""
    import tinker

    from twinkle.client import TwinkleRequestFailed

    return isinstance(e, (tinker.RequestFailedError, TwinkleRequestFailed)) and "restarted" in str(e)


def lost_model_error(e: Exception) -> bool:
    """What the native API answers a call that reached the restarted server for a model the restart
    unloaded (the client library re-sends a call whose connection broke): a user error saying so."""
    from twinkle.client import TwinkleRequestFailed

    return (
        isinstance(e, TwinkleRequestFailed)
        and e.category == "user"
        and "server restarted" in str(e)
        and "no adapter in this server process" in str(e)
    )


class Survivor:
    """One tenant's thread through every kill: train, and on losing the server wait for it, poll
    what was in flight, resume from the last acknowledged checkpoint, and go on."""

    def __init__(self, run: TenantRun, alone: TenantRun, tol: float, gen: Generation):
        self.run, self.alone, self.tol, self.gen = run, alone, tol, gen
        self.live_gen = -1  # the generation this tenant resumed in (the driver kills only once all have)
        self.finished, self.error = False, None
        self.in_flight = {"completed": 0, "failed clearly": 0, "never sent": 0}
        self.resent = 0  # calls re-sent to the restarted server, answered with lost_model_error
        self.resumes_verified = 0
        self.thread = threading.Thread(target=self.main, daemon=True, name=run.name)

    def main(self) -> None:
        gen = self.gen.n
        try:
            while True:
                kills = self.gen.kills
                try:
                    resume = self.run.open()
                    if resume is not None:
                        self.verify_resume(resume)
                    self.live_gen = gen
                    self.run.run()
                    self.finished = True
                    return
                except Exception as e:
                    if self.gen.kills == kills or not (went_away(e) or says_restarted(e) or lost_model_error(e)):
                        raise  # no kill since this model was opened, or an error that hides what happened
                gen = self.gen.wait_past(gen)
                self.poll_in_flight()
        except Exception as e:
            self.error = f"{self.run.name}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        finally:
            self.run.progress.set()

    def verify_resume(self, resume: Ack) -> None:
        """Weights and optimizer state right after the load equal the checkpoint's, bit for bit."""
        api = self.run.api
        path = api.result("save", api.submit_save(f"resumed-{len(self.run.model_ids)}"))
        again = folder_of(self.run.data_dir, self.run.name, path)
        assert bit_equal(checkpoint_tensors(resume.folder), checkpoint_tensors(again)), (resume.path, path)
        self.resumes_verified += 1

    def poll_in_flight(self) -> None:
        """Every future still pending from before the kill: its true result or a clear error."""
        run = self.run
        while run.pending:
            item = run.pending.popleft()
            try:
                value = run.api.result(item.kind, item.future)
            except Exception as e:
                if went_away(e):  # the SDK could not send it at all: the caller was told so
                    self.in_flight["never sent"] += 1
                    continue
                if lost_model_error(e):
                    self.resent += 1
                    continue
                assert says_restarted(e), (run.name, item.kind, item.step, repr(e))  # noqa: PT017 - sorting a run's outcomes
                self.in_flight["failed clearly"] += 1
                continue
            if item.kind == "forward_backward":  # a completed result must be the right one
                assert abs(value - self.alone.losses[item.step]) <= self.tol, (run.name, item.step, value)
            run.accept(item, value, progress=False)  # a completed save is checked on disk there
            self.in_flight["completed"] += 1


def integrity_ok(data_dir) -> bool:
    db = sqlite3.connect(data_dir / "twinkle.db")
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()


def check_after_restart(srv, keys, survivors) -> int:
    """Every acknowledged checkpoint byte-identical, every run listed (by the Tinker and the native API);
    returns the checkpoints checked."""
    checked = 0
    for s in survivors:
        for ack in list(s.run.acked):
            assert files_digest(ack.folder) == ack.digest, ack.path
            checked += 1
        w = Wire(srv.url, keys[s.run.name])
        listed = {r["training_run_id"] for r in w.ok(w.get("/training_runs", params={"limit": 1000}))["training_runs"]}
        assert set(s.run.model_ids) <= listed, (s.run.name, set(s.run.model_ids) - listed)
        api = {r["model_id"]: r["api"] for r in w.ok(w.http.get("/twinkle/v1/runs", params={"limit": 1000}))["runs"]}
        w.close()
        want = "native" if s.run.kind == "native" else "tinker"
        assert all(api.get(m) == want for m in s.run.model_ids), (s.run.name, want, api)  # and in the native list
    return checked


def reload_every_checkpoint(run: TenantRun) -> int:
    """Load each acknowledged checkpoint into a fresh model and save it again: bit-exact, all of them."""
    api = run.api
    api.open(None)
    pairs = [(ack, api.load(ack.path), api.submit_save(f"reload-{i}")) for i, ack in enumerate(run.acked)]
    for ack, load, save in pairs:
        api.result("load", load)
        again = folder_of(run.data_dir, run.name, api.result("save", save))
        assert bit_equal(checkpoint_tensors(ack.folder), checkpoint_tensors(again)), ack.path
    return len(pairs)


def test_kill9_during_load_loses_nothing_acknowledged(launch):
    alone, _ = alone_reference(launch)
    tol = loss_tolerance(alone)
    names = [name for name, _ in TENANTS]
    srv, keys = launch(names, long_poll_s=2.0, limits={"max_models": 64})
    gen = Generation()
    survivors = [
        Survivor(TenantRun(name, i, kind, srv.url, keys[name], srv.data_dir, CHECKPOINT_EVERY), alone[name], tol, gen)
        for i, (name, kind) in enumerate(TENANTS)
    ]
    for s in survivors:
        s.thread.start()
    # The kill moments, as points of the load's progress (steps answered, all tenants together, counted
    # from each one's last checkpoint): seeded, random, and all before the load can end, whatever the
    # machine's speed.
    total = len(TENANTS) * STEPS
    kill_at = sorted(random.Random(SEED).sample(range(total // 20, total * 9 // 10), KILLS))
    moments, busy, restarts, digests_checked = [], [], [], 0
    t_start = time.perf_counter()
    for kill in range(KILLS):
        # every tenant still training has resumed on this server and answered a step; the load is there
        deadline, resumed = time.monotonic() + 300, None
        while (
            any(
                not (s.finished or s.error) and not (s.live_gen == gen.n and s.run.progress.is_set()) for s in survivors
            )
            or sum(s.run.steps_done for s in survivors) < kill_at[kill]
        ):
            assert not [s.error for s in survivors if s.error], [s.error for s in survivors if s.error]
            assert time.monotonic() < deadline, f"the load made no progress after restart {kill}"
            if resumed is None and all(s.finished or s.live_gen == gen.n for s in survivors):
                resumed = time.monotonic()
            time.sleep(0.01)
        moment = time.monotonic() - resumed if resumed is not None else 0.0
        training = sum(not s.finished for s in survivors)
        assert training, f"the load ended before kill {kill + 1}"
        srv.kill9()
        gen.kills += 1
        moments.append(moment)
        busy.append(training)
        for s in survivors:
            s.run.progress.clear()
        assert integrity_ok(srv.data_dir), f"integrity_check failed after kill {kill + 1}"
        t0 = time.monotonic()
        srv.start()
        restarts.append(time.monotonic() - t0)
        digests_checked += check_after_restart(srv, keys, survivors)
        gen.bump()
    for s in survivors:
        s.thread.join(timeout=600)
    assert not any(s.thread.is_alive() for s in survivors), "a tenant did not finish within 600 s"
    assert not [s.error for s in survivors if s.error], [s.error for s in survivors if s.error]
    wall = time.perf_counter() - t_start

    worst_loss, worst_weight, reloaded = 0.0, 0.0, 0
    for s in survivors:
        run, ref = s.run, s.alone
        assert s.finished and sorted(run.losses) == list(range(STEPS)), run.name  # every step answered
        worst_loss = max(worst_loss, max(abs(v - ref.losses[step]) for step, v in run.loss_log))
        worst_weight = max(worst_weight, adapter_diff(run.final.folder, ref.final.folder))
        reloaded += reload_every_checkpoint(run)
        run.api.close()
    digests_checked += check_after_restart(srv, keys, survivors)
    assert integrity_ok(srv.data_dir)
    assert worst_loss <= tol, worst_loss  # no answer, in flight or replayed, carried a wrong loss
    assert worst_weight <= 1e-5, worst_weight  # nothing lost or reordered across the kills

    in_flight = {k: sum(s.in_flight[k] for s in survivors) for k in survivors[0].in_flight}
    acked = sum(len(s.run.acked) for s in survivors)
    resumes = sum(s.resumes_verified for s in survivors)
    runs = sum(len(s.run.model_ids) for s in survivors)
    resent = sum(s.resent for s in survivors)
    print(
        f"\ncrash: {KILLS} kill -9 at seeded points of the load {kill_at} (steps answered of {total}), "
        f"{[round(m, 2) for m in moments]} s after all tenants resumed "
        f"(tenants still training at each kill: {busy}); {len(TENANTS)} tenants x {STEPS} steps done in "
        f"{wall:.0f} s; "
        f"integrity_check ok x{KILLS + 1}; {acked} acknowledged checkpoints, byte-identical at every restart "
        f"({digests_checked} checks), {reloaded} reloaded bit-exact at the end, {resumes} resumes bit-exact; "
        f"{runs} runs all listed; in-flight futures after restart: {in_flight}; native calls re-sent to the "
        f"restarted server and refused: {resent}; max |loss - alone| "
        f"{worst_loss:.1e}, max |final adapter - alone| {worst_weight:.1e}; restart-to-ready "
        f"{np.median(restarts):.1f} s median"
    )
    SUMMARY["kills survived (kill -9 during load, restart)"] = (
        f"{KILLS}; {acked} acked checkpoints intact and reloaded bit-exact, "
        f"{in_flight['completed'] + in_flight['failed clearly']} in-flight futures answered "
        f"({in_flight['completed']} right result, {in_flight['failed clearly']} clear error); "
        f"final adapters vs alone {worst_weight:.1e}"
    )


def test_native_call_after_restart_says_so(launch):
    """A native call that reaches the restarted server for a model the restart unloaded fails, and
    says why (the Tinker routes do: "... is not loaded (its session finished or the server restarted)")."""
    from twinkle.client import TwinkleRequestFailed

    srv, keys = launch(["lost0"])
    api = NativeClient(srv.url, keys["lost0"], 0)
    api.open(None)
    fb, step = api.submit_step(0)
    api.result("optim_step", step)
    srv.kill9()
    srv.start()
    fb, step = api.submit_step(1)
    with pytest.raises(TwinkleRequestFailed) as failed:
        api.result("forward_backward", fb)
    api.close()
    assert lost_model_error(failed.value), str(failed.value)
