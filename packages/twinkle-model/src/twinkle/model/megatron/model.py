"""MegatronModel: the TwinkleModel training API on megatron-core's GPTModel (CUDA).

Built from an HF Qwen2/Qwen3 checkpoint (weights mapped by `convert`), parallel over the
DeviceMesh: tp -> tensor parallel, pp -> pipeline stages, dp x fsdp -> Megatron data parallel. The
twinkle rank layout (pp, dp, fsdp, cp, tp; tp fastest) is Megatron's default order (tp-cp-dp-pp),
so a rank's coordinates agree in both. One forward_backward is one micro-batch through Megatron's
schedule; gradients accumulate in Megatron's grad buffers and are reduced only on the call that
ends an accumulation window (finalize_model_grads), as TransformersModel's no_sync does.

Full-parameter training only: LoRA adapters are TransformersModel's (add_adapter_to_model raises).
Context parallelism needs Transformer Engine attention, which the extra does not install: cp > 1 is
refused with that reason. The losses are twinkle.loss (full-vocabulary logits, gathered over tp).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import twinkle.model.megatron.convert as convert
from twinkle.loss import LogitsHead, LossContext, create_loss
from twinkle.mesh import RemoteClass, get_global_mesh, remote_method
from twinkle.metric import ForwardRecord
from twinkle.model import inputs as model_inputs
from twinkle.model import step as step_rule
from twinkle.model.base import TwinkleModel, refuse
from twinkle.model.optim import build_scheduler
from twinkle.model.state import FULL_MODEL, AdapterState
from twinkle.model.strategy import barrier, is_main_process

if TYPE_CHECKING:
    from peft import LoraConfig

    from twinkle.data_format.loss_inputs import Rows
    from twinkle.loss.base import Loss
    from twinkle.mesh import DeviceMesh
    from twinkle.model.optim import OptimizerSpec, SchedulerSpec

EXTRA_HINT = "MegatronModel needs megatron-core: pip install 'twinkle-model[megatron]'"


def require_megatron() -> ModuleType:
    """megatron.core, or an ImportError naming the extra that provides it."""
    try:
        import megatron.core as mcore
    except ImportError as e:
        raise ImportError(f"{EXTRA_HINT} ({e})") from e
    return mcore


_OPTIMIZERS = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}  # megatron's 'adam' decays decoupled (AdamW)


def _init_parallel(mesh: DeviceMesh, seed: int) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if mesh.get_size("cp") > 1:
        raise ValueError(
            "MegatronModel: context parallelism (cp_size > 1) needs Transformer Engine attention, "
            "which twinkle-model[megatron] does not install; use cp_size=1"
        )
    if not dist.is_initialized() and mesh.world_size == 1:  # one GPU, no launcher: a private group
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    elif not dist.is_initialized():
        from twinkle.mesh import initialize

        initialize(mode="local", global_device_mesh=mesh)  # torchrun: joins the job's group
    mesh.check_world_size(dist.get_world_size(), "torch.distributed world size")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=mesh.get_size("tp"),
            pipeline_model_parallel_size=mesh.get_size("pp"),
            context_parallel_size=mesh.get_size("cp"),
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _read_hf_folder(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


class MegatronModel(TwinkleModel, metaclass=RemoteClass):
    def __init__(
        self,
        model_id: str,
        device_mesh: DeviceMesh | None = None,
        mixed_precision: str | None = None,
        seed: int = 42,
    ) -> None:
        require_megatron()
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig
        from transformers import AutoConfig

        from twinkle.hub import resolve_model_path

        if mixed_precision not in (None, "no", "fp32", "bf16"):
            raise ValueError(f"MegatronModel mixed_precision must be None/'fp32'/'bf16', got {mixed_precision!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("MegatronModel needs CUDA: megatron-core's DDP, optimizer and schedules hard-code it")
        self.mesh = device_mesh if device_mesh is not None else get_global_mesh()
        self.model_path = resolve_model_path(model_id)
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        _init_parallel(self.mesh, seed)
        self.bf16 = mixed_precision == "bf16"
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.config = TransformerConfig(
            **convert.transformer_config_kwargs(self.hf_config),
            activation_func=torch.nn.functional.silu,
            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
            bf16=self.bf16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
        )
        spec = get_gpt_layer_local_spec(qk_layernorm=self.config.qk_layernorm, normalization="RMSNorm")
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        self.pp_rank, self.pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        gpt = GPTModel(
            self.config,
            spec,
            pre_process=self.pp_rank == 0,
            post_process=self.pp_rank == self.pp_size - 1,
            **convert.gpt_model_kwargs(self.hf_config),
        ).to(device="cuda", dtype=dtype)
        self.gpt = gpt
        self._load_hf_state(_read_hf_folder(Path(self.model_path)))
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        self.module = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=gpt)
        self.vocab_size = self.hf_config.vocab_size
        self.optimizer = None
        self.schedulers: list = []
        self.state = AdapterState.from_named(FULL_MODEL, gpt.named_parameters(), peak_flops=0.0)

    # -- configuration --------------------------------------------------------------------------
    def _check_adapter(self, adapter_name: str | None) -> None:
        if adapter_name not in (None, FULL_MODEL):
            raise ValueError(f"MegatronModel trains the whole model; it has no adapter {adapter_name!r}")

    @remote_method()
    def add_adapter_to_model(
        self,
        adapter_name: str,  # noqa: ARG002 - TwinkleModel's signature; refused
        config: LoraConfig,  # noqa: ARG002
        gradient_accumulation_steps: int = 1,  # noqa: ARG002
    ) -> None:
        raise refuse(self, "train LoRA adapters (it trains full parameters)", "use TransformersModel or MultiLoraModel")

    @remote_method()
    def set_gradient_accumulation_steps(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {steps}")
        self.state.gradient_accumulation_steps = steps

    @remote_method()
    def set_loss(self, loss: str | type[Loss] | Loss, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._check_adapter(adapter_name)
        self.state.loss = create_loss(loss, **kwargs)

    @remote_method()
    def set_optimizer(
        self,
        optimizer_cls: OptimizerSpec = "AdamW",
        adapter_name: str | None = None,
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        momentum: float = 0.0,
        max_grad_norm: float = 1.0,
    ) -> None:  # ty: ignore[incompatible-method-override] - a keyword it does not implement is a TypeError naming it
        """Megatron's optimizer ('AdamW'/'Adam' -> megatron adam, 'SGD'); fp32 main weights under bf16."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self._check_adapter(adapter_name)
        name = _OPTIMIZERS.get(str(optimizer_cls).lower())
        if name is None:
            raise ValueError(f"unknown optimizer {optimizer_cls!r} for MegatronModel; registered: AdamW, Adam, SGD")
        config = OptimizerConfig(
            optimizer=name,
            lr=lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_eps=eps,
            sgd_momentum=momentum,
            clip_grad=max_grad_norm,
            bf16=self.bf16,
            params_dtype=self.config.params_dtype,
        )
        self.optimizer = get_megatron_optimizer(config, [self.module])
        self.schedulers = []

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        if self.optimizer is None:
            raise ValueError("MegatronModel has no optimizer: call set_optimizer(...) first")
        chained = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        return [o.optimizer for o in chained]

    @remote_method()
    def set_lr_scheduler(self, scheduler_cls: SchedulerSpec, adapter_name: str | None = None, **kwargs: Any) -> None:
        self._check_adapter(adapter_name)
        if self.optimizer is None:
            raise ValueError("call set_optimizer(...) before set_lr_scheduler(...)")
        self.schedulers = [build_scheduler(scheduler_cls, opt, **kwargs) for opt in self._torch_optimizers()]

    # -- compute --------------------------------------------------------------------------------
    def _batch(self, inputs: Rows) -> tuple[dict, dict]:
        rows = model_inputs.as_rows(inputs, self.state.template)
        batch, fields = model_inputs.collate(rows, None)
        model_inputs.check_vocab(batch, self.vocab_size)
        return {k: v.cuda() for k, v in batch.items()}, {k: v.cuda() for k, v in fields.items()}

    @staticmethod
    def _attention_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Megatron's boolean mask [B, 1, T, T], True = may not attend: the future and padding keys.
        Given explicitly (megatron builds its default causal mask on 'cuda' by name)."""
        ids_B_T = batch["input_ids"]
        T = ids_B_T.shape[1]
        future_T_T = torch.triu(torch.ones(T, T, dtype=torch.bool, device=ids_B_T.device), 1)
        keys_B_T = (
            batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones_like(ids_B_T, dtype=torch.bool)
        )
        return future_T_T[None, None] | ~keys_B_T[:, None, None, :]

    def _full_logits(self, logits_B_T_V: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return logits_B_T_V
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(logits_B_T_V)  # vocabulary shards -> full rows

    def _run_schedule(
        self, batch: dict[str, torch.Tensor], fields: dict[str, torch.Tensor], forward_only: bool, boundary: bool
    ) -> dict:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        targets_B_T = batch["labels"][:, 1:]
        seen: dict = {}
        scale = 1.0 / self.state.gradient_accumulation_steps

        def loss_func(logits_B_T_V: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            ctx = LossContext(
                LogitsHead(self._full_logits(logits_B_T_V)[:, :-1].float()),
                targets_B_T,
                model_inputs.shift_fields(fields),
            )
            out = self.state.loss(ctx)
            seen.update(loss=out.loss.detach(), ctx=ctx, metrics=out.metrics)
            # a non-finite loss poisons only gradients that clip_grad_and_step then drops (step skipped)
            return out.loss * scale, {"loss": out.loss.detach()}

        def forward_step(
            data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
        ) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]]:
            b = next(data_iterator)
            T = b["input_ids"].shape[1]
            positions_B_T = torch.arange(T, device=b["input_ids"].device)[None].expand_as(b["input_ids"])
            return model(b["input_ids"], positions_B_T, self._attention_mask(b)), loss_func

        self.config.finalize_model_grads_func = finalize_model_grads if boundary else None
        context = self.module.no_sync() if not (boundary or forward_only) else contextlib.nullcontext()
        with context:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter([batch]),
                model=[self.module],
                num_microbatches=1,
                seq_length=batch["input_ids"].shape[1],
                micro_batch_size=batch["input_ids"].shape[0],
                forward_only=forward_only,
            )
        return self._broadcast_from_last_stage(seen)

    def _broadcast_from_last_stage(self, seen: dict) -> dict:
        """The loss lives on the last pipeline stage; every rank reports it."""
        from megatron.core import parallel_state as ps

        value = torch.tensor([float(seen["loss"]) if "loss" in seen else 0.0], device="cuda")
        if self.pp_size > 1:
            dist.broadcast(
                value, ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
            )
        return {"loss": float(value), **seen.get("metrics", {}), "_ctx": seen.get("ctx")}

    def _record(self, result: dict, batch: dict[str, torch.Tensor], seconds: float, training: bool) -> bool:
        ctx = result.pop("_ctx")
        mask = batch["labels"][:, 1:] != -100
        correct = int(((ctx.head.argmax() == ctx.targets_B_T) & mask).sum()) if ctx is not None else 0
        finite = bool(torch.isfinite(torch.tensor(result["loss"])))
        record = ForwardRecord(
            result["loss"],
            int(mask.sum()),
            int(batch.get("attention_mask", batch["input_ids"]).bool().sum()),
            correct,
            seconds,
            0.0,
            finite=finite,
            extras={k: v for k, v in result.items() if k != "loss"},
        )
        for metric in self.state.metrics(training):
            metric.on_forward(record)
        return finite

    @remote_method(dispatch="slice", collect="mean")
    def forward_backward(self, inputs: Rows, adapter_name: str | None = None) -> dict:
        self._check_adapter(adapter_name)
        t0 = time.perf_counter()
        batch, fields = self._batch(inputs)
        boundary = self.state.micro_step + 1 >= self.state.gradient_accumulation_steps  # this call closes the window
        result = self._run_schedule(batch, fields, forward_only=False, boundary=boundary)
        self.state.count_micro_batch(self._record(result, batch, time.perf_counter() - t0, training=True))
        return result

    @remote_method(dispatch="slice", collect="mean")
    def forward_only(self, inputs: Rows, adapter_name: str | None = None) -> dict:
        self._check_adapter(adapter_name)
        t0 = time.perf_counter()
        batch, fields = self._batch(inputs)
        with torch.no_grad():
            result = self._run_schedule(batch, fields, forward_only=True, boundary=False)
        self._record(result, batch, time.perf_counter() - t0, training=False)
        return result

    @remote_method()
    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0, adapter_name: str | None = None) -> dict:
        """Clip (Megatron's global norm over tp/pp/dp), step, schedule, zero — on a boundary only."""
        self._check_adapter(adapter_name)
        if self.optimizer is None:
            raise ValueError("no optimizer: call set_optimizer(...) first")
        if not self.state.at_boundary:
            return {"stepped": False, "accumulated": self.state.micro_step}
        t0 = time.perf_counter()
        grad_norm, skipped = None, True
        if not self.state.nonfinite_pending:
            for opt in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]:
                opt.config.clip_grad = max_grad_norm or 0.0  # megatron: 0 = no clipping
            ok, grad_norm, _ = self.optimizer.step()
            skipped = not ok or grad_norm is None or not torch.isfinite(torch.tensor(float(grad_norm)))
            if not skipped:
                for scheduler in self.schedulers:
                    scheduler.step()
        self.module.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self._torch_optimizers()[0].param_groups[0]["lr"]
        return step_rule.finish_step(self.state, None if grad_norm is None else float(grad_norm), skipped, t0, lr)

    @remote_method()
    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]:
        self._check_adapter(adapter_name)
        return step_rule.calculate_metric(self.state, is_training)

    # -- checkpoints: HF folders ------------------------------------------------------------------
    def _load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> None:
        full = convert.hf_to_megatron(hf_state, self.hf_config)
        mine = convert.stage_state(full, self.hf_config, self.pp_rank, self.pp_size, self.tp_rank, self.tp_size)
        own = self.gpt.state_dict()
        with torch.no_grad():
            for name, tensor in mine.items():
                if name not in own:
                    raise ValueError(f"checkpoint weight {name} has no place in this stage's GPTModel")
                own[name].copy_(tensor)
        absent = [n for n in own if n not in mine and not n.endswith("_extra_state")]
        if absent:
            raise ValueError(f"checkpoint lacks weights {absent[:5]}")

    def _gather_hf_state(self) -> dict[str, torch.Tensor] | None:
        """Full HF state on global rank 0 (tp shards merged, pp stages joined); None elsewhere."""
        from megatron.core import parallel_state as ps

        full = {}
        for name, tensor in self.gpt.state_dict().items():
            if name.endswith("_extra_state") or (
                name == "output_layer.weight" and self.gpt.share_embeddings_and_output_weights
            ):
                continue
            shards = [torch.empty_like(tensor) for _ in range(self.tp_size)]
            dist.all_gather(shards, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
            global_name = convert.global_layer_name(name, self.pp_rank, self.pp_size, self.hf_config.num_hidden_layers)
            full[global_name] = convert.tp_merge(name, shards).float().cpu()
        stages = [None] * self.pp_size
        dist.all_gather_object(stages, full, group=ps.get_pipeline_model_parallel_group())
        if not is_main_process():
            return None
        merged = {k: v for stage in stages for k, v in stage.items()}
        return convert.megatron_to_hf(merged, self.hf_config)

    @remote_method()
    def save(
        self,
        path: str | os.PathLike,
        adapter_name: str | None = None,
        save_training_state: bool = False,
        data_position: int | None = None,  # noqa: ARG002 - TwinkleModel's signature
    ) -> str:
        """An HF folder (`AutoModelForCausalLM.from_pretrained` loads it); training state is not saved."""
        from safetensors.torch import save_file

        self._check_adapter(adapter_name)
        if save_training_state:
            raise NotImplementedError("MegatronModel saves weights only (no optimizer/scheduler state yet)")
        path = Path(path)
        state = self._gather_hf_state()
        if state is not None:
            path.mkdir(parents=True, exist_ok=True)
            save_file(
                {k: v.contiguous() for k, v in state.items()},
                str(path / "model.safetensors"),
                metadata={"format": "pt"},
            )
            self.hf_config.save_pretrained(str(path))
        barrier()
        return str(path)

    @remote_method()
    def load(self, path: str | os.PathLike, adapter_name: str | None = None) -> None:
        self._check_adapter(adapter_name)
        self._load_hf_state(_read_hf_folder(Path(path)))
        if self.optimizer is not None:
            self.optimizer.reload_model_params()  # refresh fp32 main weights from the loaded ones

    # ARG002: TwinkleModel's signature
    @remote_method()
    def resume_from_checkpoint(self, path: str | os.PathLike, adapter_name: str | None = None) -> dict:  # noqa: ARG002
        raise refuse(
            self,
            "resume training state (it saves weights only)",
            "load(path) the weights and set the optimizer and scheduler again, or train with TransformersModel",
        )
