"""The multi-tenant backend: `twinkle.model.multi_lora.MultiLoraModel` (one frozen base, every tenant's
LoRA in the same layers), so queued forward/backward work of several tenants runs as one fused pass.
It sees the engine's rows and answers the engine's outcomes; what an API's requests mean (Tinker's
shift, its loss names and metric names) is that API's layer (twinkle.serve.tinker.datums).
"""

from __future__ import annotations

import math
import random
from contextlib import contextmanager

import numpy as np
import torch

from twinkle.model import preemption
from twinkle.registry import UnknownNameError
from twinkle.serve.backend.base import AdamParams, Backend, LoraSpec, RowsPass, UserError
from twinkle.serve.backend.frozen_base import load_frozen_base
from twinkle.serve.backend.resident import EngineLock, ResidentAdapters, exclusive
from twinkle.serve.backend.sampling import TorchSampling
from twinkle.serve.errors import server_path_as

# An idle server hands freed activation memory back after this long. Not sooner: a client that pauses
# between steps (rewards, logging) would fault the same pages back in on its next step; measured with
# 1 s, bench_serve_tinker's alternating rounds lost ~10% to exactly that.
TRIM_AFTER_IDLE_S = 10.0
LORA_ALPHA = 32  # Tinker does not expose alpha; a fixed alpha keeps lr meaningful across ranks


