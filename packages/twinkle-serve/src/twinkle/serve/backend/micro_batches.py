"""One long training pass as micro-batches that other tenants' work runs between.

A long pass is cut into contiguous runs of rows (a row is never cut, nor a preference loss's pair),
each sized to take about `turn_s` at the speed the previous run went (the first is one row or pair),
with a step boundary (twinkle.serve.core.slices) between two runs, where the scheduler may serve
other work or stop a cancelled request. Sized by time, not tokens: another tenant's request arriving
just after a run began waits about one turn on any machine, however busy, and a fast device still
runs big micro-batches. A run after a boundary where nothing else was waiting is twice as long as
the last (at most MAX_TURNS turns): alone, a pass pays little for being cut; after another tenant's
turn, it starts again at one turn (that tenant's next request is likely on its way).

The runs add up to the one pass as data-parallel ranks' shares do (twinkle.model.multi_lora.
data_parallel, with the same record merge, `strategy.merge_records`): a summed loss is the runs' sum;
a mean loss is scaled in each run by the run's share of its units (`Loss.units`: loss tokens, or
pairs); gradients accumulate in place; the adapter's accumulation window counts the pass once and its
metrics see one record of the whole pass. A failure, a cancel or a non-finite loss in any run leaves
the gradients as they were before the pass. A run of one row still pauses inside its forward and
backward when it is long (twinkle.model.preemption), releasing the engine lock while it waits.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol

from twinkle.metric import ForwardRecord
from twinkle.model.strategy import RankRecord, merge_records
from twinkle.serve.backend.base import RowsPass
from twinkle.serve.core import slices


class EngineBackend(Protocol):
    """The in-process backend whose engine runs the pieces (MultiLoraBackend): what this module uses of it."""

    engine: Any  # a twinkle.model.multi_lora.MultiLoraModel

    @property
    def engine_lock(self) -> Any: ...

    def forward_backward_many(self, passes: list[RowsPass], loss_weights: dict[str, float] | None = None) -> list: ...


MAX_TURNS = 8


def next_run(lengths: list[int], start: int, budget: float, group: int = 1) -> int:
    """The end of the run of rows from `start`: whole groups of `group` rows (2: a preference loss's
    pairs) while the run's rows x its longest row stays within `budget` padded tokens; one group at least."""
    stop, longest = min(start + group, len(lengths)), max(lengths[start : start + group])
    while stop < len(lengths):
        end = min(stop + group, len(lengths))
        widest = max(longest, *lengths[stop:end])
        if (end - start) * widest > budget:
            break
        stop, longest = end, widest
    return stop


class _Records:
    """Stands in for an adapter's metrics while its pass runs in pieces: keeps each piece's record."""

    def __init__(self):
        self.records: list[ForwardRecord] = []

    def on_forward(self, record: ForwardRecord) -> None:
        self.records.append(record)


def _units(loss, rows: list[dict], pad_id: int) -> float:
    """The rows' loss units (`Loss.units`), from their shifted targets and loss inputs."""
    from twinkle.model.multi_lora.batch import collate

    batch = collate(rows, pad_id)
    fields = batch.shifted_fields()
    return loss.units(batch.labels_B_T[:, 1:], fields)


class _Failed(Exception):
    def __init__(self, outcome: Exception):
        self.outcome = outcome


def forward_backward_in_runs(backend: EngineBackend, item: RowsPass, turn_s: float) -> list:
    """`backend.forward_backward_many([item])`, run as micro-batches of about `turn_s` each (longer while
    nothing else waits)."""
    engine, lock = backend.engine, backend.engine_lock  # held for each piece, never across a pause
    lengths = [len(r["input_ids"]) for r in item.rows]
    with lock:
        state = engine.adapter_state(item.adapter) if item.adapter in engine.adapters else None
        loss = item.loss if item.loss is not None else getattr(state, "loss", None)
        group = 2 if getattr(loss, "unit", "token") == "pair" else 1
        # an embedding pass's rows are each other's negatives: cut, its loss would be another
        if state is None or loss is None or len(lengths) <= group or item.task != "causal_lm":
            return _whole(backend, item, state)
        train = not item.forward_only
        try:
            total = _units(loss, item.rows, engine.pad_id)
        except (ValueError, KeyError, TypeError):  # rows the pass refuses: it fails whole, in its own words
            return backend.forward_backward_many([item])
        saved = state.snapshot() if train else None
        kept = state.train_metrics, state.eval_metrics
        records = _Records()
        state.train_metrics = state.eval_metrics = [records]
    outcomes, parts, start, budget, target = [], [], 0, 0.0, turn_s  # budget 0: the first run is one group
    try:
        while start < len(lengths):
            if start:  # other tenants' work may run here; a cancel stops the pass here
                target = turn_s if slices.step() else min(2 * target, MAX_TURNS * turn_s)
            stop = next_run(lengths, start, budget * target, group)
            rows = item.rows[start:stop]
            units = _units(loss, rows, engine.pad_id)
            weights = {item.adapter: units / total if total else 1.0} if train and loss.reduction == "mean" else None
            part = replace(item, rows=rows, loss=None if item.loss is None else loss.sliced(start, stop))
            began = time.perf_counter()
            (outcome,) = backend.forward_backward_many([part], weights)
            if isinstance(outcome, Exception):
                raise _Failed(outcome)
            padded = (stop - start) * max(lengths[start:stop])
            budget = padded / max(time.perf_counter() - began, 1e-6)  # padded tokens a second, then a run's worth
            outcomes.append(outcome)
            parts.append((stop - start, units))
            start = stop
    except BaseException as e:
        with lock:
            if saved is not None:
                engine.adapter_state(item.adapter).restore(saved)  # as if the pass never ran
            state.train_metrics, state.eval_metrics = kept
        if isinstance(e, _Failed):
            return [e.outcome]
        raise
    with lock:
        state.train_metrics, state.eval_metrics = kept
        ranked = [RankRecord(r, n, u) for r, (n, u) in zip(records.records, parts)]
        return [_merged(backend, state, loss, train, saved, outcomes, ranked)]


def _whole(backend: EngineBackend, item: RowsPass, state) -> list:
    """One pass that cannot be cut into runs (one row, one pair): it still pauses inside its forward and
    backward (twinkle.model.preemption); a cancel there leaves the gradients as before the pass."""
    saved = state.snapshot() if state is not None and not item.forward_only else None
    try:
        return backend.forward_backward_many([item])
    except BaseException:
        if saved is not None:
            with backend.engine_lock:
                backend.engine.adapter_state(item.adapter).restore(saved)
        raise


def _merged(
    backend: EngineBackend, state, loss, train: bool, saved, outcomes: list[dict], parts: list[RankRecord]
) -> dict:
    """The runs' outcomes as the one pass's: its loss, metrics, per-row log-probs; the adapter's window
    and metrics as after one pass."""
    record = merge_records(parts, loss)
    record.seconds = sum(p.record.seconds for p in parts)  # one after another, not side by side as ranks
    if train:
        if not record.finite:  # the whole pass never back-propagates, as unsplit
            state.discard_pass(saved)
        state.count_pass(saved, record.finite)
    for metric in state.metrics(train):
        metric.on_forward(record)
    out = {
        "loss": record.loss,
        "loss_tokens": record.loss_tokens,
        "finite": record.finite,
        "metrics": dict(record.extras),
        "logprobs": [lp for o in outcomes for lp in o.get("logprobs", [])],
    }
    peak = backend.engine.peak_flops
    if record.seconds > 0 and peak:
        out["mfu"] = record.flops / record.seconds / peak
    return out
