"""Optimizers and learning-rate schedulers by name.

Any `torch.optim` optimizer can be named. Schedulers: any `torch.optim.lr_scheduler` class, any
name of transformers' `get_scheduler` family, and the warmup names Twinkle has always taken
(`CosineWarmupScheduler`, `LinearWarmupScheduler`, `cosine`, `linear`), which build transformers'
own schedules (warmup lr·step/warmup, as the HF Trainer). Parameters are split into a decayed
group (matrices) and a no-decay group (biases, norm weights, anything 1-D), the usual rule for
transformer training.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any, TypeVar

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

T = TypeVar("T")
# (optimizer, **kwargs) -> scheduler: a torch scheduler class or a factory function
SchedulerFactory = Callable[..., LRScheduler]
OptimizerSpec = str | type[torch.optim.Optimizer]  # a torch.optim name or class
SchedulerSpec = str | SchedulerFactory  # a name (see scheduler_names) or a class / factory

NO_DECAY_MARKERS = ("bias", "norm", "ln_")


def CosineWarmupScheduler(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int,
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
    last_epoch: int = -1,
) -> LambdaLR:
    """transformers' cosine schedule with linear warmup (lr·step/warmup), decaying to base·min_lr_ratio."""
    from transformers import get_cosine_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    if min_lr_ratio:
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps, num_training_steps, num_cycles, last_epoch, min_lr_rate=min_lr_ratio
        )
    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, num_cycles, last_epoch)


def LinearWarmupScheduler(
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_training_steps: int | None = None,
    min_lr_ratio: float = 0.0,
    last_epoch: int = -1,
) -> LambdaLR:
    """transformers' linear warmup, then linear decay to base·min_lr_ratio at `num_training_steps`
    (constant after warmup when num_training_steps is None)."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_linear_schedule_with_warmup,
        get_polynomial_decay_schedule_with_warmup,
    )

    if num_training_steps is None:
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps, last_epoch)
    if min_lr_ratio:
        lr_end = optimizer.defaults["lr"] * min_lr_ratio
        return get_polynomial_decay_schedule_with_warmup(
            optimizer, num_warmup_steps, num_training_steps, lr_end=lr_end, power=1.0, last_epoch=last_epoch
        )
    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch)


def _transformers_schedule(name: str) -> SchedulerFactory:
    def make(
        optimizer: torch.optim.Optimizer,
        num_warmup_steps: int | None = None,
        num_training_steps: int | None = None,
        **kwargs: Any,
    ) -> LRScheduler:
        from transformers import get_scheduler

        return get_scheduler(
            name,
            optimizer,
            num_warmup_steps=num_warmup_steps,
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=kwargs or None,
        )

    make.__name__ = make.__qualname__ = name
    return make


# The names users already pass keep their meaning (and min_lr_ratio); every other name of
# transformers' get_scheduler family ('constant_with_warmup', 'polynomial', ...) works as there.
_NAMED_SCHEDULERS = {
    "CosineWarmupScheduler": CosineWarmupScheduler,
    "LinearWarmupScheduler": LinearWarmupScheduler,
    "cosine": CosineWarmupScheduler,
    "linear": LinearWarmupScheduler,
}


def _transformers_schedulers() -> dict[str, SchedulerFactory]:
    from transformers import SchedulerType

    return {t.value: _transformers_schedule(t.value) for t in SchedulerType if t.value not in _NAMED_SCHEDULERS}


def _subclasses_in(module: ModuleType, base: type[T]) -> dict[str, type[T]]:
    return {
        name: obj
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, base) and obj is not base and not name.startswith("_")
    }


def optimizer_names() -> list[str]:
    return sorted(_subclasses_in(torch.optim, torch.optim.Optimizer))


def _schedulers() -> dict[str, SchedulerFactory]:
    return {**_subclasses_in(torch.optim.lr_scheduler, LRScheduler), **_transformers_schedulers(), **_NAMED_SCHEDULERS}


def scheduler_names() -> list[str]:
    return sorted(_schedulers())


def resolve_optimizer(optimizer_cls: OptimizerSpec) -> type[torch.optim.Optimizer]:
    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer):
        return optimizer_cls
    found = _subclasses_in(torch.optim, torch.optim.Optimizer).get(optimizer_cls)
    if found is None:
        raise ValueError(f"unknown optimizer {optimizer_cls!r}; registered: {', '.join(optimizer_names())}")
    return found


def resolve_scheduler(scheduler_cls: SchedulerSpec) -> SchedulerFactory:
    """A callable `(optimizer, **kwargs) -> LRScheduler` for a scheduler class, factory or name."""
    if isinstance(scheduler_cls, type):
        if issubclass(scheduler_cls, LRScheduler):
            return scheduler_cls
    elif not isinstance(scheduler_cls, str) and callable(scheduler_cls):
        return scheduler_cls  # a factory (one of ours, resolved already, or the caller's own)
    found = _schedulers().get(scheduler_cls) if isinstance(scheduler_cls, str) else None
    if found is None:
        raise ValueError(f"unknown lr scheduler {scheduler_cls!r}; registered: {', '.join(scheduler_names())}")
    return found


class SchedulerArgumentError(ValueError):
    """A scheduler keyword argument that would break the schedule (a period of 0 divides by zero at a
    later step; a negative step count or factor makes a nonsense or negative lr): refused when the
    scheduler is set, naming the argument, never later as a failure of a training step."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _refuse(scheduler: str, field: str, value: object, expected: str) -> SchedulerArgumentError:
    shown = repr(value) if len(repr(value)) <= 64 else f"{repr(value)[:30]}...({len(repr(value))} characters)"
    return SchedulerArgumentError(
        f"lr scheduler {scheduler}: {field} = {shown} is outside its range: {expected}", field
    )


