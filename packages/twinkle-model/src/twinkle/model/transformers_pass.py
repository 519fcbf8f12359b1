"""The network pass of TransformersModel: inputs to a LossContext, the loss, the backward, the record.

`forward` collates the rows, shards them over the cp group, runs the network under autocast (the
unembedding in chunks past the logits budget) and the reference policy when the loss needs it;
`backward` scales by the accumulation window and keeps an adapter's gradients in one buffer;
`_record` hands each pass's tokens, accuracy and FLOPs to the adapter's metrics.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, overload

import torch

from twinkle.loss import EmbeddingHead, LogitsHead, LossContext, TokenHead
from twinkle.metric import ForwardRecord, matmul_params, step_flops
from twinkle.model import compact_heap, context_parallel, output_projection, router_replay, vision
from twinkle.model import inputs as model_inputs
from twinkle.model.state import AdapterState
from twinkle.model.strategy import data_parallel_sums, local_tensor
from twinkle.model.transformers_core import PRECISIONS, TransformersCore

if TYPE_CHECKING:
    from twinkle.data_format.loss_inputs import Rows
    from twinkle.loss import Loss, LossOutput
    from twinkle.model.context_parallel import Shard
    from twinkle.processor import InputProcessor

logger = logging.getLogger("twinkle.model.transformers_model")  # the engine's log, wherever its parts live


class TransformersPass(TransformersCore):
    """forward, calculate_loss and backward over TransformersCore's network and adapters."""

    def _prepare(self, inputs: Rows, state: AdapterState) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if state.template is None and model_inputs.has_trajectories(inputs):
            self.set_template(adapter_name=state.name or None)  # the model's own chat template
        rows = model_inputs.as_rows(inputs, state.template)
        routed = router_replay.take_routed(rows) if self.router_replay is not None else None
        processor = state.processor if state.processor is not None else _default_processor()
        batch, fields = model_inputs.collate(rows, processor)
        model_inputs.check_vocab(batch, self.vocab_size)  # before any kernel sees the ids
        if self.router_replay is not None:
            self.router_replay.prepared(batch, routed)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        return batch, {k: v.to(self.device) for k, v in fields.items()}

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = PRECISIONS[self.mixed_precision]
        return torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def _run(
        self, module: torch.nn.Module, batch: dict[str, torch.Tensor], drop_last: bool = True, task: str = "causal_lm"
    ) -> TokenHead:
        model_kwargs: dict[str, Any] = {
            k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch
        }
        if "pixel_values" in batch:
            model_kwargs.update(model_inputs.image_kwargs(batch, self.hf_model.config))
            model_kwargs["position_ids"] = vision.packed_rope_positions(self.hf_model, batch)  # None unless packed
        B, T = batch["input_ids"].shape
        chunk = self.head_chunk_size or output_projection.default_chunk(self.hf_model, B * T, self.logits_budget_bytes)
        proj = self.hf_model.get_output_embeddings()
        with self._autocast(), output_projection.skipped(proj, chunk is not None or task == "embedding"):
            out = module(**model_kwargs, use_cache=False)
        if task == "embedding":  # the final hidden states, pooled per sequence: no vocabulary at all
            return EmbeddingHead.pooled(out.logits, model_inputs.sequence_spans(batch))
        # the last position predicts nothing, except on a cp shard (whose targets are already shifted)
        logits = out.logits[:, :-1] if drop_last else out.logits
        if chunk is None:
            return LogitsHead(logits)
        # the model returned hidden states; under autocast the head multiplies in its dtype
        return output_projection.chunked_head(logits, proj, chunk, PRECISIONS[self.mixed_precision], local_tensor)

    def _reference_logps(
        self, module: torch.nn.Module, batch: dict[str, torch.Tensor], targets_B_T: torch.Tensor
    ) -> torch.Tensor | None:
        if self.peft_model is None:
            return None  # the loss explains that it needs `ref_logprobs`
        training = module.training
        module.eval()  # the reference policy draws no dropout, also inside a training pass
        try:
            with torch.no_grad(), self.peft_model.disable_adapter():
                return self._run(module, batch, drop_last=self.cp_size == 1).target_logps(targets_B_T)
        finally:
            module.train(training)

    def _shard(
        self, batch: dict[str, torch.Tensor], targets: torch.Tensor, fields: dict[str, torch.Tensor], loss: Loss
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], Shard | None]:
        """(model inputs, targets, fields, Shard or None): this cp rank's part of the sequence."""
        if self.cp_size == 1:
            return batch, targets, fields, None
        context_parallel.check_loss(loss)
        mesh = self.device_mesh
        return context_parallel.shard_batch(
            batch, targets, fields, mesh.get_group("cp"), mesh.get_rank("cp"), self.cp_size
        )

    def forward(
        self, inputs: Rows, adapter_name: str | None = None, *, _grad: bool = True, task: str = "causal_lm"
    ) -> LossContext:
        """Run the network; returns the LossContext (per-token log-probs etc.) the loss will read."""
        state = self._state(adapter_name)
        batch, fields = self._prepare(inputs, state)
        module = self._activate(state)
        run_batch, targets, shifted, shard = self._shard(
            batch, batch["labels"][:, 1:], model_inputs.shift_fields(fields), state.loss
        )
        if shard is not None:
            shard.activate()  # what the cp attention gathers over, also when backward recomputes it
        # training mode exactly when gradients flow: dropout as configured (peft's lora_dropout too)
        # and transformers' activation checkpointing, which recomputes layers only in training mode;
        # evaluation (forward_only, sampling) never draws dropout
        module.train(_grad)
        with torch.set_grad_enabled(_grad):
            head = self._run(module, run_batch, drop_last=shard is None, task=task)
        ref = self._reference_logps(module, run_batch, targets) if state.loss.needs_reference(fields) else None
        ctx = LossContext(head, targets, shifted, ref)
        ctx.batch = batch  # the whole rows (forward_only reads their spans)
        ctx.shard = shard
        return ctx

    @overload
    def calculate_loss(self, ctx: LossContext, adapter_name: str | None = None) -> LossOutput: ...
    @overload
    def calculate_loss(self, ctx: None = None, adapter_name: str | None = None) -> float | None: ...
    def calculate_loss(
        self, ctx: LossContext | None = None, adapter_name: str | None = None
    ) -> LossOutput | float | None:
        """The loss of `ctx` (forward's LossContext); without one, as twinkle-kit's evaluation loops call
        it after forward_only, that call's loss."""
        if ctx is None:
            return self.last_eval_loss
        return self._state(adapter_name).loss(ctx)

    def backward(self, loss: torch.Tensor, adapter_name: str | None = None) -> bool:
        """Backpropagate loss / accumulation steps; a non-finite loss is not propagated and marks
        the coming step as skipped. Returns whether gradients were accumulated."""
        state = self._state(adapter_name)
        finite = bool(torch.isfinite(loss.detach()).all())
        state.count_micro_batch(finite)
        if not finite:
            logger.warning("non-finite loss %s for adapter %r: the next step is skipped", loss.item(), state.name)
            return False
        scaled = loss / state.gradient_accumulation_steps
        if self.mixed_precision == "fp16":  # fp16 gradients underflow without loss scaling
            if state.grad_scaler is None:
                state.grad_scaler = torch.amp.GradScaler(self.device.type)
            scaled = state.grad_scaler.scale(scaled)
        with compact_heap.gradients_in_one_buffer(self._grad_arenas, state.name, state.params, self._wrapped):
            scaled.backward()
        return True

    def _record(
        self, state: AdapterState, ctx: LossContext, out: LossOutput | None, seconds: float, training: bool
    ) -> None:
        mask = ctx.mask_B_T
        with torch.no_grad():
            correct = int((ctx.head.correct(ctx.targets_B_T) & mask.bool()).sum())
        attention = ctx.batch.get("attention_mask")
        input_tokens = int(attention.sum()) if attention is not None else ctx.batch["input_ids"].numel()
        input_tokens //= self.cp_size  # each cp rank computes its part of the rows
        n_trainable = sum(p.numel() for p in state.params) if training else 0
        flops = step_flops(
            input_tokens,
            ctx.batch["input_ids"].shape[1],
            self._n_matmul(),
            n_trainable,
            self._layers,
            self._q_width,
            backward=training,
        )
        loss = float(out.loss.detach()) if out is not None else None
        loss_tokens, correct = self._data_parallel_sums(int(mask.sum()), correct)
        record = ForwardRecord(
            loss,
            loss_tokens,
            input_tokens,
            correct,
            seconds,
            flops,
            finite=out is None or bool(torch.isfinite(out.loss.detach()).all()),
            extras=out.metrics if out is not None else {},
        )
        for metric in state.metrics(training):
            metric.on_forward(record)

    def _data_parallel_sums(self, *counts: int) -> tuple[int, ...]:
        """Counts over the global micro-batch: the loss is the global one, so its weight in the
        running mean (and token accuracy) must be too, or data-parallel metrics drift from one
        process's."""
        return data_parallel_sums(self.device_mesh, counts)

    def _n_matmul(self) -> int:
        if not hasattr(self, "_n_matmul_cache"):
            self._n_matmul_cache = matmul_params(self.hf_model)[0]
        return self._n_matmul_cache


def _default_processor() -> InputProcessor:
    from twinkle.processor import InputProcessor

    return InputProcessor(padding_side="right")
