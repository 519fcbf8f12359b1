"""Per-adapter training state. Everything that differs between two tenants training LoRAs on the
same base lives here and nowhere else: optimizer, scheduler, loss, gradient-accumulation counter,
metrics, and the template/processor used to encode their inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from twinkle.loss import CrossEntropyLoss, Loss
from twinkle.metric import LossMetric, Metric, OptimizerMetric, ThroughputMetric, TokenAccuracy

FULL_MODEL = ""  # the state key when no adapter exists: the whole model trains


def default_metrics(peak_flops: float) -> list[Metric]:
    return [LossMetric(), TokenAccuracy(), OptimizerMetric(), ThroughputMetric(peak_flops)]


@dataclass
class AdapterState:
    name: str
    params: list[tuple[str, torch.nn.Parameter]]  # this adapter's trainable parameters, by name
    peak_flops: float
    gradient_accumulation_steps: int = 1
    loss: Loss = field(default_factory=CrossEntropyLoss)
    optimizer: torch.optim.Optimizer | None = None
    optimizer_spec: tuple | None = None  # (name/cls, kwargs) to rebuild on resume
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    scheduler_spec: tuple | None = None
    template: object = None
    processor: object = None
    micro_step: int = 0  # forward_backward calls since the last optimizer step
    optimizer_steps: int = 0  # steps taken (skipped ones excluded)
    consumed_batches: int = 0  # forward_backward calls ever: the data position on resume
    nonfinite_pending: bool = False  # a non-finite loss since the last step: that step will be skipped
    grad_scaler: torch.amp.GradScaler | None = None  # under fp16 mixed precision
    pending_seconds: float = 0.0
    train_metrics: list[Metric] = field(default_factory=list)
    eval_metrics: list[Metric] = field(default_factory=list)

    def __post_init__(self):
        if self.gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {self.gradient_accumulation_steps}")
        if not self.train_metrics:
            self.train_metrics = default_metrics(self.peak_flops)
        if not self.eval_metrics:
            self.eval_metrics = [LossMetric(), TokenAccuracy(), ThroughputMetric(self.peak_flops)]

    @property
    def at_boundary(self) -> bool:
        return self.micro_step >= self.gradient_accumulation_steps  # the rule in twinkle.model.base

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.params]

    def metrics(self, is_training: bool) -> list[Metric]:
        return self.train_metrics if is_training else self.eval_metrics

    def lr(self) -> float | None:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else None