class MultiLoraBackend(ResidentAdapters, TorchSampling, Backend):
    def __init__(
        self,
        base_model: str,
        model_path: str,
        *,
        dtype: str = "auto",
        max_batch_size: int = 64,
        device: str | None = None,
        trust_remote_code: bool = False,
        sampler: bool = True,
        activation_checkpointing: bool = False,
    ):
        """`sampler=False`: training only (a data-parallel rank; sampling is another group's)."""
        from twinkle.model.multi_lora import MultiLoraModel

        self.base_model, self.tokenizer_path = base_model, model_path
        hf = load_frozen_base(model_path, dtype, device, trust_remote_code)
        self.engine = MultiLoraModel(model=hf, device=device, activation_checkpointing=activation_checkpointing)
        self.base_module = hf  # for the adapter memory estimate (twinkle.serve.core.adapter_memory)
        # base_model_name_or_path of saved adapters: the hub id for a hub model, else this local folder
        self.engine.model_id, self.engine.model_path = base_model, model_path
        embeddings = hf.get_input_embeddings()
        assert isinstance(embeddings, torch.nn.Embedding), type(embeddings)
        self.vocab_size = embeddings.num_embeddings
        self.max_context = int(getattr(hf.config.get_text_config(), "max_position_embeddings", 4096))
        if sampler:  # one copy of the frozen base for training and sampling
            self._init_sampler(
                model_path,
                dtype,
                max_batch_size,
                device=device,
                trust_remote_code=trust_remote_code,
                share_frozen_with=hf,
            )
        self.engine.release_memory_when_idle(TRIM_AFTER_IDLE_S)  # freed activations go back once the queue is quiet
        self._engine_lock = EngineLock()

    # ---- adapters ----------------------------------------------------------------------------------
    @exclusive
    def create_adapter(self, name: str, spec: LoraSpec) -> None:
        from peft import LoraConfig

        if spec.rank < 1:
            raise UserError(f"lora rank must be >= 1, got {spec.rank}")
        config = LoraConfig(
            r=spec.rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=spec.target_modules(self.base_module),
            target_parameters=spec.target_parameters(self.base_module) or None,
            bias="none",
        )
        seed = spec.seed if spec.seed is not None else int(torch.randint(0, 2**31 - 1, (1,)))
        self.engine.add_adapter_to_model(name, config, seed=seed)
        self.engine.set_optimizer("AdamW", adapter_name=name, lr=1e-4)

    @exclusive
    def remove_adapter(self, name: str) -> None:
        if name in self.engine.adapters:
            self.engine.remove_adapter(name)

    # ---- the native API's adapters ------------------------------------------------------------------
    @exclusive
    def add_lora(self, name: str, config, gradient_accumulation_steps: int, seed: int | None) -> int:
        from twinkle.serve.backend.lora_init import peft_like_init

        if name in self.engine.adapters:
            raise UserError(f"adapter {name!r} already exists")
        try:
            self.engine.add_adapter_to_model(name, config, gradient_accumulation_steps, seed=seed)
        except ValueError as e:  # the engine's refusal of the client's LoraConfig (modules it matches nothing in)
            raise UserError(f"lora_config: {e}") from None
        if seed is not None:
            peft_like_init(self.engine, name, seed)
        return self.engine.adapters[name].spec.rank

    def adapter_rank(self, name: str) -> int | None:
        state = self.engine.adapters.get(name)
        return None if state is None else state.spec.rank

    @exclusive
    def configure_adapter(self, name: str, what: str, component: str, kwargs: dict, is_training: bool = True) -> None:
        from twinkle.metric import METRICS

        state = self._state(name)
        build = {
            "loss": state.set_loss,
            "optimizer": state.set_optimizer,
            # the local TransformersModel's scheduler classes: one lr schedule in both modes
            "lr_scheduler": state.set_scheduler,
            "metric": lambda component, **kw: state.metrics(is_training).append(METRICS.create(component, **kw)),
        }.get(what)
        if build is None:
            raise UserError(f"cannot configure {what!r}; expected loss, optimizer, lr_scheduler or metric")
        try:
            build(component, **kwargs)
        except UnknownNameError as e:
            raise UserError(str(e)) from None
        except (TypeError, ValueError) as e:  # the client's class refused the client's kwargs
            raise UserError(f"{what} {component!r}: {e}") from None

    @exclusive
    def clip_grad_and_step(
        self, name: str, max_grad_norm: float | None, *, gradient_accumulation_steps: int | None = None
    ) -> dict:
        state = self._state(name)
        if state.optimizer is None:
            raise UserError("no optimizer: call set_optimizer(...) before clip_grad_and_step")
        if gradient_accumulation_steps is not None:
            try:
                state.resize_window(gradient_accumulation_steps)
            except ValueError as e:
                raise UserError(str(e)) from None
        return self.engine.clip_grad_and_step(max_grad_norm=max_grad_norm, adapter_name=name)

    @exclusive
    def calculate_metric(self, name: str, is_training: bool) -> dict[str, float]:
        self._state(name)
        return {k: float(v) for k, v in self.engine.calculate_metric(is_training, adapter_name=name).items()}

    def _known(self, name: str):
        """The adapter's state wherever it lives (a parked one stays parked)."""
        if name not in self.engine.adapters:
            raise UserError(f"model adapter {name!r} is not loaded on this server")
        return self.engine.adapters[name]

    def _state(self, name: str):
        """The adapter's state, live (brought back if it was parked or spilled)."""
        self._known(name)
        return self.engine.adapter_state(name)

    # ---- training ----------------------------------------------------------------------------------
    @exclusive
    def forward_backward_many(self, passes: list[RowsPass], loss_weights: dict[str, float] | None = None) -> list:
        """Several adapters' passes (one each, whichever API sent them) in one fused pass per kind
        (train / forward-only, and its task): per pass the engine's outcome, or the exception failing only
        that request:
        a UserError where the engine refused its input (its rows or loss inputs: the engine's ValueError),
        any other as the engine raised it (a fault of the server's). `loss_weights`: an adapter's training
        loss scaled by its weight (a data rank's share of the batch)."""
        results: list = [None] * len(passes)
        groups: dict[tuple[bool, str], dict[str, int]] = {}
        for i, item in enumerate(passes):
            try:
                self._known(item.adapter)  # the engine brings the pass's adapters back together
                group = groups.setdefault((item.forward_only, item.task), {})
                if item.adapter in group:
                    raise RuntimeError(f"adapter {item.adapter!r} twice in one fused pass")
                group[item.adapter] = i
            except UserError as e:
                results[i] = e
        for (forward_only, task), group in groups.items():
            batches = {name: passes[i].rows for name, i in group.items()}
            losses = {name: passes[i].loss for name, i in group.items() if passes[i].loss is not None}
            # a long row's pass may pause mid-way: the work run meanwhile needs the lock
            with preemption.preserving(self._engine_lock.let_go):
                if forward_only:
                    outcomes = self.engine.forward_fused(batches, raise_errors=False, losses=losses, task=task)
                else:
                    outcomes = self.engine.forward_backward_fused(
                        batches,
                        raise_errors=False,
                        return_logprobs=True,
                        loss_weights=loss_weights,
                        losses=losses,
                        task=task,
                    )
            for name, i in group.items():
                outcome = outcomes[name]
                results[i] = UserError(str(outcome)) if isinstance(outcome, ValueError) else outcome
        return results

    def base_dtype(self) -> str | None:
        return self.engine.get_info()["base_dtype"]

    def forward_backward_sliced(self, passes: list[RowsPass], turn_s: float) -> list:
        # not `exclusive` as a whole: each micro-batch takes the engine lock, none holds it across a pause
        from twinkle.serve.backend.micro_batches import forward_backward_in_runs

        (item,) = passes
        return forward_backward_in_runs(self, item, turn_s)

    @exclusive
    def optim_step(self, name: str, params: AdamParams) -> dict[str, float]:
        state = self._state(name)
        opt = state.ensure_optimizer()
        for group in opt.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        if not any(p.grad is not None for p in state.params):
            return {"grad_norm": 0.0}  # nothing accumulated: a no-op step, as with an empty batch
        state.end_window()
        out = self.engine.clip_grad_and_step(adapter_name=name, max_grad_norm=params.grad_clip_norm or None)
        if not math.isfinite(out["grad_norm"]):
            raise UserError(f"gradient norm is {out['grad_norm']}: step skipped and gradients cleared")
        return {"grad_norm": float(out["grad_norm"])}

    # ---- state -------------------------------------------------------------------------------------
    @exclusive
    def adapter_tensors(self, name):
        from twinkle.sampler import AdapterWeights

        state = self._state(name)
        lora_A, lora_B, scaling = {}, {}, {}
        for module in state.module_names:
            a, b = self.engine.lora_layer(module).factors(name)
            lora_A[module], lora_B[module] = a.detach(), b.detach()
            scaling[module] = state.spec.scaling
        for weight, factors in self.engine.expert_factors(name).items():  # MoE experts, peft's layout
            lora_A[weight], lora_B[weight] = factors.a.detach(), factors.b.detach()
            scaling[weight] = factors.scaling
        return AdapterWeights(
            lora_A, lora_B, scaling, meta={"target_parameters": sorted(self.engine.expert_factors(name))}
        )

    @exclusive
    def save_checkpoint(self, name: str, folder, training_state: bool) -> None:
        """The adapter in the one checkpoint format (twinkle.model.checkpoint), with its training state
        on request (a Tinker adapter's implicit Adam included)."""
        state = self._state(name)
        if training_state:
            state.ensure_optimizer()
        self.engine.save(folder, adapter_name=name, save_training_state=training_state)

    @exclusive
    def load_checkpoint(self, name: str, folder, training_state: bool, implicit_adam: bool = False) -> dict:
        """Weights from a LoRA folder into adapter `name` (built from the folder's own LoraConfig when it
        does not exist yet); with `training_state`, the optimizer, scheduler and counters too.
        `implicit_adam`: the adapter trains with the
        Tinker API's Adam, whose lr arrives with every step: it is made when missing, and a saved lr
        schedule has nothing to drive. -> the resumed counters ({} without)."""
        from twinkle.model import checkpoint

        created = name not in self.engine.adapters
        try:
            self.engine.load(folder, name)
            if not training_state:
                return {}
            state = self._state(name)
            if implicit_adam:
                state.ensure_optimizer()
            skipped = implicit_adam and state.scheduler is None
            if skipped:
                state.scheduler = _ClientSchedule()
            try:
                with _server_rng_kept():
                    return checkpoint.resume_adapter_state(folder, state)
            finally:
                if skipped:
                    state.scheduler = None
        except Exception as e:
            if created and name in self.engine.adapters:  # nothing half-loaded stays behind
                self.engine.remove_adapter(name)
            if isinstance(e, (ValueError, FileNotFoundError, KeyError)):  # the folder as the tenant knows it
                raise UserError(server_path_as(str(e).strip("'\""), folder, "the checkpoint")) from None
            raise


class _ClientSchedule:
    """Where a saved lr schedule goes when the client sets the learning rate itself: nowhere."""

    def load_state_dict(self, state: dict) -> None:
        pass


@contextmanager
def _server_rng_kept():
    """A checkpoint carries its saver's RNG state: a tenant's resume must not reseed the whole server
    (its adapters draw from their own generators)."""
    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])
