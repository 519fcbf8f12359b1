"""MultiLoraModel over data-parallel ranks: torchrun's ranks, or the server's Ray group (one actor a rank).

With a DeviceMesh of more than one data rank (by default the global mesh: torchrun's world, or the
group's inside a Ray actor) every fused pass is the ranks' shares of one global pass. Every rank calls
with the same tenants; a rank's share of a tenant's rows may be empty. What makes the ranks equal one
process on the whole batch (TransformersModel gets the same from DDP and `strategy.data_parallel_loss`):

- before the forward, each training tenant's loss units on this rank (`Loss.units`: loss tokens, or pairs
  for a preference loss) go into one all-reduce for the pass, and a 'mean' loss is scaled by this rank's
  share of them (`strategy.data_parallel_weights`); a summed loss is not scaled;
- after the pass, one exchange of what each rank saw (an error, each tenant's ForwardRecord and units),
  and every rank takes the same decision: a tenant that failed on any rank fails on all (gradients and
  accumulation window as before the pass, every rank answering with the failing rank's message); a
  non-finite loss on any rank skips the window's step everywhere; the tenant's metrics see the record of
  the whole pass (`strategy.merge_records`) and the answer carries its numbers;
- a rank without rows of a tenant still counts the micro-batch and holds zero gradients for it, so the
  ranks agree whether a step has anything to do;
- on an accumulation boundary a tenant's gradients are summed over the ranks (`strategy.sum_gradients`)
  before the clip: DDP's sync, taken at step time because adapters come and go (DDP wraps a fixed set).
  A custom loss's `backward` is averaged over the ranks, as under DDP.

Only dp is implemented: a mesh with fsdp, tp, cp, pp or ep above 1 is refused at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from twinkle.metric import ForwardRecord, Metric
from twinkle.model.multi_lora.batch import collate
from twinkle.model.state import AdapterState
from twinkle.model.strategy import RankRecord, data_parallel_size, data_parallel_weights, merge_records, sum_gradients

UNIMPLEMENTED_DIMS = {"fsdp": "TransformersModel", "tp": "TransformersModel", "cp": "TransformersModel"}
UNIMPLEMENTED_DIMS |= {"pp": "MegatronModel", "ep": "MegatronModel"}
# (batches, train, return_logprobs, weights, losses) -> {tenant: outcome or exception}: the engine's own pass
LocalPass = Callable[[dict, bool, bool, dict, dict], dict]


class PeerFailed(ValueError):
    """This rank's share of a tenant's pass went through but another rank's failed: it fails on every rank."""


@dataclass
class _Seen:
    """What one rank saw of one tenant's pass."""

    error: str | None
    record: ForwardRecord | None  # None: no rows here, or the pass failed
    rows: int
    units: float


class _Recorder(Metric):
    """Stands in for a tenant's metrics during this rank's pass: keeps its record for the exchange."""

    record: ForwardRecord | None = None

    def on_forward(self, record: ForwardRecord) -> None:
        self.record = record

    def compute(self) -> dict[str, float]:
        return {}


def _rows(inputs) -> int:
    """Rows of a tenant's inputs (a list of rows, or a dict of [B, T] tensors)."""
    return len(inputs.get("input_ids", ())) if isinstance(inputs, dict) else len(inputs)


@contextmanager
def _recording(states: list[AdapterState], train: bool) -> Generator[dict[str, _Recorder]]:
    recorders = {s.name: _Recorder() for s in states}
    kept = {s.name: (s.train_metrics, s.eval_metrics) for s in states}
    for s in states:
        if train:
            s.train_metrics = [recorders[s.name]]
        else:
            s.eval_metrics = [recorders[s.name]]
    try:
        yield recorders
    finally:
        for s in states:
            s.train_metrics, s.eval_metrics = kept[s.name]


