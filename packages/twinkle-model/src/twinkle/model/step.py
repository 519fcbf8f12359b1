"""The step rule every engine shares: on an accumulation boundary clip, step the optimizer and the
scheduler, clear the gradients, and report; a non-finite loss in the window or a non-finite gradient
norm skips the step (weights, optimizer and scheduler untouched, `skipped_steps` grows). Engines
differ only in how a pass is computed and how a gradient norm is taken over their parameters (one
process, DDP, FSDP2 or tensor-parallel shards), which they pass in as `clip`."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import torch

from twinkle.metric import StepRecord, ThroughputMetric
from twinkle.model.state import AdapterState

logger = logging.getLogger("twinkle.model")

# (parameters that have gradients, max norm) -> the gradient norm before clipping
Clip = Callable[[Sequence[torch.nn.Parameter], float], float]


def clip_local(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """One process's parameters: one foreach call over all factors instead of a loop per tensor."""
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))


def clip_grad_and_step(state: AdapterState, max_grad_norm: float | None, clip: Clip = clip_local) -> dict:
    optimizer = state.require_optimizer()
    if not state.at_boundary:
        return {"stepped": False, "accumulated": state.micro_step}
    t0 = time.perf_counter()
    scaler = state.grad_scaler
    grads = [p for p in state.params if p.grad is not None]
    if scaler is not None and grads and not state.nonfinite_pending:
        scaler.unscale_(optimizer)  # clip the true gradients; an overflow shows as a non-finite norm
    grad_norm = None
    if grads and not state.nonfinite_pending:
        grad_norm = clip(grads, float("inf") if max_grad_norm is None else max_grad_norm)
    skipped = grad_norm is None or not math.isfinite(grad_norm)
    if not skipped:
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
        if state.scheduler is not None:
            state.scheduler.step()
    if scaler is not None and grads and not state.nonfinite_pending:
        scaler.update()  # a skipped (overflowing) step lowers the scale
    for p in state.params:
        p.grad = None
    return finish_step(state, grad_norm, skipped, t0)


def finish_step(
    state: AdapterState, grad_norm: float | None, skipped: bool, t0: float, lr: float | None = None
) -> dict:
    """The bookkeeping after a boundary, for an engine whose optimizer clips and steps in one call
    (Megatron's): counters reset, the step recorded in the metrics, the result every engine returns."""
    state.micro_step, state.nonfinite_pending = 0, False
    if not skipped:
        state.optimizer_steps += 1
    lr = state.lr() if lr is None else lr
    record = StepRecord(None if skipped else grad_norm, lr, skipped, time.perf_counter() - t0)
    for metric in state.train_metrics:
        metric.on_step(record)
    if logger.isEnabledFor(logging.INFO):
        throughput = next((m for m in state.train_metrics if isinstance(m, ThroughputMetric)), None)
        if throughput is not None:
            logger.info("adapter %r step %d: %s", state.name, state.optimizer_steps, throughput.compute())
    return {"stepped": not skipped, "skipped": skipped, "grad_norm": grad_norm, "lr": lr, "step": state.optimizer_steps}


def calculate_metric(state: AdapterState, is_training: bool) -> dict[str, float]:
    """The adapter's metrics since the last call (then reset): loss, token_accuracy, grad_norm, lr,
    tokens_per_s, mfu, skipped_steps, and the loss's own."""
    out: dict[str, float] = {}
    for metric in state.metrics(is_training):
        out.update(metric.compute())
        metric.reset()
    if is_training:
        out["step"] = float(state.optimizer_steps)
    return out
