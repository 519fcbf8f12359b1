"""Scheduler arguments that would break a schedule later are refused when it is built, naming the
argument (StepLR's step_size 0 was a ZeroDivisionError at the next step; a negative step count or
gamma a nonsense or negative lr); valid ones build and step as before."""

import math

import numpy as np
import pytest
import torch

from twinkle.model.optim import SchedulerArgumentError, build_scheduler


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


@pytest.mark.parametrize(
    "name,kwargs,field",
    [
        ("StepLR", {"step_size": 0}, "step_size"),
        ("StepLR", {"step_size": 2.5}, "step_size"),
        ("StepLR", {"step_size": True}, "step_size"),
        ("CosineAnnealingLR", {"T_max": 0}, "T_max"),
        ("CyclicLR", {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 0}, "step_size_up"),
        ("cosine", {"num_warmup_steps": 0, "num_training_steps": -5}, "num_training_steps"),
        ("LinearWarmupScheduler", {"num_warmup_steps": -3}, "num_warmup_steps"),
        ("ExponentialLR", {"gamma": -1.0}, "gamma"),
        ("ExponentialLR", {"gamma": math.nan}, "gamma"),
        ("MultiStepLR", {"milestones": [-1, 2]}, "milestones"),
        ("linear", {"num_warmup_steps": 0, "num_training_steps": 10, "min_lr_ratio": 5.0}, "min_lr_ratio"),
        ("LambdaLR", {"lr_lambda": "lambda s: 1e9"}, "lr_lambda"),
        ("ReduceLROnPlateau", {}, "name"),
    ],
)
def test_arguments_that_break_a_schedule_are_refused_naming_them(name, kwargs, field):
    with pytest.raises(SchedulerArgumentError) as err:
        build_scheduler(name, _optimizer(), **kwargs)
    assert err.value.field == field
    assert isinstance(err.value, ValueError)  # a caller's error (the server answers it as the user's at the call)
    assert (f"{field} = " in str(err.value)) or field == "name", str(err.value)


@pytest.mark.parametrize(
    "name,kwargs,lr_after_4",
    [
        ("StepLR", {"step_size": 2, "gamma": 0.5}, 0.025),
        ("cosine", {"num_warmup_steps": 0, "num_training_steps": 8}, 0.05),
        ("LinearWarmupScheduler", {"num_warmup_steps": 8}, 0.05),
        ("LambdaLR", {"lr_lambda": lambda step: 1.0 / (1 + step)}, 0.02),
        ("StepLR", {"step_size": np.int64(2), "gamma": np.float32(0.5)}, 0.025),  # counts computed with numpy
    ],
)
def test_valid_arguments_build_and_step_as_before(name, kwargs, lr_after_4):
    optimizer = _optimizer()
    scheduler = build_scheduler(name, optimizer, **kwargs)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert math.isclose(optimizer.param_groups[0]["lr"], lr_after_4, rel_tol=1e-5)
