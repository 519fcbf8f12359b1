"""What a steady-state Tinker training step (forward_backward + optim_step) costs the store, counted
by its own `Db.writes`. Each request makes a future's row (created and finished), its idempotency
answer and a curve point, forward_backward also its usage and the run's last_request_time; these
are journaled (store/db.py) and committed once per scheduler pass, before the pass's results are
visible: 2 write transactions a step (it was 10 when every row had its own)."""

from __future__ import annotations

from twinkle.hub import TEST_MODEL

SEQS = [[3 + (7 * i + k) % 40 for i in range(9)] for k in range(3)]


STEP_WRITES = 2  # one commit per pass: forward_backward's and optim_step's


def test_a_steady_training_step_writes_no_more_than_measured(server, alice, sft):
    from tinker import types

    tc = alice.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=5).result()
    batch = [sft(s) for s in SEQS]

    def step():
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        return fb.result().metrics["loss:sum"], opt.result().metrics["grad_norm:mean"]

    for _ in range(2):  # warm-up: the run's first records, the adapter's optimizer
        step()
    db = server.runtime.store.db
    before, steps = db.writes, 4
    results = [step() for _ in range(steps)]
    written = db.writes - before
    assert all(g > 0 for _, g in results)
    # + 1: a periodic maintenance write (the futures' prune, or a polled request's retry) may fall in the window
    assert written <= STEP_WRITES * steps + 1, f"{written / steps} SQLite writes per step (was {STEP_WRITES})"
