"""Everything one tenant owns besides its weights: optimizer, scheduler, loss, accumulation, metrics.

Nothing here is shared between adapters, which is what makes isolation hold by construction: an
optimizer only ever sees its own adapter's parameters, and a metric only its own tenant's records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from twinkle.loss import CrossEntropyLoss, Loss, create_loss
from twinkle.metric import LossMetric, Metric, OptimizerMetric, TokenAccuracy

from twinkle.model.multi_lora.spec import AdapterSpec
from twinkle.model.optim import build_optimizer, resolve_scheduler


def default_metrics() -> list[Metric]:
    return [LossMetric(), TokenAccuracy(), OptimizerMetric()]


@dataclass
class AdapterState:
    name: str
    spec: AdapterSpec
    module_names: list[str]  # base Linear layers this adapter adapts
    params: list[nn.Parameter]
    gradient_accumulation_steps: int = 1
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    loss: Loss = field(default_factory=CrossEntropyLoss)
    micro_step: int = 0  # forward_backward calls since the last optimizer step
    consumed_batches: int = 0  # forward_backward calls ever: the data position on resume
    nonfinite_pending: bool = False  # a non-finite loss since the last step: that step is skipped
    optimizer_steps: int = 0
    train_metrics: list[Metric] = field(default_factory=default_metrics)
    eval_metrics: list[Metric] = field(default_factory=default_metrics)
    dropout_generator: torch.Generator | None = None

    def set_optimizer(self, optimizer_cls="AdamW", **kwargs) -> None:
        # LoRA factors are all matrices: every one lands in the decay group, as in TransformersModel.
        self.optimizer = build_optimizer(optimizer_cls, [(f"lora.{i}", p) for i, p in enumerate(self.params)], **kwargs)
        self.scheduler = None  # a scheduler is bound to one optimizer

    def require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise ValueError(f"no optimizer for adapter {self.name!r}: call set_optimizer(...) first")
        return self.optimizer

    def ensure_optimizer(self) -> torch.optim.Optimizer:
        """The Tinker API's implicit Adam (its optim_step carries the Adam parameters every step).
        The TwinkleModel contract never calls this: there, a missing optimizer is an error."""
        if self.optimizer is None:
            self.set_optimizer("AdamW", lr=1e-4)
        return self.require_optimizer()

    def set_scheduler(self, scheduler_cls, **kwargs) -> None:
        # One schedule implementation for both engines, so a tenant's lr curve does not depend on which runs it.
        self.scheduler = resolve_scheduler(scheduler_cls)(self.require_optimizer(), **kwargs)

    def set_loss(self, name_or_cls, **kwargs) -> None:
        self.loss = create_loss(name_or_cls, **kwargs)

    def metrics(self, is_training: bool) -> list[Metric]:
        return self.train_metrics if is_training else self.eval_metrics

    def parameter_bytes(self) -> int:
        total = sum(p.numel() * p.element_size() for p in self.params)
        if self.optimizer is not None:
            total += sum(
                t.numel() * t.element_size()
                for s in self.optimizer.state.values()
                for t in s.values()
                if isinstance(t, torch.Tensor)
            )
        return total
