"""The Tinker JSON request bodies as typed models: the OpenAPI document (`/docs`, `/openapi.json`)
and the check every JSON route runs first (`parse`).

A body is validated against its model before the route reads its fields (which it then checks
further by hand, against the server's state): a field of the wrong type, a number outside its range
(twinkle.client.schema.bounds) or non-finite, or `null` where the SDK's own type has no None, is a
400 naming the field (the SDK's `x-should-retry` rules treat a 422 differently). `null` matters
because the SDK serialises a non-finite float as `null` (pydantic's JSON mode): an AdamParams
`learning_rate=nan` arrives as `"learning_rate": null`, which must not read as "not given" and train
at the default. The types follow the SDK 0.38's request models (Optional exactly where they are);
extra fields are allowed: the SDK adds new optional ones between releases. Validation is strict (no
`"3"` for 3, no `true` for 1, no `1.5` for an integer): the routes read the parsed object's attributes,
so what they read is what the client sent. A field holding a nested wire structure that a decoder of
its own reads (a prompt's chunks, a loss graph, adapter files) is typed as a plain JSON value here.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar, get_args

import annotated_types as at
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from twinkle.client.schema import bounds as B
from twinkle.serve.errors import BadRequest


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: dict) -> M:
    """`body` as a `model`; a 400 naming the first field that does not fit, in the words the
    hand-read fields use (`field = value is outside its range: ...`, `field must be an object`)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise BadRequest(_message(model, e.errors()[0])) from None


_KINDS = {"dict": "an object", "model": "an object", "list": "a list", "string": "a string", "bool": "true or false"}


def _message(model: type[BaseModel], err) -> str:
    loc = tuple(err.get("loc", ()))
    field, value, kind = ".".join(str(p) for p in loc) or "body", err.get("input"), err.get("type", "")
    if kind == "missing":
        return f"{field} is required"
    rng = range_of(model, loc)
    if rng is not None:
        if value is None:  # JSON encoders (pydantic's among them) send a NaN or an infinity as null
            sent = "" if rng.integer else " (a NaN or infinity is sent as null)"
            return f"{field} = null is not a number{sent}: it must be {rng}"
        return str(B.OutOfRange(field, value, str(rng)))
    what = next((v for k, v in _KINDS.items() if kind.startswith(k)), None)
    shown = repr(value) if len(repr(value)) <= 64 else f"{repr(value)[:30]}...({len(repr(value))} characters)"
    if what is not None:
        return f"{field} must be {what}, got {shown}"
    return f"{field} = {shown}: {err.get('msg')}"


def range_of(model: type[BaseModel], loc: tuple) -> B.Range | None:
    """The numeric range a (nested) field of `model` declares (its ge/gt/le/lt), None if it is no number."""
    info, cls = None, model
    for part in loc:
        fields = getattr(cls, "model_fields", None)
        if not isinstance(part, str) or fields is None or part not in fields:
            return None
        info = fields[part]
        cls = next((t for t in (info.annotation, *get_args(info.annotation)) if isinstance(t, type)), None)
    if info is None:
        return None
    kinds = (info.annotation, *get_args(info.annotation))
    if not ({int, float} & set(kinds)) or bool in kinds:
        return None
    ends = {type(m): m for m in info.metadata if isinstance(m, (at.Ge, at.Gt, at.Le, at.Lt))}
    lo, hi = ends.get(at.Ge) or ends.get(at.Gt), ends.get(at.Le) or ends.get(at.Lt)
    return B.Range(
        lo=None if lo is None else getattr(lo, "ge", getattr(lo, "gt", None)),
        hi=None if hi is None else getattr(hi, "le", getattr(hi, "lt", None)),
        lo_open=at.Gt in ends,
        hi_open=at.Lt in ends,
        integer=float not in kinds,
    )


class CreateSessionBody(_Body):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None


class SessionRef(_Body):
    session_id: str


class FinishReasonBody(_Body):
    type: str = "success"  # the SDK sends success, errored or interrupted; recorded as given


class FinishSessionBody(_Body):
    reason: FinishReasonBody | None = None
    detail: str | None = None


class LoraConfigBody(_Body):
    rank: int = 32  # within the server's max_lora_rank and the base model's widest layer: checked by the route
    seed: int | None = B.SEED.field(None)
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


class CreateModelBody(_Body):
    session_id: str
    model_seq_id: int = 0
    base_model: str
    lora_config: LoraConfigBody | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict | None = None


class ModelRef(_Body):
    model_id: str


class AdamParamsBody(_Body):
    """The SDK's AdamParams: every field a float with a default, none of them nullable."""

    learning_rate: float = B.LEARNING_RATE.field(1e-4)
    beta1: float = B.BETA.field(0.9)
    beta2: float = B.BETA.field(0.95)
    eps: float = B.EPS.field(1e-12)
    weight_decay: float = B.WEIGHT_DECAY.field(0.0)
    grad_clip_norm: float = B.TINKER_GRAD_CLIP.field(0.0, description="0: no clipping")


class OptimizerParamsBody(_Body):
    """Another optimizer family's step: its `type`, its fields beside it (an Adam family's are read as
    AdamParams, by name: an unknown one is refused)."""

    type: str | None = None


class OptimStepBody(_Body):
    model_id: str
    seq_id: int | None = B.SEQ_ID.field(None)
    adam_params: AdamParamsBody | None = None
    optimizer_params: OptimizerParamsBody | None = None


