"""A long training pass run as micro-batches (backend/micro_batches.py) equals the pass run whole, on the
real multi-LoRA engine and the embedded test model: the loss, the per-row log-probs, every LoRA factor's
gradient (fp32, relative to its size), the accumulation window and the metrics, for a token-mean loss
(the native API's configured one), a summed one (Tinker's, given with the pass) and a mean over pairs
(DPO, whose pairs no micro-batch splits); a non-finite loss in
one micro-batch leaves the gradients as before, as whole; a cancel between micro-batches leaves
everything as before the pass."""

from __future__ import annotations

import threading

import pytest
import torch

from twinkle.loss import CrossEntropyLoss
from twinkle.serve.backend import LoraSpec, RowsPass
from twinkle.serve.backend.micro_batches import next_run
from twinkle.serve.core.slices import Cancelled, SlicedJob

LENGTHS = [40, 17, 33, 8, 25, 40, 12, 30]
TURN_S = 0.0  # each micro-batch as short as it gets: one row (or pair) each


def _rows(nan_row: int | None = None) -> list[dict]:
    rows = []
    for r, n in enumerate(LENGTHS):
        ids = [5 + (7 * i + 11 * r) % 700 for i in range(n)]
        labels = [-100] * (r % 3) + ids[r % 3 :]  # some prompt positions unscored: loss tokens differ per row
        weights = [float("nan") if r == nan_row else 1.0 + 0.1 * (r % 4)] * n
        rows.append({"input_ids": ids, "labels": labels, "weights": weights})
    return rows


@pytest.fixture(scope="module")
def backend():
    from twinkle.hub import TEST_MODEL, resolve_model_path
    from twinkle.serve.backend import create_backend

    return create_backend(TEST_MODEL, str(resolve_model_path(TEST_MODEL)), sampler=False)


def _twins(backend, name: str) -> tuple[str, str]:
    """Two adapters with the same (non-zero) factors: one trains whole, the other in micro-batches."""
    pair = (f"{name}-whole", f"{name}-split")
    for adapter in pair:
        backend.create_adapter(adapter, LoraSpec(rank=4, seed=3))
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in backend.engine.adapter_state(adapter).params:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return pair


def _grads(backend, adapter: str) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in backend.engine.adapter_state(adapter).params]


def _assert_grads_equal(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:  # fp32 sums in another order: equal relative to the gradient's size
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))


@pytest.mark.no_float
def test_runs_hold_whole_rows_and_pairs_within_the_budget():
    def runs(budget, group=1):
        out, start = [], 0
        while start < len(LENGTHS):
            out.append((start, stop := next_run(LENGTHS, start, budget, group)))
            start = stop
        return out

    assert runs(0) == [(i, i + 1) for i in range(len(LENGTHS))]  # no budget: one row a run
    assert runs(10_000) == [(0, len(LENGTHS))]
    assert [b - a for a, b in runs(100)] == [2, 3, 2, 1] and all(
        (b - a) * max(LENGTHS[a:b]) <= 100 for a, b in runs(100)
    )
    assert all(a % 2 == 0 and b % 2 == 0 for a, b in runs(80, group=2))  # a preference loss's pairs stay whole
    assert next_run([500, 3], 0, 100) == 1  # a row longer than the budget is a run of its own


@pytest.mark.parametrize("reduction", ["mean", "sum", "pairs"])
def test_micro_batches_equal_the_whole_pass(backend, reduction):
    whole, split = _twins(backend, f"eq-{reduction}")
    loss = None
    if reduction == "sum":  # Tinker: a summed loss sent with the pass
        loss = CrossEntropyLoss(reduction="sum")
    else:  # the native API: the adapter's configured loss, a mean over loss tokens or over pairs
        for adapter in (whole, split):
            backend.configure_adapter(adapter, "loss", "CrossEntropyLoss" if reduction == "mean" else "DPOLoss", {})
    rows = _rows()
    for _ in range(2):  # twice: the second pass accumulates onto the first's gradients
        (a,) = backend.forward_backward_many([RowsPass(whole, rows, False, loss)])
        (b,) = backend.forward_backward_sliced([RowsPass(split, rows, False, loss)], TURN_S)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["loss_tokens"] == a["loss_tokens"] and b["finite"] and a["finite"]
        assert len(b["logprobs"]) == len(rows)
        for got, want in zip(b["logprobs"], a["logprobs"]):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    _assert_grads_equal(_grads(backend, split), _grads(backend, whole))
    sw, ss = backend.engine.adapter_state(whole), backend.engine.adapter_state(split)
    assert (ss.micro_step, ss.consumed_batches) == (sw.micro_step, sw.consumed_batches) == (2, 2)
    mw, ms = backend.calculate_metric(whole, True), backend.calculate_metric(split, True)
    for key in ("loss", "accuracy"):
        if key in mw:
            assert ms[key] == pytest.approx(mw[key], rel=1e-5), (key, mw, ms)
    # forward-only passes split too
    (fa,) = backend.forward_backward_many([RowsPass(whole, rows, True, loss)])
    (fb,) = backend.forward_backward_sliced([RowsPass(split, rows, True, loss)], TURN_S)
    assert fb["loss"] == pytest.approx(fa["loss"], rel=1e-5)


