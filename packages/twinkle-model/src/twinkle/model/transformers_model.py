"""TransformersModel: a transformers causal LM (optionally with LoRA adapters) driven step by step.

Per-adapter state (optimizer, scheduler, loss, accumulation counter, metrics) lives in
`AdapterState` and the step rule in `twinkle.model.step`, both shared with every engine; this class
only routes calls to the right state and runs the network. Its parts, one concern a module:

- `transformers_core`: loading onto the mesh and device, the adapters and their state, the data-parallel
  wrapping, what a loop sets per adapter (loss, optimizer, scheduler, template, metrics);
- `transformers_pass`: the network pass (forward, calculate_loss, backward, each pass's record);
- `transformers_checkpoints`: save, load, resume_from_checkpoint, push_to_hub;
- here: the calls a training loop makes (forward_backward, forward_only, the step, the metrics).
"""

from __future__ import annotations

import time

import torch

from twinkle.data_format.loss_inputs import merge_loss_inputs
from twinkle.mesh import RemoteClass, remote_method
from twinkle.model import base_dtype as base_dtypes
from twinkle.model import embedding_pass, router_replay
from twinkle.model import inputs as model_inputs
from twinkle.model import step as step_rule
from twinkle.model.embedding_pass import EmbeddingTaskMixin
from twinkle.model.kit import KitModelMixin
from twinkle.model.kit_outputs import merge_ranks, row_logps
from twinkle.model.router_replay import RouterReplayAction
from twinkle.model.strategy import clip_grad_norm, data_parallel_loss, no_sync
from twinkle.model.transformers_checkpoints import TransformersCheckpoints
from twinkle.model.transformers_pass import TransformersPass


def refuse_logits(return_logits: bool) -> None:
    if return_logits:
        raise NotImplementedError(
            "forward_only(return_logits=True): a token pass returns each label's log-prob (`logprobs`), not "
            "[B, T, V] logits; task='embedding' returns its embeddings either way"
        )


