"""Per-adapter training state, one class for every engine (TransformersModel, MultiLoraModel,
MegatronModel). Everything that differs between two tenants training LoRAs on the same base lives
here and nowhere else: parameters, optimizer, scheduler, loss, accumulation window, non-finite flag,
counters, metrics, and the template/processor used to encode their inputs. Nothing in it is shared
between adapters, which is what makes isolation hold by construction: an optimizer only ever sees
its own adapter's parameters, and a metric only its own tenant's records.

The step rule that acts on it (accumulate, skip non-finite, clip, step, schedule, metrics) is
`twinkle.model.step`; an engine only says how a pass is computed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from twinkle.loss import CrossEntropyLoss, Loss, create_loss
from twinkle.metric import LossMetric, Metric, OptimizerMetric, ThroughputMetric, TokenAccuracy
from twinkle.model.optim import build_optimizer, build_scheduler

if TYPE_CHECKING:
    from twinkle.model.optim import OptimizerSpec, SchedulerSpec
    from twinkle.processor import InputProcessor
    from twinkle.template import Template

FULL_MODEL = ""  # the state key when no adapter exists: the whole model trains


def default_metrics(peak_flops: float, is_training: bool = True) -> list[Metric]:
    own = [OptimizerMetric()] if is_training else []
    return [LossMetric(), TokenAccuracy(), *own, ThroughputMetric(peak_flops)]


@dataclass
class Snapshot:
    """What a pass changes in an adapter's state (gradients, window counters, non-finite flag): taken
    before a pass, it undoes one that must not count (a data-parallel peer failed)."""

    grads: list[torch.Tensor | None]
    micro_step: int
    consumed_batches: int
    nonfinite_pending: bool


@dataclass
class AdapterState:
    name: str
    params: list[torch.nn.Parameter]  # this adapter's trainable parameters
    param_names: list[str] = field(default_factory=list)  # their module paths (weight-decay groups, FSDP rebind)
    peak_flops: float = 0.0  # the device's measured matmul peak: the denominator of MFU
    gradient_accumulation_steps: int = 1
    loss: Loss = field(default_factory=CrossEntropyLoss)
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    template: Template | None = None
    processor: InputProcessor | None = None
    # multi-LoRA engines: the adapter's spec (rank, scaling, targets) and the layers it adapts
    spec: Any = None  # a twinkle.model.multi_lora.AdapterSpec
    module_names: list[str] = field(default_factory=list)
    dropout_generator: torch.Generator | None = None
    micro_step: int = 0  # forward_backward calls since the last optimizer step
    optimizer_steps: int = 0  # steps taken (skipped ones excluded)
    consumed_batches: int = 0  # forward_backward calls ever: the data position on resume
    nonfinite_pending: bool = False  # a non-finite loss since the last step: that step will be skipped
    grad_scaler: torch.amp.GradScaler | None = None  # under fp16 mixed precision
    train_metrics: list[Metric] = field(default_factory=list)
    eval_metrics: list[Metric] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.gradient_accumulation_steps, int) or self.gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be a positive integer, got {self.gradient_accumulation_steps!r}"
            )
        if not self.param_names:
            self.param_names = [f"lora.{i}" for i in range(len(self.params))]
        self.train_metrics = self.train_metrics or default_metrics(self.peak_flops, is_training=True)
        self.eval_metrics = self.eval_metrics or default_metrics(self.peak_flops, is_training=False)

    @classmethod
    def from_named(
        cls, name: str, named_params: Iterable[tuple[str, torch.nn.Parameter]], **kwargs: Any
    ) -> AdapterState:  # kwargs: the other fields
        named = list(named_params)
        return cls(name, [p for _, p in named], [n for n, _ in named], **kwargs)

    @property
    def at_boundary(self) -> bool:
        return self.micro_step >= self.gradient_accumulation_steps  # the rule in twinkle.model.base

    def count_micro_batch(self, finite: bool = True) -> None:
        """One forward_backward of the accumulation window done (a non-finite one skips the step)."""
        self.micro_step += 1
        self.consumed_batches += 1
        self.nonfinite_pending |= not finite

    def count_pass(self, before: Snapshot, finite: bool) -> None:
        """One forward_backward counted from the window as it was `before` it: a pass run in parts (micro-
        batches, or data ranks' shares, each of which counted itself) is one micro-batch of the window."""
        self.micro_step, self.consumed_batches = before.micro_step + 1, before.consumed_batches + 1
        self.nonfinite_pending = before.nonfinite_pending or not finite

    def resize_window(self, steps: int) -> None:
        """The window is `steps` micro-batches from now on (twinkle-kit's per-call
        `clip_grad_and_step(gradient_accumulation_steps=)`). What is accumulated was divided by the old
        size; it is rescaled to 1/steps, so the window's gradient stays the mean of its micro-batches.
        Shrinking a window that has begun is refused: its micro-batches skipped the data-parallel
        gradient sync, expecting more to come."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive integer, got {steps!r}")
        old = self.gradient_accumulation_steps
        if steps < old and self.micro_step:
            raise ValueError(
                f"gradient_accumulation_steps={steps}: {self.micro_step} micro-batch(es) of a window of {old} "
                "are accumulated; shrink the window at a step boundary"
            )
        if steps != old:
            with torch.no_grad():
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(old / steps)
            self.gradient_accumulation_steps = steps

    def end_window(self) -> None:
        """The accumulation window ends now, whatever its size, and counts as finite: the Tinker API's
        `optim_step` steps every time, and a non-finite forward_backward there was an error that never
        reached the gradients."""
        self.micro_step = max(self.micro_step, self.gradient_accumulation_steps)
        self.nonfinite_pending = False

    def set_counters(self, micro_step: int, optimizer_steps: int, consumed_batches: int) -> None:
        """The counters a checkpoint saved (resume)."""
        self.micro_step, self.optimizer_steps, self.consumed_batches = micro_step, optimizer_steps, consumed_batches

    def snapshot(self) -> Snapshot:
        grads = [None if p.grad is None else p.grad.clone() for p in self.params]
        return Snapshot(grads, self.micro_step, self.consumed_batches, self.nonfinite_pending)

    def restore(self, snapshot: Snapshot, counters: bool = True) -> None:
        """Gradients as they were (and, with `counters`, the window too)."""
        for p, grad in zip(self.params, snapshot.grads):
            p.grad = grad
        if counters:
            self.micro_step, self.consumed_batches = snapshot.micro_step, snapshot.consumed_batches
            self.nonfinite_pending = snapshot.nonfinite_pending

    def discard_pass(self, snapshot: Snapshot) -> None:
        """A pass whose loss was not finite somewhere: gradients as before it, the window's step skipped."""
        self.restore(snapshot, counters=False)
        self.nonfinite_pending = True

    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(zip(self.param_names, self.params))

    def metrics(self, is_training: bool) -> list[Metric]:
        return self.train_metrics if is_training else self.eval_metrics

    def lr(self) -> float | None:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else None

    # -- what a user sets ---------------------------------------------------------------------
    def set_loss(self, name_or_cls: str | type[Loss] | Loss, **kwargs: Any) -> None:
        self.loss = create_loss(name_or_cls, **kwargs)

    def set_optimizer(self, optimizer_cls: OptimizerSpec = "AdamW", **kwargs: Any) -> None:
        self.optimizer = build_optimizer(optimizer_cls, self.named_params(), **kwargs)
        self.scheduler = None  # a scheduler is bound to one optimizer

    def require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise ValueError(f"no optimizer for {self.name or 'the model'!r}: call set_optimizer(...) first")
        return self.optimizer

    def ensure_optimizer(self) -> torch.optim.Optimizer:
        """The Tinker API's implicit Adam (its optim_step carries the Adam parameters every step).
        The TwinkleModel contract never calls this: there, a missing optimizer is an error."""
        if self.optimizer is None:
            self.set_optimizer("AdamW", lr=1e-4)
        return self.require_optimizer()

    def set_scheduler(self, scheduler_cls: SchedulerSpec, **kwargs: Any) -> None:
        if self.optimizer is None:
            raise ValueError("call set_optimizer(...) before set_lr_scheduler(...)")
        # One schedule implementation for every engine, so a tenant's lr curve does not depend on which runs it.
        self.scheduler = build_scheduler(scheduler_cls, self.optimizer, **kwargs)

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
