"""TwinkleModel: the one training contract every engine implements.

TransformersModel, MultiLoraModel, MegatronModel and the HTTP proxy (`twinkle.client.model`) all
take the arguments below in this order with these defaults; a test compares their signatures with
this class. The user's loop drives it:

    model.add_adapter_to_model("default", LoraConfig(...), gradient_accumulation_steps=2)
    model.set_optimizer("AdamW", lr=1e-4)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=5,
                           num_training_steps=num_training_steps(len(loader), 2, epochs=1))
    for batch in loader:
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()          # steps only on an accumulation boundary
    model.save("ckpt", save_training_state=True)

`adapter_name` picks the LoRA when several exist; None means the only adapter (or, on an engine that
trains full parameters, the whole model). An unknown name is a ValueError listing the known ones.

Gradient accumulation (the same on every engine)
    `gradient_accumulation_steps` (per adapter, set by add_adapter_to_model) counts forward_backward
    calls. Each micro-batch's loss is divided by it, so the accumulated gradient is the mean over the
    window. Call clip_grad_and_step after every forward_backward: it clips, steps the optimizer and
    the scheduler and clears the gradients once at least `gradient_accumulation_steps`
    forward_backward calls ran since the last step, and otherwise returns {'stepped': False,
    'accumulated': n}. A non-finite loss or gradient norm in the window skips that step (weights,
    optimizer and scheduler untouched; gradients dropped; {'stepped': False, 'skipped': True}).

Schedulers step once per optimizer step, so `num_training_steps` counts optimizer steps, not
micro-batches: pass `twinkle.model.num_training_steps(len(dataloader), gradient_accumulation_steps,
epochs)`.

Defaults: there is no implicit optimizer. clip_grad_and_step and set_lr_scheduler without a prior
set_optimizer raise ValueError naming set_optimizer. The loss defaults to CrossEntropyLoss.

Refusals: an engine that cannot do something raises NotImplementedError naming what to use instead
(e.g. MegatronModel.add_adapter_to_model points to TransformersModel / MultiLoraModel). Engines may
add keyword-only options after the contract's parameters; they never reorder them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twinkle.registry import Registry

if TYPE_CHECKING:
    import inspect
    import os

    import torch
    from peft import LoraConfig

    from twinkle.data_format.loss_inputs import Rows
    from twinkle.loss.base import Loss, LossContext
    from twinkle.model.optim import OptimizerSpec, SchedulerSpec

# The contract's method names, in the order a loop uses them (the signature test walks this list).
CONTRACT_METHODS = (
    "add_adapter_to_model",
    "set_loss",
    "set_optimizer",
    "set_lr_scheduler",
    "forward",
    "backward",
    "forward_only",
    "forward_backward",
    "clip_grad_and_step",
    "calculate_metric",
    "save",
    "load",
    "resume_from_checkpoint",
)


def refuse(engine: object, what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"{type(engine).__name__} cannot {what}: {instead}")


class TwinkleModel:
    def add_adapter_to_model(self, adapter_name: str, config: LoraConfig, gradient_accumulation_steps: int = 1) -> None:
        """Add a LoRA adapter (a peft LoraConfig) with its own accumulation window. Names are unique."""
        raise refuse(self, "train LoRA adapters", "use TransformersModel or MultiLoraModel")

    def set_loss(self, loss: str | type[Loss] | Loss, adapter_name: str | None = None, **kwargs: Any) -> None:
        """The loss by registered name or class (kwargs go to its constructor)."""
        raise refuse(self, "set a loss", "use TransformersModel")

    def set_optimizer(
        self, optimizer_cls: OptimizerSpec = "AdamW", adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        """A torch optimizer by name or class over the adapter's trainable parameters; replaces any
        previous optimizer and drops its scheduler."""
        raise refuse(self, "set an optimizer", "use TransformersModel")

    def set_lr_scheduler(self, scheduler_cls: SchedulerSpec, adapter_name: str | None = None, **kwargs: Any) -> None:
        """A scheduler by name or class on the current optimizer (ValueError without one). It steps
        once per optimizer step: see `num_training_steps`."""
        raise refuse(self, "set an lr scheduler", "use TransformersModel")

    def forward(self, inputs: Rows, adapter_name: str | None = None) -> LossContext:
        """The network pass with autograd on: the LossContext (per-token log-probs, targets, mask)
        a custom loop computes its own loss from. In-process engines only: a graph cannot cross a
        process boundary, so remote proxies refuse it."""
        raise refuse(
            self,
            "return an autograd graph",
            "use forward_only for log-probs, or forward_backward with set_loss for training",
        )

    def backward(self, loss: torch.Tensor, adapter_name: str | None = None) -> bool:
        """Back-propagate a loss computed from `forward`'s LossContext, counted like one
        forward_backward (scaled by 1/gradient_accumulation_steps; a non-finite loss is not
        propagated and skips the coming step). Returns whether gradients were accumulated.
        In-process engines only, as `forward`."""
        raise refuse(self, "back-propagate a local loss", "use forward_backward with set_loss")

    def forward_only(self, inputs: Rows, adapter_name: str | None = None) -> dict[str, Any]:
        """No-gradient pass: {'loss': float | None (None when the batch lacks what the loss needs),
        'logprobs': one list per row, aligned with its labels (0.0 at position 0)}. Counts toward
        the eval metrics."""
        raise NotImplementedError

    def forward_backward(self, inputs: Rows, adapter_name: str | None = None) -> dict[str, Any]:
        """Forward, loss and backward on one micro-batch: {'loss': the micro-batch loss, ...loss
        metrics}. Gradients accumulate (scaled by 1/gradient_accumulation_steps) until the step."""
        raise NotImplementedError

    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0, adapter_name: str | None = None) -> dict[str, Any]:
        """On an accumulation boundary: clip to `max_grad_norm` (None: no clipping, the norm is still
        reported), step optimizer and scheduler, clear gradients. Returns {'stepped', 'skipped',
        'grad_norm', 'lr', 'step'}; off a boundary {'stepped': False, 'accumulated': n}."""
        raise NotImplementedError

    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]:
        """Metrics since the last call, then reset: loss, token_accuracy, grad_norm, lr, ... A metric
        that cannot be measured (e.g. MFU without a known peak) is absent, never a made-up number."""
        raise NotImplementedError

    def save(
        self,
        path: str | os.PathLike,
        adapter_name: str | None = None,
        save_training_state: bool = False,
        data_position: int | None = None,
    ) -> str:
        """A PEFT adapter folder (`twinkle.model.checkpoint`); with save_training_state also the
        optimizer, scheduler, RNG and data position. Returns where it was written."""
        raise NotImplementedError

    def load(self, path: str | os.PathLike, adapter_name: str | None = None) -> None:
        """Weights from a folder written by `save` (or by peft) into the adapter; an adapter that does
        not exist yet is created from the folder's adapter_config.json."""
        raise NotImplementedError

    def resume_from_checkpoint(self, path: str | os.PathLike, adapter_name: str | None = None) -> dict[str, Any]:
        """`load` plus the training state: the next step is bit-exact the one the saved run would have
        taken. Returns {'data_position', 'optimizer_steps', 'micro_step'}: skip `data_position`
        batches of the data loader to continue where the saved run was. Call set_optimizer (and
        set_lr_scheduler) first, as in the saved run."""
        raise NotImplementedError


