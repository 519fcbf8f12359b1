"""Optimizers and learning-rate schedulers by name.

Any `torch.optim` optimizer and any `torch.optim.lr_scheduler` scheduler can be named, plus the
warmup schedules below. Parameters are split into a decayed group (matrices) and a no-decay group
(biases, norm weights, anything 1-D), the usual rule for transformer training.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

NO_DECAY_MARKERS = ("bias", "norm", "ln_")


def _warmup_factor(step: int, warmup: int) -> float:
    return (step + 1) / (warmup + 1) if step < warmup else 1.0


class CosineWarmupScheduler(LambdaLR):
    """lr(step) = base·(step+1)/(warmup+1) during warmup, then cosine from base to base·min_lr_ratio
    over the remaining `num_training_steps − num_warmup_steps` steps (and flat after that)."""

    def __init__(self, optimizer, num_warmup_steps: int, num_training_steps: int, min_lr_ratio: float = 0.0,
                 num_cycles: float = 0.5, last_epoch: int = -1):
        self.num_warmup_steps, self.num_training_steps = num_warmup_steps, num_training_steps
        self.min_lr_ratio, self.num_cycles = min_lr_ratio, num_cycles
        super().__init__(optimizer, self._factor, last_epoch)

    def _factor(self, step: int) -> float:
        if step < self.num_warmup_steps:
            return _warmup_factor(step, self.num_warmup_steps)
        span = max(1, self.num_training_steps - self.num_warmup_steps)
        progress = min(1.0, (step - self.num_warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * self.num_cycles * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


class LinearWarmupScheduler(LambdaLR):
    """Linear warmup to base over `num_warmup_steps`, then linear decay to base·min_lr_ratio at
    `num_training_steps` (constant after warmup when num_training_steps is None)."""

    def __init__(self, optimizer, num_warmup_steps: int, num_training_steps: int | None = None,
                 min_lr_ratio: float = 0.0, last_epoch: int = -1):
        self.num_warmup_steps, self.num_training_steps, self.min_lr_ratio = num_warmup_steps, num_training_steps, min_lr_ratio
        super().__init__(optimizer, self._factor, last_epoch)

    def _factor(self, step: int) -> float:
        if step < self.num_warmup_steps:
            return _warmup_factor(step, self.num_warmup_steps)
        if self.num_training_steps is None:
            return 1.0
        span = max(1, self.num_training_steps - self.num_warmup_steps)
        progress = min(1.0, (step - self.num_warmup_steps) / span)
        return 1.0 - (1.0 - self.min_lr_ratio) * progress


_OUR_SCHEDULERS = {"CosineWarmupScheduler": CosineWarmupScheduler, "LinearWarmupScheduler": LinearWarmupScheduler,
                   "cosine": CosineWarmupScheduler, "linear": LinearWarmupScheduler}


def _subclasses_in(module, base) -> dict[str, type]:
    return {name: obj for name, obj in vars(module).items()
            if inspect.isclass(obj) and issubclass(obj, base) and obj is not base and not name.startswith("_")}


def optimizer_names() -> list[str]:
    return sorted(_subclasses_in(torch.optim, torch.optim.Optimizer))


def scheduler_names() -> list[str]:
    return sorted({**_subclasses_in(torch.optim.lr_scheduler, LRScheduler), **_OUR_SCHEDULERS})


def resolve_optimizer(optimizer_cls) -> type[torch.optim.Optimizer]:
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer):
        return optimizer_cls
    found = _subclasses_in(torch.optim, torch.optim.Optimizer).get(optimizer_cls)
    if found is None:
        raise ValueError(f"unknown optimizer {optimizer_cls!r}; registered: {', '.join(optimizer_names())}")
    return found


def resolve_scheduler(scheduler_cls) -> type[LRScheduler]:
    if isinstance(scheduler_cls, type) and issubclass(scheduler_cls, LRScheduler):
        return scheduler_cls
    found = {**_subclasses_in(torch.optim.lr_scheduler, LRScheduler), **_OUR_SCHEDULERS}.get(scheduler_cls)
    if found is None:
        raise ValueError(f"unknown lr scheduler {scheduler_cls!r}; registered: {', '.join(scheduler_names())}")
    return found


def param_groups(named_params, weight_decay: float) -> list[dict]:
    """Parameters split into decay / no-decay groups (empty groups dropped)."""
    decay, no_decay = [], []
    for name, p in named_params:
        if p.dim() < 2 or any(m in name.lower() for m in NO_DECAY_MARKERS):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(optimizer_cls, named_params, **kwargs) -> torch.optim.Optimizer:
    cls = resolve_optimizer(optimizer_cls)
    params = list(named_params)  # the caller's trainable set (an inactive LoRA has requires_grad off)
    if not params:
        raise ValueError("no trainable parameters for the optimizer")
    signature = inspect.signature(cls.__init__).parameters
    if "foreach" in signature and "fused" not in kwargs and all(p.device.type == "cpu" for _, p in params):
        # torch's CPU default is a Python loop over parameters; its foreach kernels give the same
        # numbers bit for bit in one call per op (a LoRA has ~100 small factors: the loop dominates)
        kwargs.setdefault("foreach", True)
    accepts_decay = "weight_decay" in signature
    if accepts_decay:
        default = signature["weight_decay"].default
        decay = kwargs.pop("weight_decay", default if isinstance(default, (int, float)) else 0.0)
        return cls(param_groups(params, decay), **kwargs)
    return cls([p for _, p in params], **kwargs)
