"""The loaded network and its adapters: TransformersModel's construction and per-adapter state.

`TransformersCore` loads the model onto its mesh and device (dtype, precision, compile), holds one
`AdapterState` per LoRA adapter (or the whole model) and routes every call to it (`_state`), and
wraps the model for data parallelism before the first pass (`_activate`). The calls built on it
live beside it: the network pass (`transformers_pass`), save / load (`transformers_checkpoints`),
and the public loop calls (`transformers_model`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, cast

import torch

from twinkle.loss import LOGITS_BUDGET_BYTES
from twinkle.mesh import get_global_mesh, remote_method
from twinkle.metric import METRICS, attention_dims, measure_matmul_peak
from twinkle.model import base_dtype as base_dtypes
from twinkle.model import compact_heap, context_parallel, router_replay, vision
from twinkle.model import compile as compile_layers
from twinkle.model.base import TwinkleModel
from twinkle.model.hf_loading import load_hf_model
from twinkle.model.kit_fsdp import resolve_kit_strategy
from twinkle.model.peft_holes import refuse_peft_holes
from twinkle.model.state import FULL_MODEL, AdapterState
from twinkle.model.strategy import (
    check_ddp_config,
    check_tensor_parallel,
    rebind_parameters,
    resolve_strategy,
    shards_on_wrap,
    wrap,
)
from twinkle.model.structure import with_explicit_targets
from twinkle.patch import PATCHES, AppliedPatch

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import PretrainedConfig

    from twinkle.loss import Loss
    from twinkle.mesh import DeviceMesh
    from twinkle.metric import Metric
    from twinkle.model.optim import OptimizerSpec, SchedulerSpec
    from twinkle.patch import Patch
    from twinkle.processor import InputProcessor
    from twinkle.template import Template

# mixed_precision -> the autocast dtype (None: no autocast)
PRECISIONS = {None: None, "no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class TransformersCore(TwinkleModel):
    """TransformersModel's state: the network, where it runs, and one AdapterState per adapter."""

    def __init__(
        self,
        model_id: str | None = None,
        model_cls: type[Any] | str | None = None,
        config: PretrainedConfig | None = None,
        device_mesh: DeviceMesh | None = None,
        mixed_precision: str | None = None,
        strategy: str | None = None,
        device: str | None = None,
        torch_dtype: torch.dtype | str | None = None,
        compile: bool = False,
        base_dtype: str = "auto",
        ddp_config: dict | None = None,
        enable_router_replay: bool = False,
        fsdp_config: dict | None = None,
        **model_kwargs: Any,
    ) -> None:
        """`compile=True` compiles each decoder layer with torch.compile (`twinkle.model.compile`):
        faster steps after the first, which pay the compile. `base_dtype` ('auto', 'bf16', 'fp32'):
        what the frozen base under LoRA is held and multiplied in (`twinkle.model.base_dtype`; 'auto'
        is bf16 under mixed_precision='bf16', or on hardware with fast bf16 for a base of 100M
        parameters or more); `torch_dtype` instead loads the model in exactly that dtype. `ddp_config`:
        keyword arguments of torch's DistributedDataParallel where the mesh wraps the model in DDP
        (twinkle-kit's; `strategy.DDP_OPTIONS`), e.g. {'find_unused_parameters': True} for a pass that
        leaves parameters unused (task='embedding' skips the output projection). `enable_router_replay`
        (twinkle-kit's): a mixture-of-experts model's passes can record and replay each token's experts
        (`twinkle.model.router_replay`; forward_backward / forward_only's `router_replay_action`).
        twinkle-kit's `strategy='native_fsdp'` is 'fsdp2', with the `fsdp_config` keys it takes
        (`twinkle.model.kit_fsdp`)."""
        if mixed_precision not in PRECISIONS:
            raise ValueError(f"unknown mixed_precision {mixed_precision!r}; expected one of {list(PRECISIONS)}")
        base_dtypes.check(base_dtype)
        if torch_dtype is not None and base_dtype != "auto":
            raise ValueError(f"give torch_dtype ({torch_dtype}) or base_dtype ({base_dtype!r}), not both")
        self.model_id, self.mixed_precision = model_id, mixed_precision
        self.device_mesh = device_mesh if device_mesh is not None else get_global_mesh()
        strategy = resolve_kit_strategy(strategy, fsdp_config, self.device_mesh)
        self.strategy = resolve_strategy(strategy, self.device_mesh)  # refuses unimplemented mesh dims
        self.ddp_options = check_ddp_config(ddp_config, self.strategy, self.device_mesh)
        self.hf_model, self.model_path = load_hf_model(model_id, model_cls, config, torch_dtype, **model_kwargs)
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
        self.router_replay = router_replay.install(self.hf_model, self.cp_size) if enable_router_replay else None
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
        # an nn.Embedding's int; nn.Module.__getattr__ types every attribute as Tensor | Module
        self.vocab_size = cast("int", self.hf_model.get_input_embeddings().num_embeddings)
        self.last_eval_loss: float | None = None  # forward_only's, for calculate_loss() without a context

    # -- adapters and per-adapter state -------------------------------------------------------
    @property
    def adapter_names(self) -> list[str]:
        return [n for n in self.states if n != FULL_MODEL]

    @remote_method()
    def add_adapter_to_model(
        self,
        adapter_name: str,
        config: LoraConfig,
        gradient_accumulation_steps: int = 1,
        *,
        train_vision: vision.TrainVision = (),
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

    # -- what a loop sets per adapter -----------------------------------------------------------
    @remote_method()
    def set_loss(self, loss: str | type[Loss] | Loss, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._state(adapter_name).set_loss(loss, **kwargs)

    @remote_method()
    def set_optimizer(
        self, optimizer_cls: OptimizerSpec = "AdamW", adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        self._state(adapter_name).set_optimizer(optimizer_cls, **kwargs)

    @remote_method()
    def set_lr_scheduler(self, scheduler_cls: SchedulerSpec, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._state(adapter_name).set_scheduler(scheduler_cls, **kwargs)

    @remote_method()
    def set_template(
        self, template: str | type | Template = "Template", adapter_name: str | None = None, **kwargs: Any
    ) -> None:
        if isinstance(template, (str, type)):
            import twinkle.template as templates

            cls = getattr(templates, template) if isinstance(template, str) else template
            kwargs.setdefault("model_id", self.model_path or self.model_id)
            template = cls(**kwargs)
        self._state(adapter_name).template = template

    @remote_method()
    def set_processor(
        self,
        processor: str | type | InputProcessor = "InputProcessor",
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(processor, (str, type)):
            import twinkle.processor as processors

            processor = (getattr(processors, processor) if isinstance(processor, str) else processor)(**kwargs)
        self._state(adapter_name).processor = processor

    @remote_method()
    def add_metric(
        self,
        metric: str | type[Metric] | Metric,
        is_training: bool = True,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self._state(adapter_name).metrics(is_training).append(METRICS.create(metric, **kwargs))

    def apply_patch(self, patch: str | type[Patch] | Patch, **kwargs: Any) -> AppliedPatch:
        patch = PATCHES.create(patch, **kwargs)
        patch.apply(self)
        return AppliedPatch(patch, self)