# What each scheduler argument may be, by name (torch's and transformers' schedulers share these names).
_PERIODS = {"step_size", "T_max", "T_0", "T_mult", "step_size_up", "total_steps", "epochs", "steps_per_epoch"}
_PERIODS |= {"num_training_steps"}
_COUNTS = {"num_warmup_steps", "total_iters", "step_size_down", "patience", "cooldown"}
_COUNTS |= {"num_decay_steps", "num_stable_steps", "timescale"}
_FRACTIONS = {"min_lr_ratio", "pct_start", "end_factor", "factor", "min_lr_rate"}
_CALLABLES = {"lr_lambda", "scale_fn", "schedulers"}
# Schedulers the step rule cannot drive: it calls `scheduler.step()` after each optimizer step, with no metric.
_NEEDS_A_METRIC = {"ReduceLROnPlateau", "reduce_lr_on_plateau"}


def _is_int(v: object) -> bool:  # numpy's integers too: a step count is often computed from a dataset's length
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def check_scheduler_args(scheduler_cls: SchedulerFactory, kwargs: dict[str, Any]) -> None:
    """Refuse (SchedulerArgumentError) an argument that would break the schedule later: every step
    count an integer (a period >= 1, a count >= 0, milestones >= 0), every number finite and >= 0,
    ratios in [0, 1], callables callable; a scheduler that needs a metric at each step."""
    name = getattr(scheduler_cls, "__name__", str(scheduler_cls))
    if name in _NEEDS_A_METRIC:
        raise SchedulerArgumentError(
            f"lr scheduler {name} needs a metric at each step; the step rule steps a scheduler without one", "name"
        )
    for key, v in kwargs.items():
        if key in _CALLABLES:
            items = v if isinstance(v, (list, tuple)) else [v]
            if not items or not all(callable(i) or isinstance(i, LRScheduler) for i in items):
                raise _refuse(name, key, v, "callables or schedulers (given in Python, not over the wire)")
        elif key in _PERIODS and not (_is_int(v) and v >= 1):
            if not (v is None and key == "num_training_steps"):
                raise _refuse(name, key, v, "an integer >= 1 (a number of steps)")
        elif key in _COUNTS and not (_is_int(v) and v >= 0) and v is not None:
            raise _refuse(name, key, v, "an integer >= 0 (a number of steps)")
        elif key == "milestones" and not (isinstance(v, (list, tuple)) and all(_is_int(m) and m >= 0 for m in v)):
            raise _refuse(name, key, v, "a list of integers >= 0 (steps)")
        elif key == "last_epoch" and not (_is_int(v) and v >= -1):
            raise _refuse(name, key, v, "an integer >= -1")
        elif key in _FRACTIONS and not (_is_number(v) and 0 <= v <= 1):
            raise _refuse(name, key, v, "a finite number in [0, 1]")
        elif isinstance(v, numbers.Real) and not isinstance(v, bool) and not (_is_number(v) and v >= 0):
            raise _refuse(name, key, v, "a finite number >= 0")


