"""What the server asks of a training/sampling backend, and the plain data it passes.

The service layer (routes, futures, scheduling, persistence) only talks to `Backend`; a backend owns
the base model, the tenants' LoRA adapters with their optimizers, and the samplers. Every method is
called from the scheduler's worker thread, one at a time, so a backend needs no locking of its own.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from twinkle.sampler import SampleResponse, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class UserError(Exception):
    """The request is wrong (bad tokens, shapes, loss name, NaN loss): fails only its own future."""


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def roles(self) -> tuple[str, ...]:
        """The structure roles (twinkle.model.structure) Tinker's flags name; train_mlp includes experts."""
        roles = ()
        if self.train_attn:
            roles += ("attention",)
        if self.train_mlp:
            roles += ("mlp", "experts")
        if self.train_unembed:
            roles += ("unembedding",)
        if not roles:
            raise UserError("lora_config trains nothing: set at least one of train_attn, train_mlp, train_unembed")
        return roles

    def target_modules(self, model) -> list[str]:
        """peft target_modules naming every Linear of the roles these flags name, read from the
        model's structure (Phi-3's fused qkv_proj, DeepSeek's MLA projections, shared experts).
        `model`: the base model or its `describe()` Structure."""
        structure = _structure(model)
        targets = structure.linear_targets(*self.roles())
        if not targets and not structure.expert_parameters(*self.roles()):
            raise UserError(f"lora_config names no weight of this {structure.model_type} model")
        return targets

    def target_parameters(self, model) -> list[str]:
        """peft target_parameters naming the 3-D expert weights train_mlp names (expert LoRA)."""
        return _structure(model).expert_parameters(*self.roles())


def _structure(model):
    from twinkle.model.structure import Structure, describe

    return model if isinstance(model, Structure) else describe(model)


@dataclass
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class RowsPass:
    """A forward(_backward) of encoded rows (`input_ids`, `labels`, per-token loss fields), scored by
    `loss` (an engine `twinkle.loss.Loss` for this pass: an API whose requests name their loss, as
    Tinker's do; a custom one holds per-row inputs and has `sliced(start, stop)` for a data rank's
    share) or, when None, by the adapter's own configured loss (the native API's). `task`: 'causal_lm',
    or 'embedding' (twinkle.model.embedding_pass: a pass of its own kind, never fused with log-prob passes
    nor cut into micro-batches, whose rows are each other's negatives)."""

    adapter: str
    rows: list[dict]
    forward_only: bool
    loss: Any = None
    task: str = "causal_lm"