def num_training_steps(dataloader_len: int, gradient_accumulation_steps: int = 1, epochs: int = 1) -> int:
    """Optimizer steps a run takes (what a scheduler's `num_training_steps` counts): one per full
    accumulation window of micro-batches. The window counter runs on across epochs, so a window may
    span an epoch boundary; only the run's trailing partial window never steps."""
    for name, value in (
        ("dataloader_len", dataloader_len),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
        ("epochs", epochs),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "dataloader_len" else 1):
            raise ValueError(
                f"{name} must be a {'non-negative' if name == 'dataloader_len' else 'positive'} integer, got {value!r}"
            )
    return dataloader_len * epochs // gradient_accumulation_steps


def contract_mismatches(cls: type) -> list[str]:
    """How `cls`'s public methods depart from the contract (empty: it conforms). Each contract
    parameter must appear in the same place with the same name, kind and default; anything an
    engine adds must be keyword-only with a default (or **kwargs)."""
    import inspect

    problems = []
    for name in CONTRACT_METHODS:
        want = list(inspect.signature(getattr(TwinkleModel, name)).parameters.values())
        method = getattr(cls, name, None)
        if method is None:
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        got = list(inspect.signature(method).parameters.values())
        fixed = [p for p in want if p.kind is not p.VAR_KEYWORD]
        if [(p.name, p.kind, p.default) for p in got[: len(fixed)]] != [(p.name, p.kind, p.default) for p in fixed]:
            problems.append(f"{cls.__name__}.{name} takes ({_plain(got)}); the contract: ({_plain(want)})")
            continue
        extra = [
            p
            for p in got[len(fixed) :]
            if p.kind is not p.VAR_KEYWORD and (p.kind is not p.KEYWORD_ONLY or p.default is p.empty)
        ]
        if extra:
            problems.append(
                f"{cls.__name__}.{name} adds {[p.name for p in extra]} that are not keyword-only options with defaults"
            )
    return problems


def _plain(params: list[inspect.Parameter]) -> str:
    """Parameters as `name=default`, without self and annotations."""
    out = []
    for p in params:
        if p.name == "self":
            continue
        prefix = {p.VAR_KEYWORD: "**", p.VAR_POSITIONAL: "*"}.get(p.kind, "")
        out.append(prefix + p.name + ("" if p.default is p.empty else f"={p.default!r}"))
    return ", ".join(out)


# Engines by name (entry-point group `twinkle.model`): the name a config or a remote call carries.
MODELS: Registry[TwinkleModel] = Registry("model", "twinkle.model", TwinkleModel)