def build_scheduler(scheduler_cls: SchedulerSpec, optimizer: torch.optim.Optimizer, **kwargs: Any) -> LRScheduler:
    """The one place a learning-rate scheduler is made: named or given, its arguments checked first."""
    factory = resolve_scheduler(scheduler_cls)
    check_scheduler_args(factory, kwargs)
    return factory(optimizer, **kwargs)


def param_groups(named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float) -> list[dict]:
    """Parameters split into decay / no-decay groups (empty groups dropped)."""
    decay, no_decay = [], []
    for name, p in named_params:
        if p.dim() < 2 or any(m in name.lower() for m in NO_DECAY_MARKERS):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


# torch's optimizers with a fused CPU kernel (torch >= 2.4)
FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _is_sharded(p: torch.Tensor) -> bool:
    """A DTensor (FSDP2 / tensor-parallel shard)."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor) or isinstance(p.data, DTensor)


def _cpu_kernels(
    cls: type[torch.optim.Optimizer], params: list[torch.Tensor], signature: Mapping[str, inspect.Parameter]
) -> dict:
    """How torch should update CPU parameters. Its CPU default is a Python loop over parameters, and
    even its foreach path does per-parameter Python work (a LoRA has ~100 small factors a tenant:
    that work dominates a step). Its fused CPU kernel updates every tensor in one call, ~2.5x faster
    over eight tenants' factors: the same update, rounded differently in the last bits (~1e-7
    relative). Sharded (DTensor) parameters take foreach: the fused kernels have no sharding rule;
    so do non-contiguous ones (see `_contiguous_for_fused`)."""
    if not all(p.device.type == "cpu" for p in params):
        return {}  # torch picks its own accelerator defaults
    if (
        cls in FUSED_ON_CPU
        and "fused" in signature
        and not any(_is_sharded(p) or not p.is_contiguous() for p in params)
    ):
        return {"fused": True}
    return {"foreach": True} if "foreach" in signature else {}


# ARG001: torch's optimizer pre-hook signature
def _contiguous_for_fused(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:  # noqa: ARG001
    """Before each step of a fused CPU optimizer: torch's fused CPU kernels (Adam, AdamW, SGD,
    Adagrad; torch 2.15) read a non-contiguous gradient or parameter as if it were contiguous and
    apply a wrong update without an error (a transposed gradient: AdamW off by 0.4 in one step).
    Autograd hands back such gradients (a LoRA factor's from a transposed product, the vision-language
    engine's), so they are copied contiguous here, and a group holding a non-contiguous parameter
    (set after the optimizer was built) falls back to foreach, which honours strides."""
    for group in optimizer.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            if p.grad is not None and not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            if not p.is_contiguous():
                group["fused"], group["foreach"] = False, True


def build_optimizer(
    optimizer_cls: OptimizerSpec, named_params: Iterable[tuple[str, torch.Tensor]], **kwargs: Any
) -> torch.optim.Optimizer:
    cls = resolve_optimizer(optimizer_cls)
    params = list(named_params)  # the caller's trainable set (an inactive LoRA has requires_grad off)
    if not params:
        raise ValueError("no trainable parameters for the optimizer")
    signature = inspect.signature(cls.__init__).parameters
    if not {"fused", "foreach"} & set(kwargs):
        kwargs.update(_cpu_kernels(cls, [p for _, p in params], signature))
    accepts_decay = "weight_decay" in signature
    if accepts_decay:
        default = signature["weight_decay"].default
        decay = kwargs.pop("weight_decay", default if isinstance(default, (int, float)) else 0.0)
        optimizer = cls(param_groups(params, decay), **kwargs)
    else:
        optimizer = cls([p for _, p in params], **kwargs)
    if kwargs.get("fused") and all(p.device.type == "cpu" for _, p in params):
        optimizer.register_step_pre_hook(_contiguous_for_fused)
    return optimizer
