"""The Tinker JSON request bodies as typed models, for the OpenAPI document (`/docs`, `/openapi.json`).

The routes read the same fields by hand, checking each with a 400 that names it (the SDK's own
`x-should-retry` rules treat a 422 differently); these models say what a client may send, with the
ranges the routes check (twinkle.client.schema.bounds). Extra
fields are allowed: the SDK adds new optional ones between releases.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from twinkle.client.schema import bounds as B
from twinkle.serve.backend import AdamParams, LoraSpec


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class CreateSessionBody(_Body):
    tags: list[str] = []
    user_metadata: dict[str, str] | None = None
    sdk_version: str | None = None


class SessionRef(_Body):
    session_id: str


class CreateModelBody(_Body):
    session_id: str
    model_seq_id: int = 0
    base_model: str
    lora_config: LoraSpec | None = None
    user_metadata: dict[str, str] | None = None


class ModelRef(_Body):
    model_id: str


class OptimStepBody(_Body):
    model_id: str
    seq_id: int | None = None
    adam_params: AdamParams | None = None


class SaveWeightsBody(_Body):
    model_id: str
    seq_id: int | None = B.SEQ_ID.field(None)
    path: str | None = Field(None, description="checkpoint name (default: generated)")
    overwrite: bool = False
    ttl_seconds: int | None = B.TTL_SECONDS.field(None)
    user_metadata: dict[str, str] | None = None


class SaveWeightsForSamplerBody(_Body):
    model_id: str
    seq_id: int | None = None
    path: str | None = Field(None, description="a named sampler checkpoint; or give sampling_session_seq_id")
    sampling_session_seq_id: int | None = Field(None, description="an ephemeral sampler on the current weights")
    ttl_seconds: int | None = None
    user_metadata: dict[str, str] | None = None


class LoadWeightsBody(_Body):
    path: str = Field(description="tinker://{model_id}/weights/{name}")
    model_id: str | None = Field(None, description="load into this model (TrainingClient.load_state)")
    session_id: str | None = Field(None, description="or create a model from the checkpoint in this session")
    model_seq_id: int | None = None
    seq_id: int | None = None
    optimizer: bool = False
    user_metadata: dict[str, str] | None = None


class CreateSamplingSessionBody(_Body):
    session_id: str
    sampling_session_seq_id: int = 0
    base_model: str | None = None
    model_path: str | None = Field(None, description="tinker://.../sampler_weights/{name} (or weights/)")


class ModelInputBody(_Body):
    chunks: list[dict] = Field(description='[{"type": "encoded_text", "tokens": [int, ...]}]')


class SamplingParamsBody(_Body):
    max_tokens: int | None = B.MAX_TOKENS.field(None, description="and prompt + max_tokens within the context")
    temperature: float = B.TEMPERATURE.field(1.0)
    top_k: int = B.TOP_K.field(-1)
    top_p: float = B.TOP_P.field(1.0)
    seed: B.Seed | None = None
    stop: str | list[str] | list[int] | None = None


class ASampleBody(_Body):
    sampling_session_id: str
    seq_id: int | None = None
    prompt: ModelInputBody
    num_samples: int = B.NUM_SAMPLES.field(1)
    sampling_params: SamplingParamsBody = SamplingParamsBody()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0


class FutureBody(_Body):
    request_id: str


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
