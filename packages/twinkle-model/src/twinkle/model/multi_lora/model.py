"""MultiLoraModel: one frozen base model, any number of tenants' LoRA adapters, fused passes.

Each adapter has its own rank, alpha, targets, dropout, optimizer, scheduler, loss, gradient
accumulation and metrics (`AdapterState`). `forward_backward_fused({tenant: rows, ...})` stacks
every tenant's rows into one batch, runs the base model once (each MultiLoraLinear routes a
tenant's rows through that tenant's adapter), computes each tenant's loss on its own rows,
normalised over its own tokens, and back-propagates the sum: adapters share no parameters, so each
gradient lands only in its own adapter and equals what that tenant alone would get.

It implements the `TwinkleModel` contract (twinkle.model.base) for one tenant at a time; the fused
calls (`forward_backward_fused`, `forward_fused`) are its own additions; which requests share one
is `twinkle.model.multi_lora.planner`'s choice.
"""

from __future__ import annotations

import functools
import zlib
from contextlib import contextmanager

import torch
from peft import LoraConfig

from twinkle.loss import Loss, LossContext
from twinkle.mesh import get_global_mesh
from twinkle.metric import attention_dims, matmul_params, measure_matmul_peak, step_flops
from twinkle.model import base_dtype as base_dtypes
from twinkle.model import checkpoint, embedding_pass, preemption, vision
from twinkle.model import step as step_rule
from twinkle.model.base import TwinkleModel
from twinkle.model.kit import progress
from twinkle.model.multi_lora import experts as expert_lora
from twinkle.model.multi_lora import fused_pass, recompute, vision_tenants
from twinkle.model.multi_lora import heads as head_rule
from twinkle.model.multi_lora.batch import Batch, collate, fuse, fused_images
from twinkle.model.multi_lora.data_parallel import DataParallel
from twinkle.model.multi_lora.layer import MultiLoraLinear, Routing, unwrap_empty_layers, wrap_linear_layers
from twinkle.model.multi_lora.memory import IdleTrimmer, limit_malloc_arenas
from twinkle.model.multi_lora.residency import LIVE, Residency
from twinkle.model.multi_lora.spec import AdapterSpec, check_adapter_name
from twinkle.model.state import AdapterState
from twinkle.model.structure import decoder_layer_list


