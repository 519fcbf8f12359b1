"""TransformersModel: a transformers causal LM (optionally with LoRA adapters) driven step by step.

Per-adapter state (optimizer, scheduler, loss, accumulation counter, metrics) lives in
`AdapterState` and the step rule in `twinkle.model.step`, both shared with every engine; this class
only routes calls to the right state and runs the network.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from pathlib import Path

import torch

from twinkle.data_format.loss_inputs import merge_loss_inputs
from twinkle.loss import LOGITS_BUDGET_BYTES, EmbeddingHead, LogitsHead, LossContext, TokenHead
from twinkle.mesh import RemoteClass, get_global_mesh, remote_method
from twinkle.metric import METRICS, ForwardRecord, attention_dims, matmul_params, measure_matmul_peak, step_flops
from twinkle.model import base_dtype as base_dtypes
from twinkle.model import checkpoint, compact_heap, context_parallel, embedding_pass, output_projection, vision
from twinkle.model import compile as compile_layers
from twinkle.model import inputs as model_inputs
from twinkle.model import step as step_rule
from twinkle.model.base import TwinkleModel
from twinkle.model.embedding_pass import EmbeddingTaskMixin
from twinkle.model.kit import KitModelMixin, progress, save_target
from twinkle.model.peft_holes import refuse_peft_holes
from twinkle.model.state import FULL_MODEL, AdapterState
from twinkle.model.strategy import (
    barrier,
    check_ddp_config,
    check_tensor_parallel,
    clip_grad_norm,
    data_parallel_loss,
    data_parallel_size,
    data_parallel_sums,
    full_tensor,
    is_main_process,
    local_tensor,
    no_sync,
    rebind_parameters,
    resolve_strategy,
    shards_on_wrap,
    wrap,
)
from twinkle.model.structure import with_explicit_targets
from twinkle.patch import PATCHES, AppliedPatch

logger = logging.getLogger(__name__)
PRECISIONS = {None: None, "no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _load_hf_model(model_id, model_cls, config, torch_dtype, **kwargs):
    import transformers

    if isinstance(model_cls, str):
        model_cls = getattr(transformers, model_cls)
    model_cls = model_cls or transformers.AutoModelForCausalLM
    if model_id is None:
        if config is None:
            raise ValueError("give model_id, or model_cls with config")
        if hasattr(model_cls, "from_config"):
            return model_cls.from_config(config, dtype=torch_dtype or torch.float32), None
        return model_cls(config), None
    from twinkle.hub import resolve_model_path

    path = resolve_model_path(model_id)
    if model_cls is transformers.AutoModelForCausalLM and hasattr(
        config or transformers.AutoConfig.from_pretrained(path), "vision_config"
    ):  # a vision-language checkpoint (Qwen2.5-VL...): AutoModelForCausalLM does not map it
        model_cls = transformers.AutoModelForImageTextToText
    # dtype 'auto': as stored (a bf16 checkpoint is never upcast only to be cast down again)
    return model_cls.from_pretrained(path, config=config, dtype=torch_dtype or "auto", **kwargs), path


class TransformersModel(KitModelMixin, EmbeddingTaskMixin, TwinkleModel, metaclass=RemoteClass):
    def __init__(
        self,
        model_id: str | None = None,
        model_cls=None,
        config=None,
        device_mesh=None,
        mixed_precision: str | None = None,
        strategy: str | None = None,
        device: str | None = None,
        torch_dtype: torch.dtype | str | None = None,
        compile: bool = False,
        base_dtype: str = "auto",
        ddp_config: dict | None = None,
        **model_kwargs,
    ):
        """`compile=True` compiles each decoder layer with torch.compile (`twinkle.model.compile`):
        faster steps after the first, which pay the compile. `base_dtype` ('auto', 'bf16', 'fp32'):
        what the frozen base under LoRA is held and multiplied in (`twinkle.model.base_dtype`; 'auto'
        is bf16 under mixed_precision='bf16', or on hardware with fast bf16 for a base of 100M
        parameters or more); `torch_dtype` instead loads the model in exactly that dtype. `ddp_config`:
        keyword arguments of torch's DistributedDataParallel where the mesh wraps the model in DDP
        (twinkle-kit's; `strategy.DDP_OPTIONS`), e.g. {'find_unused_parameters': True} for a pass that
        leaves parameters unused (task='embedding' skips the output projection)."""
        if mixed_precision not in PRECISIONS:
            raise ValueError(f"unknown mixed_precision {mixed_precision!r}; expected one of {list(PRECISIONS)}")
        base_dtypes.check(base_dtype)
        if torch_dtype is not None and base_dtype != "auto":
            raise ValueError(f"give torch_dtype ({torch_dtype}) or base_dtype ({base_dtype!r}), not both")
        self.model_id, self.mixed_precision = model_id, mixed_precision
        self.device_mesh = device_mesh if device_mesh is not None else get_global_mesh()
        self.strategy = resolve_strategy(strategy, self.device_mesh)  # refuses unimplemented mesh dims
        self.ddp_options = check_ddp_config(ddp_config, self.strategy, self.device_mesh)
        self.hf_model, self.model_path = _load_hf_model(model_id, model_cls, config, torch_dtype, **model_kwargs)
        check_tensor_parallel(self.device_mesh, self.hf_model)  # heads divisible by tp, every weight planned
        self.cp_size = self.device_mesh.get_size("cp") if self.device_mesh is not None else 1
        if self.cp_size > 1:
            context_parallel.enable(self.hf_model)  # attention that gathers K/V over the cp group
        if device is None:
            device = "cuda" if self.device_mesh.resolved_device_type == "cuda" else "cpu"
        self.device = torch.device(device)
        self._half_base = False  # the base was put in bf16 by base_dtype (upcast if the whole model trains)
        if torch_dtype is None:
            n_params = sum(p.numel() for p in self.hf_model.parameters())
            dtype = base_dtypes.resolve(base_dtype, mixed_precision, self.device, n_params)
            base_dtypes.cast_parameters(self.hf_model, dtype)
            self._half_base = dtype != torch.float32
        if mixed_precision == "fp16" and self.device.type != "cuda":
            raise ValueError(
                f"mixed_precision='fp16' needs CUDA (its loss scaling is torch.amp's CUDA GradScaler, "
                f"and fp16 matmuls on {self.device.type} are ~100x slower): use 'bf16' or None here"
            )
        self.hf_model.to(self.device)
        if compile:
            tp_size = self.device_mesh.get_size("tp") if self.device_mesh is not None else 1
            compile_layers.check_compilable(self.device.type, self.cp_size, tp_size)
            compile_layers.compile_layers(self.hf_model)
        self.peft_model = None  # set by the first add_adapter_to_model
        self._wrapped = None  # the DDP/FSDP2 module once wrapped
        self.head_chunk_size: int | None = None  # set by the ChunkedCrossEntropy patch
        # a pass whose logits would be larger runs its unembedding in chunks (twinkle.loss.ChunkedHead)
        self.logits_budget_bytes = LOGITS_BUDGET_BYTES
        self.states: dict[str, AdapterState] = {}
        self._grad_arenas: dict[str, compact_heap.GradArena] = {}  # gradients kept in one buffer per adapter
        compute_dtype = PRECISIONS[mixed_precision] or next(self.hf_model.parameters()).dtype
        self.peak_flops = measure_matmul_peak(self.device, compute_dtype)
        self._layers, self._q_width = attention_dims(self.hf_model.config)
        self.vocab_size = self.hf_model.get_input_embeddings().num_embeddings
        self.last_eval_loss: float | None = None  # forward_only's, for calculate_loss() without a context

    # -- adapters and per-adapter state -----------------------------------------------------
    @property
    def adapter_names(self) -> list[str]:
        return [n for n in self.states if n != FULL_MODEL]

    @remote_method()
    def add_adapter_to_model(
        self, adapter_name: str, config, gradient_accumulation_steps: int = 1, *, train_vision=()
    ) -> None:
        """A peft adapter; ``train_vision`` (``"projector"``, ``"tower"``) also trains those vision
        parts full-parameter, as a per-adapter copy (see ``twinkle.model.vision``)."""
        from peft import get_peft_model

        from twinkle.model import lora_fused

        config = with_explicit_targets(self.hf_model, config)  # 'all-linear' from the model's structure
        config = vision.with_vision_modules(self.hf_model, config, train_vision)
        refuse_peft_holes(self.hf_model, config)  # peft's MoE rewrite would drop dense / shared-expert MLPs
        if not adapter_name or adapter_name in self.states:
            raise ValueError(f"adapter name {adapter_name!r} is empty or already used; existing: {self.adapter_names}")
        if self._wrapped is not None and shards_on_wrap(self.strategy, self.device_mesh):
            raise RuntimeError("add every adapter before the first forward: FSDP2 has already sharded the model")
        if self.states.get(FULL_MODEL) and self.states[FULL_MODEL].optimizer is not None:
            raise RuntimeError("the whole model is already being trained; add adapters before set_optimizer")
        self.states.pop(FULL_MODEL, None)
        if self.peft_model is None:
            with warnings.catch_warnings():
                # peft reads transformers 5's deprecated `is_gradient_checkpointing`: not ours to fix,
                # and not worth a warning in every user's output.
                warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
                self.peft_model = get_peft_model(self.hf_model, config, adapter_name=adapter_name)
        else:
            self.peft_model.add_adapter(adapter_name, config)
        if lora_fused.fits(self):  # one accumulation for LoRA on a half-precision base (fp32: peft's own)
            lora_fused.fuse(self.peft_model)
        marker = f".{adapter_name}."
        params = [(n, p) for n, p in self.peft_model.named_parameters() if marker in n]
        self.states[adapter_name] = AdapterState.from_named(
            adapter_name, params, peak_flops=self.peak_flops, gradient_accumulation_steps=gradient_accumulation_steps
        )
        self._wrapped = None  # the parameter set changed: wrap again on the next forward

    def _state(self, adapter_name: str | None) -> AdapterState:
        if adapter_name is None:
            names = self.adapter_names
            if len(names) > 1:
                raise ValueError(f"several adapters exist {names}: pass adapter_name=")
            if names:
                return self.states[names[0]]
            if FULL_MODEL not in self.states:
                if self._half_base:  # every weight trains now: fp32 master weights, not a bf16 base
                    base_dtypes.cast_parameters(self.hf_model, torch.float32)
                    self._half_base = False
                    compute = PRECISIONS[self.mixed_precision] or torch.float32
                    self.peak_flops = measure_matmul_peak(self.device, compute)
                params = [(n, p) for n, p in self.hf_model.named_parameters() if p.requires_grad]
                self.states[FULL_MODEL] = AdapterState.from_named(FULL_MODEL, params, peak_flops=self.peak_flops)
            return self.states[FULL_MODEL]
        if adapter_name not in self.states:
            raise ValueError(f"unknown adapter {adapter_name!r}; existing: {self.adapter_names}")
        return self.states[adapter_name]

    def _activate(self, state: AdapterState) -> torch.nn.Module:
        if self.peft_model is not None and self.peft_model.active_adapter != state.name:
            self.peft_model.set_adapter(state.name)
        if self._wrapped is None:
            self._wrapped = wrap(
                self.peft_model or self.hf_model, self.strategy, self.device_mesh, self.hf_model, self.ddp_options
            )
            rebind_parameters(self.peft_model or self.hf_model, self.states.values())  # FSDP2 swapped them
        return self._wrapped

    @remote_method()
    def set_loss(self, loss, adapter_name: str | None = None, **kwargs) -> None:
        self._state(adapter_name).set_loss(loss, **kwargs)

    @remote_method()
    def set_optimizer(self, optimizer_cls="AdamW", adapter_name: str | None = None, **kwargs) -> None:
        self._state(adapter_name).set_optimizer(optimizer_cls, **kwargs)

    @remote_method()
    def set_lr_scheduler(self, scheduler_cls, adapter_name: str | None = None, **kwargs) -> None:
        self._state(adapter_name).set_scheduler(scheduler_cls, **kwargs)

    @remote_method()
    def set_template(self, template="Template", adapter_name: str | None = None, **kwargs) -> None:
        if isinstance(template, (str, type)):
            import twinkle.template as templates

            cls = getattr(templates, template) if isinstance(template, str) else template
            kwargs.setdefault("model_id", self.model_path or self.model_id)
            template = cls(**kwargs)
        self._state(adapter_name).template = template

    @remote_method()
    def set_processor(self, processor="InputProcessor", adapter_name: str | None = None, **kwargs) -> None:
        if isinstance(processor, (str, type)):
            import twinkle.processor as processors

            processor = (getattr(processors, processor) if isinstance(processor, str) else processor)(**kwargs)
        self._state(adapter_name).processor = processor

    @remote_method()
    def add_metric(self, metric, is_training: bool = True, adapter_name: str | None = None, **kwargs) -> None:
        self._state(adapter_name).metrics(is_training).append(METRICS.create(metric, **kwargs))

    def apply_patch(self, patch, **kwargs) -> AppliedPatch:
        patch = PATCHES.create(patch, **kwargs)
        patch.apply(self)
        return AppliedPatch(patch, self)

    # -- compute ------------------------------------------------------------------------------
    def _prepare(self, inputs, state: AdapterState):
        if state.template is None and model_inputs.has_trajectories(inputs):
            self.set_template(adapter_name=state.name or None)  # the model's own chat template
        rows = model_inputs.as_rows(inputs, state.template)
        processor = state.processor if state.processor is not None else _default_processor()
        batch, fields = model_inputs.collate(rows, processor)
        model_inputs.check_vocab(batch, self.vocab_size)  # before any kernel sees the ids
        batch = {k: v.to(self.device) for k, v in batch.items()}
        return batch, {k: v.to(self.device) for k, v in fields.items()}

    def _autocast(self):
        dtype = PRECISIONS[self.mixed_precision]
        return torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()

    def _run(self, module, batch, drop_last: bool = True, task: str = "causal_lm") -> TokenHead:
        model_kwargs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
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

    def _reference_logps(self, module, batch, targets_B_T):
        if self.peft_model is None:
            return None  # the loss explains that it needs `ref_logprobs`
        training = module.training
        module.eval()  # the reference policy draws no dropout, also inside a training pass
        try:
            with torch.no_grad(), self.peft_model.disable_adapter():
                return self._run(module, batch, drop_last=self.cp_size == 1).target_logps(targets_B_T)
        finally:
            module.train(training)

    def _shard(self, batch, targets, fields, loss):
        """(model inputs, targets, fields, Shard or None): this cp rank's part of the sequence."""
        if self.cp_size == 1:
            return batch, targets, fields, None
        context_parallel.check_loss(loss)
        mesh = self.device_mesh
        return context_parallel.shard_batch(
            batch, targets, fields, mesh.get_group("cp"), mesh.get_rank("cp"), self.cp_size
        )

    def forward(
        self, inputs, adapter_name: str | None = None, *, _grad: bool = True, task: str = "causal_lm"
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

    def calculate_loss(self, ctx: LossContext | None = None, adapter_name: str | None = None):
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

    def _record(self, state, ctx, out, seconds, training: bool) -> None:
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
            finite=loss is None or bool(torch.isfinite(out.loss.detach()).all()),
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

    @remote_method(dispatch="slice", collect="mean")
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
    ) -> dict:
        """Forward, loss and backward on one micro-batch; gradients accumulate until the step.
        twinkle-kit's keywords: old_logps / advantages / ref_outputs become the rows' loss inputs
        (`twinkle.data_format.loss_inputs`); micro_batch_size runs the rows that many at a time."""
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
            # under DDP/FSDP2: this rank's share of the global micro-batch loss, which is reported
            local, out.loss = data_parallel_loss(out.loss, state.loss, ctx, self.device_mesh)
            self.backward(local, adapter_name)
        self._record(state, ctx, out, time.perf_counter() - t0, training=True)
        return {"loss": float(out.loss.detach()), **out.metrics}

    @remote_method(dispatch="slice", collect="merge")
    def forward_only(
        self, inputs, adapter_name: str | None = None, *, disable_lora: bool = False, task: str = "causal_lm"
    ) -> dict:
        """No-gradient forward: per-row target log-probs (aligned with labels; 0 at position 0 and
        where labels are -100) and the loss when the batch has labels. Counts toward eval metrics.
        On data-parallel ranks the loss is the global batch's and the rows come back in rank order.
        `disable_lora=True` runs the base model (the adapter switched off): a LoRA run's reference.
        `task='embedding'`: each row's embedding instead (twinkle.model.embedding_pass)."""
        if task != "causal_lm":
            return self.embedding_forward_only(inputs, adapter_name, task)
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
        return {"loss": self.last_eval_loss, "logprobs": rows}

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
        this device multiplies bf16 fast, the vocabulary."""
        return {
            "model_id": self.model_id,
            "base_dtype": base_dtypes.name(next(self.hf_model.parameters()).dtype),
            "mixed_precision": self.mixed_precision,
            "fast_bf16": base_dtypes.fast_bf16(self.device),
            "vocab_size": self.vocab_size,
        }

    @remote_method()
    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]:
        """Metrics since the last call (then reset): loss, token_accuracy, grad_norm, lr,
        tokens_per_s, mfu, skipped_steps, and the loss's own."""
        return step_rule.calculate_metric(self._state(adapter_name), is_training)

    # -- checkpoints (twinkle.model.checkpoint) -------------------------------------------------
    def _tokenizer(self, state):
        template = state.template
        return getattr(template, "tokenizer", None)

    @remote_method()
    def save(
        self,
        path,
        adapter_name: str | None = None,
        save_training_state: bool = False,
        data_position: int | None = None,
        *,
        output_dir: str | None = None,
        save_optimizer: bool | None = None,
        consumed_train_samples: int | None = None,
    ) -> str:
        """A PEFT folder for a LoRA adapter, a `save_pretrained` folder for the whole model;
        with `save_training_state`, also optimizer, scheduler, RNG and data position. twinkle-kit's
        keywords: `output_dir` (the folder `path` is written in), `save_optimizer`
        (= save_training_state), `consumed_train_samples` (kept with the training state)."""
        from peft import get_peft_model_state_dict

        folder, save_training_state = save_target(path, save_training_state, output_dir, save_optimizer)
        path = Path(folder)
        state = self._state(adapter_name)
        if state.name == FULL_MODEL:
            module = getattr(self._wrapped, "module", self._wrapped)  # DDP keeps the model under .module
            source = module if module is self.hf_model else self.hf_model
            weights = {k: full_tensor(v).detach().to("cpu") for k, v in source.state_dict().items()}
            if is_main_process():
                checkpoint.save_full(self.hf_model, weights, path, self._tokenizer(state))
        else:
            peft_model = self.peft_model
            assert peft_model is not None  # a LoRA adapter exists, so the peft wrapper does
            # save_embedding_layers=False: with lm_head among the targets peft would otherwise also
            # write the frozen base head (vocab x hidden) into the adapter, which no sampler expects
            lora = get_peft_model_state_dict(peft_model, adapter_name=state.name, save_embedding_layers=False)
            weights = {k: full_tensor(v) for k, v in lora.items()}
            if is_main_process():
                checkpoint.save_adapter(
                    path,
                    peft_model.peft_config[state.name],
                    weights,
                    checkpoint.base_model_id(self.model_id, self.model_path),
                )
        if save_training_state:  # every rank: sharded optimizer state is gathered, rank 0 writes
            checkpoint.save_adapter_state(
                path, state, data_position, write=is_main_process(), consumed_train_samples=consumed_train_samples
            )
        barrier()
        return str(path)

    @remote_method()
    def push_to_hub(self, repo_id: str, adapter_name: str | None = None, **kwargs) -> str | None:
        """Upload what `save` writes to `org/name` (Hugging Face), `hf://org/name` or `ms://org/name`;
        private=, token=, endpoint=, commit_message= as in twinkle.model.hub_upload.push_to_hub."""
        from twinkle.model.hub_upload import push_to_hub

        return push_to_hub(self, repo_id, adapter_name, **kwargs)

    @remote_method()
    def load(self, path, adapter_name: str | None = None) -> None:
        """Load weights saved by `save` into the adapter (or the whole model); a LoRA folder for an
        adapter that does not exist yet creates it from the folder's adapter_config.json."""
        from peft import set_peft_model_state_dict

        path = Path(path)
        if self._wrapped is not None and self.strategy == "fsdp2" and data_parallel_size(self.device_mesh) > 1:
            raise RuntimeError(
                "load / resume_from_checkpoint before the first forward_backward under FSDP2: "
                "the weights are sharded now; build a new TransformersModel and load into it"
            )
        if checkpoint.is_adapter_folder(path) and (
            adapter_name not in self.states if adapter_name else not self.adapter_names
        ):
            config, _ = checkpoint.load_adapter(path)
            self.add_adapter_to_model(adapter_name or "default", config)
        state = self._state(adapter_name)
        if state.name == FULL_MODEL:
            checkpoint.load_full(self.hf_model, path)
            return
        _, tensors = checkpoint.load_adapter(path)
        result = set_peft_model_state_dict(self.peft_model, tensors, adapter_name=state.name)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"checkpoint {path} does not fit adapter {state.name!r}: unexpected keys {unexpected[:5]}")

    @remote_method()
    def resume_from_checkpoint(self, path, adapter_name: str | None = None, *, resume_only_model: bool = False) -> dict:
        """Weights plus training state; returns {'data_position', 'optimizer_steps', 'micro_step'}: skip
        that many batches of the data loader to continue exactly where the saved run was (plus
        twinkle-kit's 'cur_step' and 'consumed_train_samples'). `resume_only_model=True` loads the
        weights only and reports the saved counters without restoring them."""
        self.load(path, adapter_name)
        state = self._state(adapter_name)
        if resume_only_model:
            return progress(checkpoint.read_counters(path), state.gradient_accumulation_steps)
        self._activate(state)  # wrapped first: under FSDP2 the moments load into their shards
        return progress(checkpoint.resume_adapter_state(path, state), state.gradient_accumulation_steps)


def _default_processor():
    from twinkle.processor import InputProcessor

    return InputProcessor(padding_side="right")
