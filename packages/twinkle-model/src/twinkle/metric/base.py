"""The Metric extension point. A metric sees one record per forward pass and one per optimizer
step, and reports a dict of floats when asked; state is per metric instance, so per adapter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from twinkle.registry import Registry


@dataclass
class ForwardRecord:
    loss: float | None  # this micro-batch's loss (None: not computed, e.g. forward_only for log-probs)
    loss_tokens: int  # positions with a target (labels != -100)
    input_tokens: int  # non-padding input positions processed
    correct_tokens: int  # loss positions where argmax == target
    seconds: float  # wall time of forward (+ backward)
    flops: float  # model FLOPs this pass needed (see twinkle.metric.mfu)
    finite: bool = True
    extras: dict[str, float] = field(default_factory=dict)  # the loss's own metrics (clip_fraction, kl, ...)


@dataclass
class StepRecord:
    grad_norm: float | None
    lr: float | None
    skipped: bool
    seconds: float


class Metric:
    aliases: ClassVar[tuple[str, ...]] = ()

    def on_forward(self, record: ForwardRecord) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        pass

    def compute(self) -> dict[str, float]:
        raise NotImplementedError

    def reset(self) -> None:
        pass


METRICS: Registry[Metric] = Registry("metric", "twinkle.metric", Metric)
register_metric = METRICS.register