class MultiLoraModel(TwinkleModel):
    """One frozen base (`model_id`, or a loaded `model`) that every tenant's adapter trains on.

    `activation_checkpointing=True` (or `set_activation_checkpointing(True)` later) keeps only each
    decoder layer's input during a training pass and recomputes the layer in backward, under the
    tenant routing and LoRA dropout draws its forward had (`multi_lora.recompute`): activation
    memory falls from every layer's to one layer's, at the cost of a second forward through the
    decoder. Off by default; no-grad passes never recompute. The vision tower is not checkpointed.
    A base that already has transformers' own gradient checkpointing on is refused.

    `device_mesh` (default: the global mesh) with several data ranks (torchrun, a Ray group) makes each
    pass the ranks' shares of one global pass, equal to one process on the whole batch
    (`multi_lora.data_parallel`); only dp is implemented."""

    def __init__(
        self,
        model_id: str | None = None,
        *,
        model=None,
        torch_dtype=None,
        device=None,
        seed: int = 0,
        activation_checkpointing: bool = False,
        base_dtype: str = "auto",
        device_mesh=None,
    ):
        # data parallel over the mesh's data ranks (default: the global mesh), multi_lora.data_parallel
        self.data_parallel = DataParallel(device_mesh if device_mesh is not None else get_global_mesh())
        self.model_path = None
        if model is None:
            if model_id is None:
                raise ValueError("MultiLoraModel needs a model_id (e.g. twinkle.hub.DEFAULT_MODEL) or a model")
            from twinkle.hub import resolve_model_path

            self.model_path = resolve_model_path(model_id)
            model = vision.load_pretrained(self.model_path, dtype=torch_dtype or "auto")
        if device is not None:
            model = model.to(device)
        self._hold_base(model, torch_dtype, base_dtype, loaded=self.model_path is not None)
        recompute.refuse_foreign_checkpointing(model)
        model.requires_grad_(False)  # the base is frozen for every tenant
        preemption.enable(model, decoder_layer_list(model))  # a served long row may pause mid-pass
        self.model_id = model_id or getattr(model, "name_or_path", None)
        self.base = model
        self.device = next(model.parameters()).device
        self.pad_id = model.config.pad_token_id or 0
        # MFU per tenant, as the library reports it: the base's matmuls counted before any adapter wraps a layer
        self.peak_flops = measure_matmul_peak(self.device, next(model.parameters()).dtype)
        self._n_matmul = matmul_params(model)[0]
        self._layers, self._q_width = attention_dims(model.config)
        self.seed = seed
        self.routing = Routing()
        self.adapters: dict[str, AdapterState] = {}  # every adapter, wherever it lives (self.residency)
        self.residency = Residency(self)
        self._trimmer: IdleTrimmer | None = None
        # a pass whose logits would be larger runs its unembedding in chunks (twinkle.model.multi_lora.heads)
        self.logits_budget_bytes = head_rule.LOGITS_BUDGET_BYTES
        self._vision_params: dict[str, dict[str, torch.nn.Parameter]] = {}  # train_vision copies per tenant
        self._vision_train: dict[str, tuple[str, ...]] = {}
        self._expert_targets: dict[str, dict[str, list[str]]] = {}  # {tenant: {experts module: [weights]}}
        self.checkpointer: recompute.RoutedCheckpoint | None = None  # set while activation checkpointing is on
        if activation_checkpointing:
            self.set_activation_checkpointing(True)

    @staticmethod
    def _hold_base(model, torch_dtype, base_dtype: str, loaded: bool) -> None:
        """The frozen base in `base_dtype` (twinkle.model.base_dtype); 'auto' decides for a base this
        engine loaded and keeps the dtype of one it was handed. LoRA factors are fp32 on any base."""
        base_dtypes.check(base_dtype)
        if torch_dtype is not None and base_dtype != "auto":
            raise ValueError(f"give torch_dtype ({torch_dtype}) or base_dtype ({base_dtype!r}), not both")
        if torch_dtype is not None or (base_dtype == "auto" and not loaded):
            return
        device = next(model.parameters()).device
        n_params = sum(p.numel() for p in model.parameters())
        base_dtypes.cast_parameters(model, base_dtypes.resolve(base_dtype, None, device, n_params))

    def get_info(self) -> dict:
        """The frozen base's dtype, whether this device multiplies bf16 fast, the vocabulary."""
        return {
            "model_id": self.model_id,
            "base_dtype": base_dtypes.name(next(self.base.parameters()).dtype),
            "fast_bf16": base_dtypes.fast_bf16(self.device),
            "vocab_size": self.base.get_output_embeddings().weight.shape[0],
        }

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute decoder layers in backward instead of keeping their activations (class docstring);
        an architecture whose layers transformers cannot checkpoint is refused by class name."""
        if enabled and self.checkpointer is None:
            self.checkpointer = recompute.enable(self.base, self.routing, self._dropout_generators)
        elif not enabled and self.checkpointer is not None:
            recompute.disable(self.base)
            self.checkpointer = None

    @property
    def activation_checkpointing(self) -> bool:
        return self.checkpointer is not None

    def _dropout_generators(self, names: tuple[str | None, ...]) -> list[torch.Generator]:
        """The generators the LoRA dropout of these tenants draws from (a recompute must redraw the same)."""
        out = []
        for name in dict.fromkeys(names):
            state = self.adapters.get(name) if name is not None else None
            if state is not None and state.spec.dropout and state.dropout_generator is not None:
                out.append(state.dropout_generator)
        return out

    def release_memory_when_idle(self, idle_seconds: float = 1.0) -> None:
        """For a long-running server: give freed memory back to the OS once no pass, step or
        adapter removal has happened for `idle_seconds` (twinkle.model.multi_lora.memory)."""
        limit_malloc_arenas()
        self._trimmer = IdleTrimmer(idle_seconds)

    def _worked(self) -> None:
        if self._trimmer is not None:
            self._trimmer.touch()

    # ---- adapters -------------------------------------------------------------------------------
    @property
    def adapter_names(self) -> list[str]:
        return list(self.adapters)

    def adapter_state(self, adapter_name: str | None) -> AdapterState:
        """The adapter's training state (`twinkle.model.state`), brought back live first if it was
        parked or spilled: what a serving layer reads and steps through the shared step rule."""
        return self._state(adapter_name)

    def _state(self, adapter_name: str | None, pinned: set[str] | frozenset[str] = frozenset()) -> AdapterState:
        """The adapter's state, brought back live first if it was parked or spilled."""
        if adapter_name is None:
            if len(self.adapters) != 1:
                raise ValueError(
                    f"adapter_name is required when the model holds {len(self.adapters)} adapters "
                    f"({', '.join(self.adapters) or 'none'})"
                )
            adapter_name = next(iter(self.adapters))
        try:
            state = self.adapters[adapter_name]
        except KeyError:
            raise KeyError(
                f"no adapter named {adapter_name!r}; adapters: {', '.join(self.adapters) or 'none'}"
            ) from None
        self.residency.restore(adapter_name, pinned)
        self.residency.touch(adapter_name)
        return state

    # ---- residency: idle adapters off the live model (twinkle.model.multi_lora.residency) ----------
    def enable_spill(self, folder) -> None:
        """Spilled adapters go under `folder` (one subfolder each; the model owns what it writes there)."""
        from pathlib import Path

        self.residency.spill_dir = Path(folder)

    def park_adapter(self, adapter_name: str) -> None:
        """Move the adapter, its gradients and optimizer state off the layers into host memory."""
        self._state(adapter_name)  # a clear error for an unknown name
        self._resident_only(adapter_name)
        self.residency.park(adapter_name)

    def spill_adapter(self, adapter_name: str) -> None:
        """Move the adapter (live or parked) to the spill folder, freeing its host memory too."""
        self._known(adapter_name)
        self._resident_only(adapter_name)
        self.residency.spill(adapter_name)

    def _resident_only(self, adapter_name: str) -> None:
        if self._vision_params.get(adapter_name):
            raise ValueError(
                f"adapter {adapter_name!r} trains vision modules (train_vision): parking and spilling move "
                "LoRA factors only, so it stays live"
            )

    def adapter_tier(self, adapter_name: str) -> str:
        """'live', 'parked' or 'spilled'; any call that uses the adapter brings it back live."""
        self._known(adapter_name)
        return self.residency.tier(adapter_name)

    def _known(self, adapter_name: str) -> None:
        if adapter_name not in self.adapters:
            raise KeyError(f"no adapter named {adapter_name!r}; adapters: {', '.join(self.adapters) or 'none'}")

    def lora_layer(self, module_name: str) -> MultiLoraLinear:
        """The multi-LoRA wrapper at `module_name` (a layer some adapter targets)."""
        layer = self.base.get_submodule(module_name)
        if not isinstance(layer, MultiLoraLinear):
            raise TypeError(f"{module_name} is a {type(layer).__name__}, not a multi-LoRA layer")
        return layer

    def _generator(self, name: str, salt: int, seed: int | None) -> torch.Generator:
        # Seeded from the adapter's own name (or seed): its init and dropout never depend on
        # which other adapters exist or in what order they were added.
        base_seed = seed if seed is not None else self.seed * 1_000_003 + zlib.crc32(name.encode())
        return torch.Generator(device=self.device).manual_seed(base_seed + salt)

    def add_adapter_to_model(
        self,
        adapter_name: str,
        config: LoraConfig,
        gradient_accumulation_steps: int = 1,
        *,
        seed: int | None = None,
        train_vision=(),
    ) -> None:
        """A LoRA on the language model; ``train_vision`` (``"projector"``, ``"tower"``) also trains
        those vision parts full-parameter, as this tenant's own copy (multi_lora.vision_tenants)."""
        check_adapter_name(adapter_name)
        vision.vision_parts(train_vision)  # unknown parts refused before anything is built
        if adapter_name in self.adapters:
            raise ValueError(f"adapter {adapter_name!r} already exists")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(
                f"gradient_accumulation_steps must be a positive integer, got {gradient_accumulation_steps!r}"
            )
        spec = AdapterSpec.from_lora_config(config)
        module_names = vision.language_modules(spec.select(self.base))  # rows are routed, not image patches
        expert_targets = expert_lora.by_module(spec.select_parameters(self.base))  # refused before anything is built
        self.residency.admit(adapter_name, set())
        self._expert_targets[adapter_name] = expert_targets
        init_gen, dropout_gen = self._generator(adapter_name, 0, seed), self._generator(adapter_name, 1, seed)
        params = []
        for layer in wrap_linear_layers(self.base, module_names, self.routing):
            layer.add_adapter(adapter_name, spec.rank, spec.scaling, spec.dropout, dropout_gen, init_gen)
            params += [layer.lora_A[adapter_name].weight, layer.lora_B[adapter_name].weight]
        for module_name, weights in expert_targets.items():
            wrapper = expert_lora.wrap_experts(self.base, module_name, self.routing)
            wrapper.add_adapter(adapter_name, weights, spec.rank, spec.scaling, init_gen)
            params += list(wrapper.peft_tensors(adapter_name, module_name).values())
        own_vision = vision_tenants.install(self.base, adapter_name, train_vision)
        params += [p for _, p in own_vision]
        self._vision_params[adapter_name] = dict(own_vision)
        self._vision_train[adapter_name] = vision.vision_parts(train_vision)
        self.adapters[adapter_name] = AdapterState(
            adapter_name,
            params,
            peak_flops=self.peak_flops,
            gradient_accumulation_steps=gradient_accumulation_steps,
            spec=spec,
            module_names=module_names,
            dropout_generator=dropout_gen,
        )

    def remove_adapter(self, adapter_name: str) -> None:
        """Drop the adapter, its optimizer state and metrics; layers left with no adapter are unwrapped."""
        self._known(adapter_name)
        state = self.adapters[adapter_name]
        if self.residency.tier(adapter_name) == LIVE:
            for module_name in state.module_names:
                self.lora_layer(module_name).remove_adapter(adapter_name)
            unwrap_empty_layers(self.base, state.module_names)
        for module_name in self._expert_targets.pop(adapter_name, {}):
            experts = self.base.get_submodule(module_name)
            if isinstance(experts, expert_lora.MultiLoraExperts):  # a parked adapter has left it already
                experts.remove_adapter(adapter_name)
                expert_lora.unwrap_empty(self.base, module_name)
        self.residency.forget(adapter_name)
        vision_tenants.remove(self.base, adapter_name)
        self._vision_params.pop(adapter_name, None)
        self._vision_train.pop(adapter_name, None)
        del self.adapters[adapter_name]
        self._worked()

    def set_optimizer(self, optimizer_cls="AdamW", adapter_name: str | None = None, **kwargs) -> None:
        self._state(adapter_name).set_optimizer(optimizer_cls, **kwargs)

    def set_lr_scheduler(self, scheduler_cls, adapter_name: str | None = None, **kwargs) -> None:
        self._state(adapter_name).set_scheduler(scheduler_cls, **kwargs)

    def set_loss(self, loss, adapter_name: str | None = None, **kwargs) -> None:
        self._state(adapter_name).set_loss(loss, **kwargs)

    def adapter_state_dict(self, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        """The adapter's weights under peft's saved names (`base_model.model.<layer>.lora_A.weight`)."""
        state = self._state(adapter_name)
        out = {}
        for module_name in state.module_names:
            layer = self.lora_layer(module_name)
            a, b = layer.factors(state.name)
            out[f"base_model.model.{module_name}.lora_A.weight"] = a
            out[f"base_model.model.{module_name}.lora_B.weight"] = b
        for module_name in self._expert_targets.get(state.name, {}):  # peft's target_parameters layout
            experts = self.base.get_submodule(module_name)
            out.update(experts.peft_tensors(state.name, f"base_model.model.{module_name}"))
        for name, p in self._vision_params.get(state.name, {}).items():  # peft's modules_to_save layout
            out[f"base_model.model.{name}"] = p
        return out

    def expert_targets(self, adapter_name: str) -> dict[str, list[str]]:
        """{experts module: the 3-D weights this adapter adapts there} (empty for a dense adapter)."""
        return self._expert_targets.get(adapter_name, {})

    def expert_factors(self, adapter_name: str | None = None) -> dict[str, expert_lora.ExpertFactors]:
        """{expert weight's full name: the adapter's factors on it} (peft's ParamWrapper layout)."""
        state = self._state(adapter_name)
        out = {}
        for module_name, weights in self._expert_targets.get(state.name, {}).items():
            for weight in weights:
                out[f"{module_name}.{weight}"] = self.base.get_submodule(module_name).factors(state.name, weight)
        return out

    # ---- passes ---------------------------------------------------------------------------------
    def forward_backward(self, inputs, adapter_name: str | None = None, **kwargs) -> dict:
        name = self._state(adapter_name).name
        return self.forward_backward_fused({name: inputs}, **kwargs)[name]

    def forward(self, inputs, adapter_name: str | None = None) -> LossContext:
        """Training-mode pass with autograd on: the LossContext a custom loss reads."""
        state = self._state(adapter_name)
        batch = collate(inputs, self.pad_id)
        (head,) = self._heads([(state.name, batch)], train=True)
        fields = {k: v.to(self.device) for k, v in batch.shifted_fields().items()}
        return LossContext(head, batch.labels_B_T[:, 1:].to(self.device), fields)

    def backward(self, loss: torch.Tensor, adapter_name: str | None = None) -> bool:
        """A custom loss from `forward`'s context, counted as one micro-batch of the window."""
        state = self._state(adapter_name)
        finite = bool(torch.isfinite(loss.detach()).all())
        state.count_micro_batch(finite)
        if not finite:
            return False
        (loss * self.data_parallel.backward_scale / state.gradient_accumulation_steps).backward()
        return True

    def forward_only(self, inputs, adapter_name: str | None = None, *, task: str = "causal_lm") -> dict:
        """{'loss' (None without targets), 'logprobs' per row aligned with labels (0.0 first)};
        `task='embedding'`: {'loss' (an embedding loss over marked groups, else None), 'embeddings'}."""
        name = self._state(adapter_name).name
        out = self.forward_fused({name: inputs}, task=task)[name]
        if task == embedding_pass.EMBEDDING:
            return {"loss": out["loss"] if out["finite"] else None, **out["metrics"], "embeddings": out["embeddings"]}
        return {
            "loss": out["loss"] if out["loss_tokens"] else None,
            **out["metrics"],
            "logprobs": [[0.0, *row] for row in out["logprobs"]],
        }

    def logits(self, inputs, adapter_name: str | None = None, base_only: bool = False) -> torch.Tensor:
        """No-grad logits [B, T, V] of one tenant's right-padded batch (`base_only`: adapter off)."""
        name = None if base_only else self._state(adapter_name).name
        with torch.no_grad():
            return self._logits([(name, collate(inputs, self.pad_id))], train=False)

    def forward_backward_fused(
        self,
        batches: dict,
        raise_errors: bool = True,
        return_logprobs: bool = False,
        loss_weights: dict[str, float] | None = None,
        losses: dict[str, Loss] | None = None,
        task: str = "causal_lm",
    ) -> dict:
        """One forward+backward over several tenants' batches; {tenant: result}. With
        raise_errors=False a tenant whose input or loss fails maps to its exception and the others
        still train. `loss_weights`: a tenant's loss is scaled by its weight before backward (a piece's
        share of a longer pass; a data rank's share is the mesh's, multi_lora.data_parallel). `losses`:
        a tenant's loss for this pass only, instead of its configured one (an API whose requests
        each name their loss, as Tinker's do). `task='embedding'`: every tenant's rows are embedding
        rows (twinkle.model.embedding_pass), pooled from the final hidden states of one pass."""
        return self._run(batches, True, raise_errors, return_logprobs, loss_weights or {}, losses or {}, task)

    def forward_fused(
        self, batches: dict, raise_errors: bool = True, losses: dict[str, Loss] | None = None, task: str = "causal_lm"
    ) -> dict:
        """One no-grad forward over several tenants' batches: per-row target log-probs (and the
        loss if labels are given), {tenant: result}; `losses` and `task` as in forward_backward_fused
        (an embedding pass answers per-row `embeddings` instead of log-probs)."""
        with torch.no_grad():
            return self._run(batches, False, raise_errors, True, {}, losses or {}, task)

    def _run(
        self,
        batches: dict,
        train: bool,
        raise_errors: bool,
        return_logprobs: bool,
        weights: dict,
        losses: dict,
        task: str = "causal_lm",
    ) -> dict:
        if not batches:
            raise ValueError("no batches given")
        embedding_pass.check_task(task)
        if task != embedding_pass.CAUSAL_LM and self.data_parallel.world > 1:
            # in-batch negatives span the whole batch: a data rank's share of a tenant's rows is not one
            refused = ValueError(f"task={task!r} on several data ranks is not offered: run it on one rank")
            outcomes = dict.fromkeys(batches, refused)
        else:
            local = functools.partial(self._run_local, task=task)
            outcomes = self.data_parallel.run(
                self.adapters, self.pad_id, local, batches, train, return_logprobs, weights, losses
            )
        errors = {n: e for n, e in outcomes.items() if isinstance(e, Exception)}
        if errors and raise_errors:
            name, error = next(iter(errors.items()))
            raise type(error)(f"tenant {name!r}: {error}") from error
        return {name: outcomes[name] for name in batches}

    def _run_local(
        self, batches: dict, train: bool, return_logprobs: bool, weights: dict, losses: dict, task: str = "causal_lm"
    ) -> dict:
        outcomes, work = {}, []
        pinned = set(batches)  # bringing one tenant back never parks another of this pass
        for name, inputs in batches.items():
            try:
                rows = embedding_pass.task_inputs(task, inputs)
                work.append((self._state(name, pinned), collate(rows, self.pad_id)))
            except (ValueError, KeyError, TypeError) as error:
                outcomes[name] = error
        if work:
            names = [state.name for state, _ in work]
            with preemption.preserving(lambda: self._paused(names)):  # what a pause lets other passes change
                model = fused_pass.PassModel(self._heads, self._flops, self.device, self.peak_flops)
                outcomes.update(fused_pass.run(model, work, train, return_logprobs, weights, losses, task))
            self._worked()
        return outcomes

    def _paused(self, names: list[str]):
        """A pass of `names` pauses (twinkle.model.preemption): its adapters stay resident; -> what puts
        back the routing and train/eval mode other passes may set meanwhile."""
        routed, training = self.routing.state(), self.base.training
        release = self.residency.hold(names)

        def resumed():
            self.routing.load(routed)
            if self.base.training != training:
                self.base.train(training)
            release()

        return resumed

    @contextmanager
    def _routed(self, segments: list[tuple[str | None, Batch]], train: bool):
        """The fused ids and mask of `segments` and their images' model inputs (pixel values, grids; empty
        for text), with the model in the right mode and routed for them."""
        ids_B_T, mask_B_T = fuse([b for _, b in segments], self.pad_id)
        if self.base.training != train:
            self.base.train(train)
        self.routing.set([(name, b.rows, b.length) for name, b in segments], training=train)
        extra = fused_images([b for _, b in segments], ids_B_T, self.base.config, self.device)
        tv = vision_tenants.tenant_vision(self.base)
        if tv is not None:  # which tenant's images are which, for tenants with their own vision copies
            tv.route([(name, len(b.images["image_grid_thw"]) if b.images else 0) for name, b in segments])
        try:
            yield ids_B_T.to(self.device), mask_B_T.to(self.device), extra
        finally:
            self.routing.clear()
            if tv is not None:
                tv.route(None)

    def _logits(self, segments: list[tuple[str | None, Batch]], train: bool) -> torch.Tensor:
        with self._routed(segments, train) as (ids_B_T, mask_B_T, extra):
            return self.base(input_ids=ids_B_T, attention_mask=mask_B_T, use_cache=False, **extra).logits

    def _heads(self, segments: list[tuple[str | None, Batch]], train: bool, task: str = "causal_lm"):
        """Each segment's shifted next-token head ([rows, length - 1]); long passes never hold whole logits.
        An embedding pass: each segment's pooled embeddings (twinkle.model.embedding_pass)."""
        with self._routed(segments, train) as (ids_B_T, mask_B_T, extra):
            if task == embedding_pass.EMBEDDING:
                rows = [b.rows for _, b in segments]
                return embedding_pass.fused_heads(self.base, rows, input_ids=ids_B_T, attention_mask=mask_B_T, **extra)
            return head_rule.heads(self, segments, train, ids_B_T, mask_B_T, extra)

    def _flops(self, state: AdapterState, batch: Batch, train: bool) -> float:
        own = sum(p.numel() for p in state.params)  # this tenant's LoRA factors: matmuls too, trained
        return step_flops(
            batch.tokens, batch.length, self._n_matmul + own, own if train else 0, self._layers, self._q_width, train
        )

    # ---- optimizer steps, metrics, checkpoints --------------------------------------------------
    def clip_grad_and_step(self, max_grad_norm: float | None = 1.0, adapter_name: str | None = None) -> dict:
        """On an accumulation boundary, the step rule every engine shares (`twinkle.model.step`)."""
        state = self._state(adapter_name)
        self.data_parallel.sync_gradients(state)
        result = step_rule.clip_grad_and_step(state, max_grad_norm)
        self._worked()
        return result

    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]:
        """This adapter's metrics since the last report (then reset)."""
        return step_rule.calculate_metric(self._state(adapter_name), is_training)

    def save(
        self, path, adapter_name: str | None = None, save_training_state: bool = False, data_position: int | None = None
    ) -> str:
        """The adapter as an ordinary peft LoRA folder (its own rank), plus the training state on
        request (twinkle.model.checkpoint); returns the path."""
        state = self._state(adapter_name)
        config = vision.with_vision_modules(self.base, state.spec.config, self._vision_train.get(state.name, ()))
        with self.data_parallel.one_writer() as write:
            if write:
                base_id = checkpoint.base_model_id(self.model_id, self.model_path)
                checkpoint.save_adapter(path, config, self.adapter_state_dict(state.name), base_id)
            if save_training_state:
                checkpoint.save_adapter_state(path, state, data_position, write=write)
        return str(path)

    def load(self, path, adapter_name: str | None = None, *, gradient_accumulation_steps: int = 1) -> None:
        """Weights from a peft LoRA folder (written by `save`, or by peft) into the adapter; an
        adapter that does not exist yet is added from the folder's config (with
        `gradient_accumulation_steps`) and removed again if the weights do not fit."""
        config, tensors = checkpoint.load_adapter(path)
        name = adapter_name or (self._state(None).name if self.adapters else "default")
        created = name not in self.adapters
        if created:
            config, parts = vision.split_vision_modules(config)
            self.add_adapter_to_model(name, config, gradient_accumulation_steps, train_vision=parts)
        try:
            saved = {k.replace(".default.", "."): v for k, v in tensors.items()}
            own = self.adapter_state_dict(name)
            if set(saved) != set(own):
                missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
                raise ValueError(
                    f"{path!r} does not fit adapter {name!r}: missing {missing[:3]}, unexpected {extra[:3]}"
                )
            for key, param in own.items():
                if saved[key].shape != param.shape:
                    raise ValueError(f"{key}: saved shape {tuple(saved[key].shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                for key, param in own.items():
                    param.copy_(saved[key])
        except Exception:
            if created:
                self.remove_adapter(name)
            raise

    def resume_from_checkpoint(self, path, adapter_name: str | None = None) -> dict:
        """`load` plus optimizer, scheduler, RNG and counters (set_optimizer / set_lr_scheduler first)."""
        self.load(path, adapter_name)
        state = self._state(adapter_name)
        # the counters with twinkle-kit's keys beside them, as TransformersModel answers
        return progress(checkpoint.resume_adapter_state(path, state), state.gradient_accumulation_steps)

    def layers(self) -> list[MultiLoraLinear]:
        return [m for m in self.base.modules() if isinstance(m, MultiLoraLinear)]