def test_a_non_finite_micro_batch_discards_the_whole_pass_as_whole_does(backend):
    whole, split = _twins(backend, "nan")
    loss = CrossEntropyLoss(reduction="sum")
    backend.forward_backward_many([RowsPass(whole, _rows(), False, loss)])
    backend.forward_backward_sliced([RowsPass(split, _rows(), False, loss)], TURN_S)
    before = _grads(backend, split)
    bad = _rows(nan_row=len(LENGTHS) - 1)  # only the last micro-batch is non-finite
    (a,) = backend.forward_backward_many([RowsPass(whole, bad, False, loss)])
    (b,) = backend.forward_backward_sliced([RowsPass(split, bad, False, loss)], TURN_S)
    assert not a["finite"] and not b["finite"]
    _assert_grads_equal(_grads(backend, split), before)
    _assert_grads_equal(_grads(backend, split), _grads(backend, whole))
    sw, ss = backend.engine.adapter_state(whole), backend.engine.adapter_state(split)
    assert (ss.micro_step, ss.nonfinite_pending) == (sw.micro_step, sw.nonfinite_pending) == (2, True)


def test_a_cancel_between_micro_batches_leaves_the_adapter_as_before(backend):
    (adapter, _) = _twins(backend, "cancel")
    loss = CrossEntropyLoss(reduction="sum")
    backend.forward_backward_many([RowsPass(adapter, _rows(), False, loss)])
    before, state = _grads(backend, adapter), backend.engine.adapter_state(adapter)
    counters = (state.micro_step, state.consumed_batches)
    paused = threading.Event()

    def pause(job, elapsed):  # hand back at the first boundary between micro-batches: the test cancels it there
        if not job.steps:  # the points inside the first micro-batch's pass (twinkle.model.preemption)
            return False
        paused.set()
        return True

    job = SlicedJob(
        lambda: backend.forward_backward_sliced([RowsPass(adapter, _rows(), False, loss)], TURN_S), "t", pause
    )
    assert not job.turn() and paused.is_set()  # one micro-batch ran, then it paused
    job.cancel("cancelled by the client")
    assert job.turn()
    with pytest.raises(Cancelled, match="stopped after 1 step"):
        job.outcome()
    _assert_grads_equal(_grads(backend, adapter), before)
    assert (state.micro_step, state.consumed_batches) == counters


@pytest.mark.parametrize("at", ["forward", "backward"])
def test_a_cancel_inside_one_rows_pass_leaves_the_adapter_as_before(backend, at):
    """One row is one pass no micro-batch can cut: it pauses at points inside its forward and backward
    (decoder layers, attention chunks); cancelled there, it leaves the adapter as before."""
    (adapter, _) = _twins(backend, f"inside-{at}")
    loss = CrossEntropyLoss(reduction="sum")
    (row,) = _rows()[:1]
    backend.forward_backward_many([RowsPass(adapter, [row], False, loss)])
    before, state = _grads(backend, adapter), backend.engine.adapter_state(adapter)
    counters = (state.micro_step, state.consumed_batches)
    seen = []

    def pause(job, elapsed):  # the first point in forward (grad on) or in backward (grad off)
        seen.append(torch.is_grad_enabled())
        return seen[-1] == (at == "forward")

    job = SlicedJob(
        lambda: backend.forward_backward_sliced([RowsPass(adapter, [row], False, loss)], TURN_S), "t", pause
    )
    assert not job.turn()
    job.cancel("cancelled by the client")
    assert job.turn()
    with pytest.raises(Cancelled, match="stopped after 0 steps"):
        job.outcome()
    assert (False in seen) == (at == "backward")
    _assert_grads_equal(_grads(backend, adapter), before)
    assert (state.micro_step, state.consumed_batches) == counters
    assert not backend.engine.residency.in_use
