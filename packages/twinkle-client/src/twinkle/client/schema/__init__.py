"""The native Twinkle wire schema: pydantic models shared by the server (twinkle-serve) and the client.

Every submitting route answers a `FutureRef`; `GET /twinkle/v1/futures/{request_id}` long-polls it
and answers a `FutureResult` whose `result` is the operation's own result model (named in each
route's description). Names on the wire (loss, optimizer, scheduler, metric) pick registered
classes on the server; keyword arguments are plain JSON values, never pickles.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from twinkle.client.schema import bounds as B

PREFIX = "/twinkle/v1"
# The label of a position without loss: the library's value (twinkle.data_format.labels), kept here too
# because the client depends on no library member.
IGNORE_INDEX = -100
JsonValue = Any  # a JSON scalar, list or object (keyword arguments of registered classes)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- rows -------------------------------------------------------------------------------------------
class EncodedRow(_Strict):
    """One tokenized example. `fields` are loss inputs: a number per row or a list per token
    (aligned with labels), e.g. `weights`, `advantages`, `logprobs`, `ref_logprobs`."""

    input_ids: list[int] = Field(min_length=1)
    labels: list[int] | None = None
    fields: dict[str, B.FiniteFloat | list[B.FiniteFloat]] = Field(default_factory=dict)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, name, ... pass through to the chat template
    role: str
    # a string, or parts: {"type": "text", "text"} and {"type": "image_url", "image_url": {"url": "data:..."}}
    content: str | list[dict[str, Any]] | None = None


class Trajectory(_Strict):
    """A raw chat, encoded on the server with the model's chat template (loss on assistant turns)."""

    messages: list[Message] = Field(min_length=1)
    fields: dict[str, B.FiniteFloat | list[B.FiniteFloat]] = Field(default_factory=dict)


class Inputs(_Strict):
    """Exactly one of `rows` (encoded on the client) or `trajectories` (encoded on the server)."""

    rows: list[EncodedRow] | None = None
    trajectories: list[Trajectory] | None = None


# ---- models and adapters -----------------------------------------------------------------------------
class CreateModelRequest(_Strict):
    base_model: str | None = None  # None: the server's only base model
    name: str | None = None  # a label shown in runs lists and the dashboard
    seed: B.Seed = 42  # as twinkle.initialize(seed=...): adapters start from what peft draws after this seed


class ModelInfo(_Strict):
    model_id: str
    base_model: str
    session_id: str
    name: str | None = None


class LoraConfigModel(BaseModel):
    """peft.LoraConfig's fields; any other LoraConfig field may be given too (validated by peft)."""

    model_config = ConfigDict(extra="allow")
    r: int = B.LORA_RANK.field(8)  # the server also caps it (model width, caps.max_lora_rank)
    lora_alpha: float = B.LORA_ALPHA.field(8)
    lora_dropout: float = B.LORA_DROPOUT.field(0.0)
    # a regex is matched against every module name of the base model: its length is bounded
    target_modules: str | list[Annotated[str, Field(max_length=B.MAX_TARGET_PATTERN)]] | None = Field(
        "all-linear", max_length=B.MAX_TARGET_PATTERN
    )
    use_rslora: bool = False
    bias: Literal["none"] = "none"


class AddAdapterRequest(_Strict):
    adapter_name: str = "default"
    lora_config: LoraConfigModel = Field(default_factory=LoraConfigModel)
    gradient_accumulation_steps: int = B.GRAD_ACCUMULATION.field(1)


class NamedComponent(_Strict):
    """A registered class by name with its keyword arguments (set_loss / set_optimizer / ...)."""

    adapter_name: str | None = None
    name: str
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)


class AddMetricRequest(NamedComponent):
    is_training: bool = True


class ForwardRequest(_Strict):
    adapter_name: str | None = None
    inputs: Inputs
    # 'embedding': each row's embedding (its last real token's final hidden state) instead of next-token
    # log-probs; a row's one-number `labels` (1 on a group's anchor) marks its group (twinkle-kit's
    # InfonceLoss rows). The server answers 400 naming a task it does not offer.
    task: str = Field("causal_lm", max_length=64)


class StepRequest(_Strict):
    adapter_name: str | None = None
    max_grad_norm: float | None = B.GRAD_CLIP.field(1.0)  # None: no clipping
    # twinkle-kit's per-call window: the adapter's accumulation window from this call on (None: unchanged)
    gradient_accumulation_steps: int | None = B.GRAD_ACCUMULATION.field(None)


class MetricRequest(_Strict):
    adapter_name: str | None = None
    is_training: bool = True


class SaveRequest(_Strict):
    adapter_name: str | None = None
    name: str = Field(min_length=1, description="checkpoint name (no '/')")
    save_training_state: bool = False  # also optimizer, scheduler and counters, for resume
    # the client's data position in samples (twinkle-kit's DataLoader.get_state()), kept with the training
    # state and returned by resume; only with save_training_state
    consumed_train_samples: int | None = Field(None, ge=0)


class LoadRequest(_Strict):
    adapter_name: str | None = None
    path: str = Field(description="tinker://<model_id>/weights/<name>, as returned by save")
    resume: bool = False  # also restore the optimizer/scheduler/counters saved with save_training_state