class TransformersModel(
    KitModelMixin, EmbeddingTaskMixin, TransformersCheckpoints, TransformersPass, metaclass=RemoteClass
):
    # -- the loop's calls ---------------------------------------------------------------------------
    @remote_method(dispatch="slice", collect=merge_ranks)
    def forward_backward(
        self,
        inputs,
        adapter_name: str | None = None,
        *,
        old_logps=None,
        advantages=None,
        ref_outputs=None,
        micro_batch_size: int | None = None,
        task: str = "causal_lm",
        router_replay_action: RouterReplayAction | str | None = None,
    ) -> dict:
        """Forward, loss and backward on one micro-batch; gradients accumulate until the step.
        twinkle-kit's keywords: old_logps / advantages / ref_outputs become the rows' loss inputs
        (`twinkle.data_format.loss_inputs`); micro_batch_size runs the rows that many at a time;
        router_replay_action=REPLAY_FORWARD routes each token to its row's `routed_experts`
        (`twinkle.model.router_replay`). A token pass also returns twinkle-kit's `logps`, each row's
        label log-probs as one tensor (`twinkle.model.kit_outputs`)."""
        with router_replay.acting(self.router_replay, router_replay_action, inputs):
            return self._forward_backward(
                inputs, adapter_name, old_logps, advantages, ref_outputs, micro_batch_size, task
            )

    def _forward_backward(
        self, inputs, adapter_name, old_logps, advantages, ref_outputs, micro_batch_size: int | None, task: str
    ) -> dict:
        inputs = merge_loss_inputs(inputs, old_logps=old_logps, advantages=advantages, ref_outputs=ref_outputs)
        inputs = embedding_pass.task_inputs(task, inputs)
        if micro_batch_size is not None and not isinstance(inputs, dict) and len(inputs) > micro_batch_size:
            return self.micro_batched_forward_backward(list(inputs), adapter_name, micro_batch_size)
        state = self._state(adapter_name)
        t0 = time.perf_counter()
        accumulate = state.micro_step + 1 < state.gradient_accumulation_steps  # not the window's last
        wrapped = self._activate(state)  # wrapped before the first micro-batch, so it too skips the sync
        with no_sync(wrapped, accumulate):
            ctx = self.forward(inputs, adapter_name, task=task)
            out = self.calculate_loss(ctx, adapter_name)
            logps = row_logps(ctx) if task == "causal_lm" else None  # before backward frees the head
            # under DDP/FSDP2: this rank's share of the global micro-batch loss, which is reported
            local, out.loss = data_parallel_loss(out.loss, state.loss, ctx, self.device_mesh)
            self.backward(local, adapter_name)
        self._record(state, ctx, out, time.perf_counter() - t0, training=True)
        kit = {"logps": logps} if logps is not None else {}
        return {"loss": float(out.loss.detach()), **out.metrics, **kit}

    @remote_method(dispatch="slice", collect=merge_ranks)
    def forward_only(
        self,
        inputs,
        adapter_name: str | None = None,
        *,
        disable_lora: bool = False,
        task: str = "causal_lm",
        return_logits: bool = False,
        router_replay_action: RouterReplayAction | str | None = None,
        micro_batch_size: int | None = None,
    ) -> dict:
        """No-gradient forward: per-row target log-probs (aligned with labels; 0 at position 0 and
        where labels are -100) and the loss when the batch has labels. Counts toward eval metrics.
        On data-parallel ranks the loss is the global batch's and the rows come back in rank order.
        `disable_lora=True` runs the base model (the adapter switched off): a LoRA run's reference.
        `task='embedding'`: each row's embedding instead (twinkle.model.embedding_pass).
        `return_logits` (twinkle-kit's): an embedding pass returns its embeddings either way; a token
        pass returns each label's log-prob, not [B, T, V] logits, so True is refused there.
        `router_replay_action` (`twinkle.model.router_replay`): RECORD also returns `routed_experts`, each
        row's chosen experts [rows, tokens, moe layers, top_k]; REPLAY_FORWARD forces the rows' own.
        A token pass also returns twinkle-kit's `logps` (`twinkle.model.kit_outputs`); `micro_batch_size`
        runs the rows that many at a time, as one call."""
        if micro_batch_size is not None and not isinstance(inputs, dict) and len(inputs) > micro_batch_size:
            kit = dict(disable_lora=disable_lora, task=task, return_logits=return_logits)
            return self.micro_batched_forward_only(
                list(inputs), adapter_name, micro_batch_size, router_replay_action=router_replay_action, **kit
            )
        with router_replay.acting(self.router_replay, router_replay_action, inputs):
            out = self._forward_only(inputs, adapter_name, disable_lora, task, return_logits)
            routed = self.router_replay.routed_experts() if self.router_replay is not None else None
            return {**out, "routed_experts": routed} if routed is not None else out

    def _forward_only(
        self, inputs, adapter_name: str | None, disable_lora: bool, task: str, return_logits: bool
    ) -> dict:
        if task != "causal_lm":
            return self.embedding_forward_only(inputs, adapter_name, task)
        refuse_logits(return_logits)
        if disable_lora:
            return self.forward_only_base(inputs, adapter_name)
        state = self._state(adapter_name)
        t0 = time.perf_counter()
        with torch.no_grad():
            ctx = self.forward(inputs, adapter_name, _grad=False)
            # log-probs are the point; the loss only when this batch carries what the loss needs
            has_inputs = all(f in ctx.fields for f in state.loss.required_fields)
            out = self.calculate_loss(ctx, adapter_name) if has_inputs else None
            if out is not None:
                _, out.loss = data_parallel_loss(out.loss, state.loss, ctx, self.device_mesh)
            logps = ctx.logps_B_T.float()
            if ctx.shard is not None:  # every cp rank returns the whole rows
                logps = ctx.shard.gather(logps)[:, : ctx.batch["input_ids"].shape[1] - 1]
        self._record(state, ctx, out, time.perf_counter() - t0, training=False)
        rows = [[0.0, *logps[b, s : s + n - 1].tolist()] for b, s, n in model_inputs.sequence_spans(ctx.batch)]
        self.last_eval_loss = float(out.loss) if out else None
        return {"loss": self.last_eval_loss, "logprobs": rows, "logps": row_logps(ctx)}

    @remote_method()
    def clip_grad_norm(
        self, max_grad_norm: float = 1.0, norm_type: float = 2.0, adapter_name: str | None = None
    ) -> float:
        return clip_grad_norm(self._state(adapter_name).params, max_grad_norm, norm_type)

    @remote_method()
    def step(self, adapter_name: str | None = None) -> None:
        self._state(adapter_name).require_optimizer().step()

    @remote_method()
    def zero_grad(self, adapter_name: str | None = None) -> None:
        for p in self._state(adapter_name).params:
            p.grad = None

    @remote_method()
    def lr_step(self, adapter_name: str | None = None) -> None:
        state = self._state(adapter_name)
        if state.scheduler is not None:
            state.scheduler.step()

    @remote_method()
    def clip_grad_and_step(
        self,
        max_grad_norm: float | None = 1.0,
        adapter_name: str | None = None,
        *,
        gradient_accumulation_steps: int | None = None,
    ) -> dict:
        """Clip, step the optimizer and scheduler, zero grads — only on an accumulation boundary
        (`twinkle.model.step`). The norm is taken over every shard under DDP, FSDP2 or tp.
        `gradient_accumulation_steps` (twinkle-kit's): the adapter's window is that many micro-batches
        from now on, this call included (`AdapterState.resize_window`)."""
        state = self._state(adapter_name)
        if gradient_accumulation_steps is not None:
            state.resize_window(gradient_accumulation_steps)
        return step_rule.clip_grad_and_step(state, max_grad_norm, clip_grad_norm)

    @remote_method()
    def get_info(self) -> dict:
        """What this model runs as: the frozen base's dtype (`base_dtype`), mixed precision, whether
        this device multiplies bf16 fast, the vocabulary, the LoRA adapters (`adapters`)."""
        return {
            "model_id": self.model_id,
            "base_dtype": base_dtypes.name(next(self.hf_model.parameters()).dtype),
            "mixed_precision": self.mixed_precision,
            "fast_bf16": base_dtypes.fast_bf16(self.device),
            "vocab_size": self.vocab_size,
            "adapters": self.adapter_names,
        }

    @remote_method()
    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]:
        """Metrics since the last call (then reset): loss, token_accuracy, grad_norm, lr,
        tokens_per_s, mfu, skipped_steps, and the loss's own."""
        return step_rule.calculate_metric(self._state(adapter_name), is_training)