class Backend(ABC):
    """What the service asks of a base model's training/sampling backend.

    Everything the server calls on a backend is declared here (a guard test, test_backend_contract,
    fails on a call to anything else), so no caller asks whether a method exists: every backend has
    a tokenizer, samplers it can install and remove, the native API's adapter operations, the
    residency hooks and `close()`. Where a backend cannot do something the default answers what is
    true of it: `base_module` (the adapter-memory estimate) is None where the base model is not in
    this process, and the residency hooks say "no adapters here" where they live on remote ranks.
    """

    base_model: str  # the name clients use
    tokenizer_path: str  # a local folder AutoTokenizer loads offline
    tokenizer: Any  # a transformers tokenizer, loaded in this process
    vocab_size: int
    max_context: int
    base_module: object | None = None
    # Built with `remote_group=` / `sampler_remote_group=` (twinkle.mesh groups): the config accepts a
    # model entry naming remote groups only for such a backend (ServeConfig reads it at load).
    runs_on_remote_groups: ClassVar[bool] = False

    def __init__(self, base_model: str, model_path: str, **options) -> None:  # noqa: B027 - optional to override
        """Every backend is built from a model entry: the name clients use, a local folder, the entry's options."""

    def sampler_adapters(self) -> int:
        """Adapters installed in a sampler in this process (the soak and /metrics watch it stay bounded)."""
        return 0

    def prefix_cache_stats(self) -> dict[str, int]:
        """The counters of this process's sampler prefix cache (twinkle.sampler.PrefixCacheStats: hits,
        misses, tokens_reused, bytes_held, entries, evictions, invalidations, budget_bytes); empty where
        no sampler runs in this process."""
        return {}

    def base_dtype(self) -> str | None:
        """The frozen base's dtype where this process holds it ('bf16', 'fp32'; twinkle.model.base_dtype);
        None where a remote group does."""
        return None

    # ---- adapter residency (twinkle.serve.core.adapter_memory): the server parks and spills the adapters
    # a backend holds in this process; one whose adapters live elsewhere answers "none here" ----
    def enable_residency(self, spill_dir, make_room) -> bool:
        """Let the server's policy park and spill this backend's adapters: spilled ones go under
        `spill_dir`, and `make_room(residency, name, pinned)` runs before an adapter is built or brought
        back. -> False where no adapter lives in this process (nothing for the policy to move)."""
        return False

    def with_residency(self, fn) -> None:  # noqa: B027 - optional to override
        """Run `fn(residency)` (twinkle.model.multi_lora.residency) between two engine operations; nothing
        to run where no adapter lives in this process."""

    def residency_report(self) -> tuple[dict[str, int], dict[str, int]]:
        """(adapters per tier, swap counters) of the adapters in this process; empty where there are none."""
        return {}, {}

    # ---- adapters (one per training model) ----
    @abstractmethod
    def create_adapter(self, name: str, spec: LoraSpec) -> None: ...

    @abstractmethod
    def remove_adapter(self, name: str) -> None: ...

    @abstractmethod
    def forward_backward_many(self, passes: list[RowsPass]) -> list:
        """Several adapters' passes (one each) in one fused pass: per pass the engine's outcome dict
        (loss, loss_tokens, finite, metrics, per-row logprobs, mfu), or a UserError failing only that
        request."""

    def forward_backward_sliced(self, passes: list[RowsPass], turn_s: float) -> list:
        """forward_backward_many of one long pass as micro-batches of about `turn_s` each, equal to the
        whole pass, with step boundaries between them where other work may run (twinkle.serve.core.
        slices); a backend that cannot pause in between runs it whole."""
        return self.forward_backward_many(passes)

    @abstractmethod
    def optim_step(self, name: str, params: AdamParams) -> dict[str, float]:
        """End the adapter's accumulation window now and take one Adam step with these hyperparameters
        (clipped to `grad_clip_norm` when set) -> {"grad_norm": the norm before clipping}."""

    @abstractmethod
    def adapter_tensors(self, name: str) -> dict:
        """The adapter's LoRA weights in peft's saved layout (keys without the adapter name)."""

    @abstractmethod
    def save_checkpoint(self, name: str, folder, training_state: bool) -> None:
        """Write the adapter to `folder` (a local directory) in twinkle.model.checkpoint's format."""

    @abstractmethod
    def load_checkpoint(self, name: str, folder, training_state: bool, implicit_adam: bool = False) -> dict:
        """Load a checkpoint folder into adapter `name`, creating it from the folder's LoraConfig when
        missing; with `training_state` resume the optimizer too (`implicit_adam`: Tinker's, made when
        missing, its lr sent with every step, so no saved schedule applies). -> the resumed counters."""

    # ---- the native API's adapters: a peft LoraConfig, the tenant's own optimizer, loss and metrics ----
    @abstractmethod
    def add_lora(self, name: str, config, gradient_accumulation_steps: int, seed: int | None) -> int:
        """Build adapter `name` from a peft `LoraConfig`, starting from the weights peft draws after
        `torch.manual_seed(seed)`; -> its rank."""

    @abstractmethod
    def adapter_rank(self, name: str) -> int | None:
        """The adapter's LoRA rank; None when no adapter `name` exists."""

    @abstractmethod
    def configure_adapter(self, name: str, what: str, component: str, kwargs: dict, is_training: bool = True) -> None:
        """Set the adapter's `loss`, `optimizer` or `lr_scheduler`, or add a `metric` (registered names)."""

    @abstractmethod
    def clip_grad_and_step(
        self, name: str, max_grad_norm: float | None, *, gradient_accumulation_steps: int | None = None
    ) -> dict:
        """The TwinkleModel step rule (accumulation boundary, clip, step, scheduler) for one adapter;
        `gradient_accumulation_steps` resizes its window from this call on (twinkle-kit's per-call window)."""

    @abstractmethod
    def calculate_metric(self, name: str, is_training: bool) -> dict[str, float]:
        """The adapter's metrics since the last call (then reset), with `step` when training."""

    # ---- samplers ----
    @abstractmethod
    def install_sampler_from_adapter(self, sampler: str, adapter: str) -> None:
        """Serve a snapshot of the adapter's current weights as `sampler` (later training does not change it)."""

    @abstractmethod
    def install_sampler_from_folder(self, sampler: str, folder: str) -> None: ...

    @abstractmethod
    def remove_sampler(self, sampler: str) -> None: ...

    def retire_sampler(self, sampler: str) -> None:
        """Remove `sampler` once no sampling uses it (a newer one replaced it). Where a sample holds
        the engine until it ends, nothing uses it between calls: removed at once."""
        self.remove_sampler(sampler)

    @abstractmethod
    def sample(
        self,
        sampler: str | None,
        prompt: list[int],
        params: SamplingParams,
        *,
        on_tokens: Callable[[list], None] | None = None,
        images: dict | None = None,
        cache_namespace: str | None = None,
    ) -> SampleResponse:
        """`params.num_samples` continuations of `prompt` from sampler adapter `sampler` (None: the base
        model), in twinkle.sampler's types: the API layers translate their wire's options into
        SamplingParams and the SampleResponse back.
        `on_tokens(step)`: each decode step's tokens (twinkle.sampler.decoding.StepToken, `index` the
        sample's) as they come, where the decode runs in this process; a backend whose sampler runs on
        remote ranks never calls it (the result holds every token). Raising in it stops the decode.
        `images`: the prompt's {pixel_values, image_grid_thw}, its image tokens already in `prompt`.
        `cache_namespace`: the prefix cache's namespace (a sampling session that shares KV with no other)."""

    @abstractmethod
    def reduce_prompt_table(
        self, sampler: str | None, prompt: list[int], reduce: Callable[[Any], T], *, images: dict | None = None
    ) -> T:
        """`reduce(table_T_V)` of the prompt's full next-token distributions (TorchSampler.
        prompt_logprob_tables: float32 log-probs, row t-1 predicts prompt[t]), computed where the sampler
        runs, so only what `reduce` keeps leaves it: on a remote rank `reduce` travels by reference (a
        module-level function, or a functools.partial of one with plain arguments)."""

    def close(self) -> None:  # noqa: B027 - optional to override
        """Release what the backend started (remote actors); an in-process backend holds nothing to stop."""