class DataParallel:
    """A MultiLoraModel's data ranks (the module docstring); with one rank a pass runs as it is."""

    def __init__(self, mesh):
        for dim, engine in UNIMPLEMENTED_DIMS.items():
            if mesh is not None and mesh.get_size(dim) > 1:
                raise ValueError(
                    f"MultiLoraModel implements data parallelism (dp) only; {mesh!r} has {dim}_size="
                    f"{mesh.get_size(dim)}: give those ranks to dp, or use {engine} for {dim}"
                )
        self.mesh = mesh

    @property
    def world(self) -> int:
        return data_parallel_size(self.mesh)

    @property
    def group(self):
        return self.mesh.get_group("data")

    # ---- passes ---------------------------------------------------------------------------------
    def run(
        self,
        adapters: dict[str, AdapterState],
        pad_id: int,
        local: LocalPass,
        batches: dict,
        train: bool,
        return_logprobs: bool,
        weights: dict[str, float],
        losses: dict,
    ) -> dict:
        """`local(batches, train, return_logprobs, weights, losses)` as this rank's share of the global pass."""
        if self.world == 1:
            return local(batches, train, return_logprobs, weights, losses)
        names = sorted(batches)  # every rank's order
        units = {n: self._units(adapters.get(n), losses.get(n), batches[n], pad_id) for n in names}
        if train:
            weights = self._weights(adapters, names, units, weights, losses)
        states = [adapters[n] for n in names if n in adapters]
        saved = {s.name: s.snapshot() for s in states} if train else {}
        live = {n: batches[n] for n in names if _rows(batches[n])}
        failure = None
        with _recording(states, train) as recorders:
            try:
                outcomes = local(live, train, return_logprobs, weights, losses) if live else {}
            except Exception as error:  # the other ranks still wait for this rank's part of the exchange
                failure, outcomes = error, dict.fromkeys(live, error)
        mine = {n: self._seen(outcomes.get(n), recorders.get(n), batches[n], units[n]) for n in names}
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        for n in names:
            seen = [rank[n] for rank in everyone]
            answer = self._agree(adapters.get(n), losses.get(n), seen, outcomes.get(n), saved.get(n), train)
            if return_logprobs and isinstance(answer, dict):
                answer.setdefault("logprobs", [])  # an empty share adds no rows
            outcomes[n] = answer
        if failure is not None:
            raise failure
        return outcomes

    @staticmethod
    def _units(state: AdapterState | None, loss, inputs, pad_id: int) -> float:
        if state is None or not _rows(inputs):
            return 0.0
        try:
            batch = collate(inputs, pad_id)
        except (ValueError, KeyError, TypeError):
            return 0.0  # the pass refuses these rows, and so fails on every rank
        fields = batch.shifted_fields()
        return (loss or state.loss).units(batch.labels_B_T[:, 1:], fields)

    def _weights(self, adapters, names: list[str], units: dict, weights: dict, losses: dict) -> dict[str, float]:
        """The given loss weights times each 'mean' loss's share of its global units (one all-reduce)."""
        shares = data_parallel_weights([units[n] for n in names], self.group)
        out = dict(weights)
        for name, share in zip(names, shares):
            state = adapters.get(name)
            if state is not None and losses.get(name, state.loss).reduction == "mean":
                out[name] = out.get(name, 1.0) * share
        return out

    @staticmethod
    def _seen(outcome, recorder: _Recorder | None, inputs, units: float) -> _Seen:
        if isinstance(outcome, Exception):
            return _Seen(str(outcome), None, 0, 0.0)
        record = recorder.record if recorder is not None and outcome is not None else None
        return _Seen(None, record, _rows(inputs), units)

    @staticmethod
    def _agree(state: AdapterState | None, loss, seen: list[_Seen], outcome, saved, train: bool):
        """This rank's answer for a tenant, and its state, as every rank decides them from what all saw."""
        errors = [s.error for s in seen if s.error is not None]
        parts = [RankRecord(s.record, s.rows, s.units) for s in seen if s.record is not None]
        if state is None or errors or not parts:
            if train and state is not None and saved is not None:
                state.restore(saved)  # as if the pass never ran
            if isinstance(outcome, Exception):
                return outcome
            return PeerFailed(errors[0] if errors else "no rows on any data rank")
        merged = merge_records(parts, loss or state.loss)
        if train:
            if not merged.finite:
                state.restore(saved, counters=False)  # never back-propagated, on any rank
            elif outcome is None:  # no rows here: zero gradients, so every rank has the same to sum
                for p in state.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            state.count_pass(saved, merged.finite)
        for metric in state.metrics(train):
            metric.on_forward(merged)
        numbers = {"loss": merged.loss, "loss_tokens": merged.loss_tokens, "finite": merged.finite}
        return {**(outcome or {}), **numbers, "metrics": dict(merged.extras)}

    # ---- steps and checkpoints ----------------------------------------------------------------------
    def sync_gradients(self, state: AdapterState) -> None:
        """On an accumulation boundary, the tenant's gradients summed over the data ranks."""
        if self.world > 1 and state.at_boundary:
            sum_gradients(state.params, self.group)

    @property
    def backward_scale(self) -> float:
        """A custom loss's gradient is averaged over the ranks at the step's sum, as DDP averages."""
        return 1.0 / self.world

    @contextmanager
    def one_writer(self) -> Generator[bool]:
        """The ranks hold the same adapter: data rank 0 writes a checkpoint, and every rank waits for it."""
        if self.world == 1:
            yield True
            return
        try:
            yield self.mesh.data_rank == 0
        finally:
            dist.barrier(group=self.group)