class SaveWeightsBody(_Body):
    model_id: str
    seq_id: int | None = B.SEQ_ID.field(None)
    path: str | None = Field(None, description="checkpoint name (default: generated)")
    overwrite: bool = False
    ttl_seconds: int | None = B.TTL_SECONDS.field(None)
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerBody(_Body):
    model_id: str
    seq_id: int | None = B.SEQ_ID.field(None)
    path: str | None = Field(None, description="a named sampler checkpoint; or give sampling_session_seq_id")
    sampling_session_seq_id: int | None = Field(None, description="an ephemeral sampler on the current weights")
    kind: Literal["snapshot", "inflight"] = Field(
        "snapshot", description="snapshot: fixed weights; inflight: the model's shared, updated target"
    )
    ttl_seconds: int | None = B.TTL_SECONDS.field(None)
    user_metadata: dict[str, str] | None = None


class SaveWeightsExternalBody(_Body):
    model_id: str
    path: str = Field(description="the exported checkpoint's name")
    seq_id: int | None = B.SEQ_ID.field(None)
    ttl_seconds: int | None = B.TTL_SECONDS.field(None)
    age_encryption_recipients: list[str] | None = Field(None, description="refused: exports are not encrypted")
    user_metadata: dict[str, str] | None = None  # not in the SDK's request: as save_weights takes it


class LoadWeightsBody(_Body):
    path: str = Field(description="tinker://{model_id}/weights/{name}")
    model_id: str | None = Field(None, description="load into this model (TrainingClient.load_state)")
    session_id: str | None = Field(None, description="or create a model from the checkpoint in this session")
    model_seq_id: int | None = None
    seq_id: int | None = B.SEQ_ID.field(None)
    base_model: str | None = None
    optimizer: bool = False
    user_metadata: dict[str, Any] | None = None


class CreateSamplingSessionBody(_Body):
    session_id: str
    sampling_session_seq_id: int = 0
    base_model: str | None = None
    model_path: str | None = Field(None, description="tinker://.../sampler_weights/{name} (or weights/)")


class ModelInputBody(_Body):
    # each chunk is read by tinker/sample_params.prompt_tokens (text) and tinker/images.py (images)
    chunks: list[dict] = Field(description='[{"type": "encoded_text", "tokens": [int, ...]}]')


class SamplingParamsBody(_Body):
    max_tokens: int | None = B.MAX_TOKENS.field(None, description="and prompt + max_tokens within the context")
    temperature: float = B.TEMPERATURE.field(1.0)
    top_k: int = B.TOP_K.field(-1)
    top_p: float = B.TOP_P.field(1.0)
    seed: B.Seed | None = None
    stop: Any = Field(None, description="a string, a list of strings or of token ids, or null (EOS)")


class ASampleBody(_Body):
    sampling_session_id: str  # the SDK also allows base_model / model_path alone; this server samples in a session
    seq_id: int | None = B.SEQ_ID.field(None)
    prompt: ModelInputBody
    num_samples: int = B.NUM_SAMPLES.field(1)
    sampling_params: SamplingParamsBody = SamplingParamsBody()
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    # a tensor ({data, dtype, shape}, dense or CSR), read by tinker/codec.decode_target_ids
    target_prompt_logprobs: dict | None = None
    record_stability_info: bool | None = None


class FutureBody(_Body):
    request_id: str


class SamplingSessionTarget(_Body):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: int = Field(0, ge=0)


class FuturesRetrieveBody(_Body):
    target: SamplingSessionTarget
    prev_cursor: int = Field(0, ge=0)
    timeout: float | None = Field(None, ge=0, allow_inf_nan=False, description="seconds; null: the server's")
    retrieved_request_ids: list[str] = []


class JoinSamplingSessionBody(_Body):
    sampling_session_id: str


class CreateCustomLossBody(_Body):
    session_id: str
    custom_loss_seq_id: int = Field(ge=0)
    name: str
    # [{name, rank}] and {format, nodes}: read by tinker/custom_loss.LossProgram.parse
    inputs: list
    graph: dict


class ImportAdapterBody(_Body):
    """A PEFT adapter folder made elsewhere (a twinkle route; the native API's ImportAdapterRequest)."""

    base_model: str
    name: str
    files: dict[str, str] = Field(description="adapter_config.json and adapter_model.safetensors, base64")
    session_id: str | None = None


class CopyWeightsBody(_Body):
    source_path: str
    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    ttl_seconds: int | None = B.TTL_SECONDS.field(None)
    weights_access_token: str | None = None


class SearchOwnerBody(_Body):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = None


class StatusQueryBody(_Body):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[str] | None = None


class SearchCursorBody(_Body):
    """A previous response's next_cursor."""

    last_created_at: str
    last_session_id: str


class SessionSearchBody(_Body):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: str | None = None
    owner: SearchOwnerBody = SearchOwnerBody()
    statuses: list[StatusQueryBody] | None = Field(None, min_length=1)
    limit: int = Field(50, ge=1, le=200)
    cursor: SearchCursorBody | None = None


class ProjectBody(_Body):
    project_id: str


class WeightsInfoBody(_Body):
    tinker_path: str


class TtlBody(_Body):
    ttl_seconds: int | None = B.TTL_SECONDS.field(None, description="seconds from now; null keeps it forever")


SCHEMAS: dict[str, dict] = {}  # component schemas the app adds to its OpenAPI document


def documented(model: type[BaseModel]) -> dict:
    """`openapi_extra` declaring `model` as a route's JSON body (the route still parses it itself)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    SCHEMAS.update(schema.pop("$defs", {}))
    SCHEMAS[model.__name__] = schema
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    }
