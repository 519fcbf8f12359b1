"""Server configuration: base models, backend, sampler batch, limits. Unknown keys are errors.

Read from a TOML, JSON or YAML file (`--config`), or built in code. With no file the server serves
the embedded default model (`twinkle.hub.DEFAULT_MODEL`) with the `multi_lora` backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelEntry(_Strict):
    name: str  # the base_model clients name, e.g. "twinkle://qwen3-demo" or a hub id
    path: str | None = None  # a local folder; default: twinkle.hub.resolve_model_path(name)
    backend: Literal["multi_lora", "peft"] = "multi_lora"
    dtype: Literal["float32", "bfloat16"] = "float32"
    max_sampler_batch: int = Field(64, ge=1)


class Limits(_Strict):
    """Per tenant. None = unlimited. Exceeding one answers 429 with Retry-After."""

    max_models: int | None = Field(32, ge=1)
    requests_per_s: float | None = Field(None, gt=0)
    input_tokens_per_s: float | None = Field(None, gt=0)
    max_input_tokens: int | None = Field(None, ge=1)


class ServeConfig(_Strict):
    models: list[ModelEntry] = Field(default_factory=list)
    limits: Limits = Field(default_factory=Limits)
    tenant_limits: dict[str, Limits] = Field(default_factory=dict)  # per key name, replacing `limits`
    long_poll_s: float = Field(25.0, gt=0, le=40)

    def model_entries(self) -> list[ModelEntry]:
        if self.models:
            return self.models
        from twinkle.hub import DEFAULT_MODEL

        return [ModelEntry(name=DEFAULT_MODEL)]


def load_config(path: str | Path | None) -> ServeConfig:
    if path is None:
        return ServeConfig()
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"invalid config {path}:\n{e}") from None
