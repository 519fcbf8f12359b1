"""Everything one tenant owns besides its weights: optimizer, scheduler, loss, accumulation, metrics.

Nothing here is shared between adapters, which is what makes isolation hold by construction: an
optimizer only ever sees its own adapter's parameters, and a metric only its own tenant's records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from twinkle.loss import CrossEntropyLoss, Loss, create_loss
from twinkle.metric import LossMetric, Metric, OptimizerMetric, TokenAccuracy

from twinkle.model.multi_lora.spec import AdapterSpec


def _warmup_then(decay):
    def schedule(num_warmup_steps: int = 0, num_training_steps: int = 1, min_lr_ratio: float = 0.0):
        def factor(step: int) -> float:
            if step < num_warmup_steps:
                return (step + 1) / max(1, num_warmup_steps)
            progress = min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))
            return min_lr_ratio + (1.0 - min_lr_ratio) * decay(progress)
        return factor
    return schedule


# Warm-up schedules by the names users write; anything else is looked up in torch.optim.lr_scheduler.
_WARMUP_SCHEDULES = {
    "CosineWarmupScheduler": _warmup_then(lambda p: 0.5 * (1.0 + math.cos(math.pi * p))),
    "LinearWarmupScheduler": _warmup_then(lambda p: 1.0 - p),
    "ConstantWarmupScheduler": _warmup_then(lambda p: 1.0),
}


def build_optimizer(optimizer_cls, params: list[nn.Parameter], **kwargs) -> torch.optim.Optimizer:
    if isinstance(optimizer_cls, str):
        cls = getattr(torch.optim, optimizer_cls, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"unknown optimizer {optimizer_cls!r}: expected a torch.optim class name "
                             "such as 'AdamW' or 'SGD', or an Optimizer subclass")
        optimizer_cls = cls
    return optimizer_cls(params, **kwargs)


def build_scheduler(scheduler_cls, optimizer: torch.optim.Optimizer, **kwargs):
    if isinstance(scheduler_cls, str):
        if scheduler_cls in _WARMUP_SCHEDULES:
            return torch.optim.lr_scheduler.LambdaLR(optimizer, _WARMUP_SCHEDULES[scheduler_cls](**kwargs))
        cls = getattr(torch.optim.lr_scheduler, scheduler_cls, None)
        if not isinstance(cls, type):
            raise ValueError(f"unknown lr scheduler {scheduler_cls!r}: expected one of "
                             f"{sorted(_WARMUP_SCHEDULES)} or a torch.optim.lr_scheduler class name")
        scheduler_cls = cls
    return scheduler_cls(optimizer, **kwargs)


def default_metrics() -> list[Metric]:
    return [LossMetric(), TokenAccuracy(), OptimizerMetric()]


@dataclass
class AdapterState:
    name: str
    spec: AdapterSpec
    module_names: list[str]                       # base Linear layers this adapter adapts
    params: list[nn.Parameter]
    gradient_accumulation_steps: int = 1
    optimizer: torch.optim.Optimizer | None = None
    scheduler: object | None = None
    loss: Loss = field(default_factory=CrossEntropyLoss)
    micro_steps: int = 0                          # forward_backward calls since the last optimizer step
    step_calls: int = 0                           # clip_grad_and_step calls since the last optimizer step
    optimizer_steps: int = 0
    train_metrics: list[Metric] = field(default_factory=default_metrics)
    eval_metrics: list[Metric] = field(default_factory=default_metrics)
    dropout_generator: torch.Generator | None = None

    def set_optimizer(self, optimizer_cls="AdamW", **kwargs) -> None:
        self.optimizer = build_optimizer(optimizer_cls, self.params, **kwargs)
        self.scheduler = None  # a scheduler is bound to one optimizer

    def ensure_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.set_optimizer("AdamW", lr=1e-4)
        return self.optimizer

    def set_scheduler(self, scheduler_cls, **kwargs) -> None:
        self.scheduler = build_scheduler(scheduler_cls, self.ensure_optimizer(), **kwargs)

    def set_loss(self, name_or_cls, **kwargs) -> None:
        self.loss = create_loss(name_or_cls, **kwargs)

    def metrics(self, is_training: bool) -> list[Metric]:
        return self.train_metrics if is_training else self.eval_metrics

    def parameter_bytes(self) -> int:
        total = sum(p.numel() * p.element_size() for p in self.params)
        if self.optimizer is not None:
            total += sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                         for t in s.values() if isinstance(t, torch.Tensor))
        return total
