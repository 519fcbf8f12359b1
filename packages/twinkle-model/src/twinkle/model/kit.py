"""What twinkle-kit's scripts read from a model beyond the TwinkleModel contract, for in-process engines.

- `get_train_configs()`: a readable summary of the adapter, its trainable parameters, optimizer,
  learning rate, scheduler and accumulation window (twinkle-kit logs it before training);
- `model`: the transformers module itself (twinkle-kit's attribute name);
- `optimizer_group[name].cur_step`: the optimizer steps an adapter took;
- forward_backward's `micro_batch_size` (`micro_batched_forward_backward`) and forward_only's
  `disable_lora` (`forward_only_base`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from twinkle.model.kit_outputs import joined_logps, row_logps
from twinkle.model.strategy import mean_units

if TYPE_CHECKING:
    from twinkle.data_format.loss_inputs import Rows
    from twinkle.loss import LossContext
    from twinkle.model.state import AdapterState
    from twinkle.processor import InputProcessor

TASKS = ("causal_lm", "embedding")  # 'embedding': twinkle.model.embedding_pass


def check_task(task: str) -> None:
    if task not in TASKS:
        raise NotImplementedError(
            f"task={task!r} is not offered (twinkle-kit's 'fused_lm_ce' needs Liger kernels): use one of {TASKS}"
        )


def save_target(
    path: str | os.PathLike,
    save_training_state: bool,
    output_dir: str | os.PathLike | None,
    save_optimizer: bool | None,
) -> tuple[str, bool]:
    """(folder, whether to save the training state) from save()'s own and twinkle-kit's keywords:
    `output_dir` is the folder the checkpoint `path` is written in; `save_optimizer` is
    `save_training_state`."""
    if save_optimizer is not None:
        if save_training_state and not save_optimizer:
            raise ValueError("save() got save_training_state=True and save_optimizer=False: pass one of them")
        save_training_state = save_optimizer
    folder = os.path.join(str(output_dir), str(path)) if output_dir is not None else str(path)
    return folder, save_training_state


def progress(counters: dict, gradient_accumulation_steps: int) -> dict:
    """resume_from_checkpoint's result with twinkle-kit's keys beside ours: `cur_step` (optimizer steps)
    and `consumed_train_samples` (as saved; 0 when the run did not count them)."""
    return {
        **counters,
        "cur_step": counters["optimizer_steps"],
        "consumed_train_samples": counters.get("consumed_train_samples", 0),
        "gradient_accumulation_steps": gradient_accumulation_steps,
    }


class OptimizerGroupView:
    """twinkle-kit's per-adapter `optimizer_group` entry: a live view of our adapter state (a loop may
    hold it and read `cur_step` after every step)."""

    def __init__(self, state: AdapterState) -> None:
        self.state = state

    adapter_name = property(lambda self: self.state.name or "default")
    cur_step = property(lambda self: self.state.optimizer_steps)
    gradient_accumulation_steps = property(lambda self: self.state.gradient_accumulation_steps)
    optimizer = property(lambda self: self.state.optimizer)
    lr_scheduler = property(lambda self: self.state.scheduler)


class KitModelMixin:
    """Mixed into engines that hold their adapters' state in `self.states` (TransformersModel)."""

    @property
    def model(self) -> torch.nn.Module:
        return self.hf_model  # ty: ignore[missing-attribute] - the engine this is mixed into has it

    @property
    def optimizer_group(self) -> Mapping[str, OptimizerGroupView]:
        """By adapter name; the only adapter (or the whole model) also as 'default'."""
        states = self.states  # ty: ignore[missing-attribute]
        views = {name or "default": OptimizerGroupView(s) for name, s in states.items()}
        if len(states) == 1:
            views.setdefault("default", next(iter(views.values())))
        return views

    def get_train_configs(self, adapter_name: str | None = None) -> str:
        state = self._state(adapter_name)  # ty: ignore[missing-attribute]
        peft = getattr(self, "peft_model", None)
        config = peft.peft_config[state.name].to_dict() if peft is not None and state.name in peft.peft_config else {}
        trainable = sum(p.numel() for p in state.params)
        total = sum(p.numel() for p in self.hf_model.parameters())  # ty: ignore[missing-attribute]
        optimizer = state.optimizer
        lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None
        lines = [
            f"Adapter {state.name or '(whole model)'!r} config:",
            json.dumps({k: str(v) for k, v in config.items() if v is not None}, indent=2),
            f"Trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {100 * trainable / total:.4f}",
            f"Optimizer: {type(optimizer).__name__ if optimizer is not None else None}",
            f"Learning rate: {lr}",
            f"Lr scheduler: {type(state.scheduler).__name__ if state.scheduler is not None else None}",
            f"Gradient accumulation steps: {state.gradient_accumulation_steps}",
        ]
        return "\n".join(lines)

    def micro_batched_forward_backward(self, rows: list, adapter_name: str | None, micro_batch_size: int) -> dict:
        """forward_backward over `rows`, `micro_batch_size` rows per pass: each pass's loss is weighted by
        its share of what the loss averages over (loss tokens, or pairs), so the accumulated gradient
        and the reported loss are the whole batch's, and the call counts as one micro-batch."""
        from twinkle.model.strategy import data_parallel_size

        state = self._state(adapter_name)  # ty: ignore[missing-attribute]
        if data_parallel_size(self.device_mesh) > 1 or self.mixed_precision == "fp16":  # ty: ignore[missing-attribute]
            raise NotImplementedError(
                "micro_batch_size under data parallelism or fp16 is not offered: pass whole micro-batches "
                "(one forward_backward per micro-batch, gradient_accumulation_steps to accumulate)"
            )
        chunks = [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
        mean = state.loss.reduction == "mean"
        units = [float(mean_units(state.loss, _targets_only(chunk, state))) for chunk in chunks] if mean else []
        whole = sum(units)
        total, finite, metrics, logps = 0.0, True, {}, []
        for i, chunk in enumerate(chunks):
            t0 = time.perf_counter()
            ctx = self.forward(chunk, adapter_name)  # ty: ignore[missing-attribute]
            out = self.calculate_loss(ctx, adapter_name)  # ty: ignore[missing-attribute]
            logps.append(row_logps(ctx))
            weight = units[i] / whole if mean and whole > 0 else 1.0
            if bool(torch.isfinite(out.loss.detach()).all()):
                (out.loss * weight / state.gradient_accumulation_steps).backward()
            else:
                finite = False
            total += float(out.loss.detach()) * weight
            metrics = out.metrics
            self._record(state, ctx, out, time.perf_counter() - t0, training=True)  # ty: ignore[missing-attribute]
        state.count_micro_batch(finite)
        return {"loss": total if finite else float("nan"), **metrics, **joined_logps(logps)}

    def micro_batched_forward_only(
        self, rows: list, adapter_name: str | None, micro_batch_size: int, **kit: object
    ) -> dict:
        """forward_only over `rows`, `micro_batch_size` rows per pass (each its own forward_only, router
        replay included): row outputs in row order, the loss the whole batch's, weighted as above."""
        from twinkle.model.kit_outputs import join_passes
        from twinkle.model.strategy import data_parallel_size

        state = self._state(adapter_name)  # ty: ignore[missing-attribute]
        if data_parallel_size(self.device_mesh) > 1:  # ty: ignore[missing-attribute]
            raise NotImplementedError(
                "forward_only(micro_batch_size=) under data parallelism is not offered: the ranks' passes would "
                "not pair up; pass the rows whole (each rank runs its share) or one call per micro-batch"
            )
        chunks = [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
        outs = [self.forward_only(chunk, adapter_name, **kit) for chunk in chunks]  # ty: ignore[missing-attribute]
        weights = [1.0] * len(chunks)
        if state.loss.reduction == "mean" and all(o.get("loss") is not None for o in outs):
            units = [float(mean_units(state.loss, _targets_only(chunk, state))) for chunk in chunks]
            weights = [u / sum(units) if sum(units) > 0 else 1.0 for u in units]
        joined = join_passes(outs, weights)
        self.last_eval_loss = joined.get("loss")
        return joined

    def forward_only_base(self, inputs: Rows, adapter_name: str | None = None) -> dict:
        """forward_only with the adapter switched off: the base model (the reference of a LoRA run)."""
        peft = getattr(self, "peft_model", None)
        if peft is None:
            raise ValueError("disable_lora=True needs a LoRA adapter: this model trains the whole network")
        with peft.disable_adapter():
            return self.forward_only(inputs, adapter_name)  # ty: ignore[missing-attribute]


def _targets_only(rows: list, state: AdapterState) -> LossContext:
    """A LossContext holding the targets of `rows` (what `mean_units` counts), without a forward pass."""
    from twinkle.loss import LossContext
    from twinkle.model import inputs as model_inputs

    processor = state.processor if state.processor is not None else _right_padding()
    encoded = model_inputs.as_rows(rows, state.template)
    if isinstance(encoded, list):  # the targets alone: a row's other fields (routed_experts padded to a
        # longer batch's width, as forward_only returns them) need not fit this chunk's width
        encoded = [{k: r[k] for k in ("input_ids", "labels", "lengths") if k in r} for r in encoded]
    batch, _ = model_inputs.collate(encoded, processor)
    return LossContext(head=None, targets_B_T=batch["labels"][:, 1:])  # ty: ignore[invalid-argument-type]


def _right_padding() -> InputProcessor:
    from twinkle.processor import InputProcessor

    return InputProcessor(padding_side="right")
