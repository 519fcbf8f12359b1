"""The records twinkle-kit's client returns, filled from our server's answers (pydantic, as theirs)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel


class TrainingRun(BaseModel):
    training_run_id: str  # our model_id: what list_checkpoints / get_latest_checkpoint_path take
    base_model: str
    name: str | None = None
    api: str | None = None  # 'native' or 'tinker'
    is_lora: bool = True
    lora_rank: int | None = None
    steps: int | None = None
    last_loss: float | None = None
    last_request_time: datetime | None = None


class Checkpoint(BaseModel):
    checkpoint_id: str  # the checkpoint's name
    checkpoint_type: str  # 'training' or 'sampler'
    time: datetime
    size_bytes: int | None = None
    twinkle_path: str  # tinker://<run>/weights/<name>: what resume_from_checkpoint and samplers take
    training_run_id: str


class SupportedModel(BaseModel):
    model_name: str


class ServerCapabilities(BaseModel):
    supported_models: list[SupportedModel]


class SaveResponse(BaseModel):
    twinkle_path: str
    checkpoint_dir: str | None = None  # where save_dir put a local copy, when the adapter has one

    def __str__(self) -> str:
        return self.twinkle_path


class ModelResult(BaseModel):
    """`.result`: what the call returned (a dict of metrics, the training configs text, ...)."""

    result: Any

    def __getitem__(self, key):
        return self.result[key]


class SampledSequence(BaseModel):
    stop_reason: str
    tokens: list[int]
    # twinkle-kit's shape: per token, [(token id, log-prob)] with the sampled token first
    logprobs: list[list[tuple[int, float]]] | None = None
    decoded: str | None = None
    # the prompt row plus this completion, encoded for training (input_ids, labels, messages, ...)
    new_input_feature: dict[str, Any] | None = None

    def get(self, key: str, default=None):
        return getattr(self, key, default)


class SampleResponse(BaseModel):
    sequences: list[SampledSequence]

    def get(self, key: str, default=None):
        return getattr(self, key, default)