class LogRequest(_Strict):
    """Client-side numbers for the run's curves (e.g. the reward of an RL step)."""

    step: int | None = B.SEQ_ID.field(None)
    metrics: dict[str, B.FiniteFloat]


# ---- results -------------------------------------------------------------------------------------------
class FutureRef(_Strict):
    request_id: str
    model_id: str | None = None


class FutureResult(_Strict):
    request_id: str
    status: Literal["pending", "complete", "failed"]
    result: JsonValue = None
    error: str | None = None
    category: Literal["user", "server"] | None = None
    # pending only: where it waits ("active": running or queued in turn; "paused_rate_limit": held by
    # the tenant's input-token rate) and, for a person, behind what
    queue_state: Literal["active", "paused_rate_limit"] | None = None
    queue_reason: str | None = None


class ForwardResult(_Strict):
    loss: float | None
    metrics: dict[str, float] = Field(default_factory=dict)
    logprobs: list[list[float]] | None = None  # forward_only: per row, aligned with labels (0 first)
    embeddings: list[list[float]] | None = None  # forward_only(task='embedding'): per row, unit length


class StepResult(_Strict):
    stepped: bool
    grad_norm: float | None = None
    lr: float | None = None
    step: int | None = None


class CheckpointRef(_Strict):
    path: str
    model_id: str


class ImportAdapterRequest(_Strict):
    """A PEFT LoRA adapter folder made elsewhere, to train on from (see TwinkleClient.import_adapter)."""

    base_model: str
    name: str = Field(description="the checkpoint's name: tinker://<holder run>/weights/<name>")
    files: dict[str, str] = Field(description="adapter_config.json and adapter_model.safetensors, base64")


# ---- sampling ------------------------------------------------------------------------------------------
class SamplingParamsModel(_Strict):
    max_tokens: int = B.MAX_TOKENS.field(64)  # and within the model's context (the server checks)
    temperature: float = B.TEMPERATURE.field(1.0)
    top_k: int = B.TOP_K.field(0)  # 0 or -1: no top-k
    top_p: float = B.TOP_P.field(1.0)
    seed: B.Seed | None = None
    stop: (
        list[Annotated[str, Field(min_length=1, max_length=B.MAX_STOP_CHARS)]]
        | list[Annotated[int, Field(ge=0, le=2**31 - 1)]]
        | None
    ) = Field(None, max_length=B.MAX_STOP)
    num_samples: int = B.NUM_SAMPLES.field(1)


class SampleRequest(_Strict):
    """Prompts as token ids or chats (encoded with the model's generation prompt on the server).
    Weights: the base model, a training model's current adapter (snapshot), or a saved checkpoint."""

    base_model: str | None = None
    model_id: str | None = None
    adapter_name: str | None = None
    checkpoint: str | None = None
    prompts: list[list[int]] | None = None
    chats: list[list[Message]] | None = None
    sampling_params: SamplingParamsModel = Field(default_factory=SamplingParamsModel)


class SampledSequence(_Strict):
    tokens: list[int]
    logprobs: list[float] = Field(default_factory=list)
    stop_reason: str
    text: str | None = None


class SampleOutput(_Strict):
    sequences: list[SampledSequence]


class SampleResult(_Strict):
    outputs: list[SampleOutput]  # one per prompt


# ---- runs, checkpoints, server ----------------------------------------------------------------------
class CurvePoint(_Strict):
    step: int
    value: float
    t: float


class RunSummary(_Strict):
    model_id: str
    name: str | None = None
    base_model: str
    created_at: float
    last_request_time: float | None = None
    api: Literal["native", "tinker"]
    lora_rank: int | None = None
    steps: int = 0
    last_loss: float | None = None


class RunList(_Strict):
    runs: list[RunSummary]


class RunCurves(_Strict):
    model_id: str
    curves: dict[str, list[CurvePoint]]


class CheckpointInfo(_Strict):
    path: str
    model_id: str
    name: str
    kind: str
    created_at: float
    size_bytes: int | None = None


class CheckpointList(_Strict):
    checkpoints: list[CheckpointInfo]


class BaseModelInfo(_Strict):
    name: str
    backend: str
    max_context: int
    vocab_size: int
    live_adapters: int
    # Passes that served several models at once, and how many requests of each API rode in them.
    fused_passes: int = 0
    fused_requests: dict[str, int] = Field(default_factory=dict)  # {"native": n, "tinker": m}


class ServerStatus(_Strict):
    ready: bool
    base_models: list[BaseModelInfo]
    queue_depth: int  # requests waiting or running, all tenants
    tenant_queue_depth: int  # the caller's share
    completed_last_60s: int
    requests_per_s: float
    tokens_per_s: float
    tenant: str
    max_models_per_tenant: int | None = None


class ResultTypes(_Strict):
    """What `FutureResult.result` holds, per operation (documentation: `GET /twinkle/v1/result_types`)."""

    forward_backward: ForwardResult
    clip_grad_and_step: StepResult
    save: CheckpointRef
    sample: SampleResult
    calculate_metric: dict[str, float]
