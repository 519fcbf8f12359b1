"""Server configuration: base models, backend, sampler batch, limits, Ray placement. Unknown keys are errors.

Read from a TOML, JSON or YAML file (`--config`), or built in code. With no file the server serves
the embedded default model (`twinkle.hub.DEFAULT_MODEL`) with the `multi_lora` backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from twinkle.serve.core.bounds import ServerCaps

if TYPE_CHECKING:
    from twinkle.model.multi_lora.planner import FusionPlanner


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelEntry(_Strict):
    name: str  # the base_model clients name, e.g. "twinkle://qwen3-demo" or a hub id
    # Other names clients may send for this same model (one engine, one copy of the weights): e.g. the
    # hub id a script hard-codes, served by a local model. Runs and samplers record `name`.
    aliases: list[str] = Field(default_factory=list)
    path: str | None = None  # a local folder; default: twinkle.hub.resolve_model_path(name)
    # A name in twinkle.serve.backend.BACKENDS; unset: "multi_lora", or "multi_lora_remote" where the
    # entry names a remote group (the backend that places its parts on them).
    backend: str = "multi_lora"
    # The frozen base's dtype; "auto": bf16 where the device multiplies bf16 fast and the base has 100M
    # parameters or more, fp32 otherwise (twinkle.model.base_dtype; LoRA factors and AdamW state stay fp32).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_sampler_batch: int = Field(64, ge=1)
    # Code shipped inside a model folder (config auto_map) runs only if the operator opts in here.
    trust_remote_code: bool = False
    # Recompute each decoder layer in backward instead of keeping its activations (long contexts on
    # little memory, at a second forward's cost): twinkle.model.multi_lora.MultiLoraModel.
    activation_checkpointing: bool = False
    # Ray mode (needs the `ray` section): the training model and/or the sampler as remote groups of
    # actors on these DeviceGroups (twinkle.mesh); None keeps that part in the server process.
    remote_group: str | None = None
    sampler_remote_group: str | None = None

    @field_validator("backend", mode="before")
    @classmethod
    def _known_backend(cls, value):
        from twinkle.serve.backend import BACKENDS

        BACKENDS.get(value)  # an unknown name fails here, at config load, listing the known ones
        return value

    @model_validator(mode="after")
    def _remote_backend(self):
        """A remote group is placed by a backend built on remote groups, chosen here by name."""
        from twinkle.serve.backend import BACKENDS

        keys = [k for k in ("remote_group", "sampler_remote_group") if getattr(self, k) is not None]
        if not keys:
            return self
        if "backend" not in self.model_fields_set:
            self.backend = "multi_lora_remote"
        elif not BACKENDS.get(self.backend).runs_on_remote_groups:
            remote = [n for n in BACKENDS.names() if BACKENDS.get(n).runs_on_remote_groups]
            raise ValueError(
                f"model {self.name!r}: backend {self.backend!r} does not run on Ray remote groups "
                f"({', '.join(keys)}); set backend to one that does: {', '.join(repr(n) for n in remote)}"
            )
        return self


class RayGroup(_Strict):
    """A twinkle.mesh DeviceGroup: `ranks` Ray actors, one `device_type` device each."""

    name: str = Field(min_length=1)
    ranks: int = Field(ge=1)
    device_type: Literal["cpu", "cuda"] = "cpu"
    cpus_per_rank: float | None = Field(None, gt=0)  # Ray CPUs (= torch threads) per rank; default 1
    placement: Literal["pack", "spread"] = "pack"  # "spread": one rank per Ray node


class RayConfig(_Strict):
    """`twinkle.mesh.initialize(mode='ray', groups=..., address=...)` at server start."""

    address: str | None = None  # "auto", "ray://host:10001"; None joins a running local Ray or starts one
    groups: list[RayGroup] = Field(min_length=1)
    # A call to a remote group that gets no answer this long (a rank stopped, hung, or partitioned away)
    # fails naming the ranks still out, and the group is rebuilt as after a dead rank. None: no limit.
    call_timeout_s: float | None = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _unique_names(self):
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"ray.groups names must be unique, got {names}")
        return self


class Limits(_Strict):
    """Per tenant. None = unlimited. Exceeding one answers 429 with Retry-After, except the input-token
    rate, whose excess work queues (up to max_queue_wait_s)."""

    max_models: int | None = Field(32, ge=1)
    requests_per_s: float | None = Field(None, gt=0)
    input_tokens_per_s: float | None = Field(None, gt=0)
    max_input_tokens: int | None = Field(None, ge=1)
    # work over input_tokens_per_s is queued (Tinker queue_state "paused_rate_limit"), not refused,
    # while its turn comes within this many seconds; past it, 429 with Retry-After
    max_queue_wait_s: float = Field(120.0, gt=0, le=86400)
    # creations per key per minute (a burst of this many, refilled over the minute) of every object a
    # key creates: sessions (Tinker create_session, native models, adapter imports), adapters (Tinker
    # create_model, native add_adapter_to_model), sampling sessions (Tinker create_sampling_session and
    # save_weights_for_sampler's ephemeral samplers) and checkpoints (every save, either API, imports)
    sessions_per_minute: float | None = Field(600, gt=0)
    # sessions of one key alive at once (not finished, heard from in the last minute: the SDK heartbeats
    # every 10 s): a burst of creations holds no more rows than this; past it 429, Retry-After 60 s
    max_live_sessions: int | None = Field(256, ge=1)
    adapters_per_minute: float | None = Field(240, gt=0)
    samplers_per_minute: float | None = Field(600, gt=0)
    checkpoints_per_minute: float | None = Field(240, gt=0)


class Fusion(_Strict):
    """Which queued passes of different runs share one pass over the base weights: the thresholds of
    the scheduler's planner (twinkle.model.multi_lora.planner.FusionPlanner). Training and forward-only
    passes never share one (the engine runs them as two)."""

    fuse_max_tokens: int = Field(512, ge=1)  # a batch of more padded tokens (rows x longest row) runs alone
    group_max_tokens: int = Field(2048, ge=1)  # padded tokens one fused pass may hold; a bigger batch runs sliced
    max_padding: float = Field(0.25, ge=0, lt=1)  # largest fraction of a fused pass that may be padding
    max_fuse: int = Field(8, ge=1)  # runs one fused pass may hold

    def planner(self) -> FusionPlanner:
        from twinkle.model.multi_lora.planner import FusionPlanner

        return FusionPlanner(**self.model_dump())


class ServeConfig(_Strict):
    models: list[ModelEntry] = Field(default_factory=list)
    limits: Limits = Field(default_factory=Limits)
    tenant_limits: dict[str, Limits] = Field(default_factory=dict)  # per key name, replacing `limits`
    long_poll_s: float = Field(25.0, gt=0, le=40)
    max_request_bytes: int = Field(64 * 2**20, ge=1024)  # larger request bodies answer 413
    # A finished future's result stays retrievable this long, then its row (and its sampling-queue
    # entry) is removed: the tables would otherwise grow by a row per request forever.
    futures_keep_hours: float = Field(24.0, gt=0)
    # Graceful shutdown (SIGTERM): accepted work may run this long before the server stops anyway.
    drain_s: float = Field(30.0, ge=0)
    # Slow and stalled clients (twinkle.serve.slow_clients): a request's head must arrive within
    # header_timeout_s, its body within body_timeout_s after that; a client that reads nothing of a
    # response for write_stall_s is dropped; an idle kept-alive connection is closed after keep_alive_s.
    header_timeout_s: float = Field(10.0, gt=0)
    body_timeout_s: float = Field(120.0, gt=0)
    write_stall_s: float = Field(60.0, gt=0)
    keep_alive_s: float = Field(75.0, gt=0)
    # Open connections past this answer 503 (uvicorn's limit_concurrency); default: the process's open
    # file limit (raised to its hard limit at start) less a reserve for model, database and log files.
    max_connections: int | None = Field(None, ge=1)
    # stable_reinforce's records of sampled sequences (tinker/provenance.py): trainable this long after
    # their last use (Tinker's documented day), and at most this many recorded tokens per key (the
    # least recently used go first), so a tenant sampling forever cannot grow the store without bound.
    stability_ttl_s: float = Field(86400.0, gt=0)
    stability_max_tokens: int = Field(4_000_000, ge=1)
    # Cap on the LoRA memory (weights, grads, Adam moments) of all live adapters.
    max_adapter_memory_mb: float | None = Field(None, gt=0)
    # Adapter residency (twinkle.serve.core.adapter_memory): an idle adapter's weights and optimizer
    # state move off the model to host memory, then to disk, and come back on its next call. Under the
    # cap, the least recently used are parked to admit a new or returning adapter; off, a new adapter
    # past the cap is refused (409) and nothing ever moves.
    adapter_offload: bool = True
    adapter_idle_offload_s: float | None = Field(600.0, gt=0)  # idle this long: to host memory (None: never)
    adapter_idle_spill_s: float | None = Field(3600.0, gt=0)  # parked this long: to disk (None: never)
    # Host memory for parked adapters; past it, the least recently parked go to disk (None: no cap).
    max_parked_adapter_memory_mb: float | None = Field(None, gt=0)
    # Where spilled adapters go (safetensors + JSON); default <data_dir>/adapter_spill. Emptied at start.
    adapter_spill_dir: str | None = None
    # Experiment trackers for every run's curves, as transformers' report_to: "tensorboard", "wandb",
    # "mlflow", "trackio", a list, or none (the default); written under <data_dir>/runs/.
    report_to: str | list[str] | None = None

    @field_validator("report_to")
    @classmethod
    def _known_trackers(cls, value):
        from twinkle.metric.trackers import parse_report_to

        parse_report_to(value)  # an unknown name fails at config load, listing the known ones
        return value

    ray: RayConfig | None = None
    fusion: Fusion = Field(default_factory=Fusion)
    # what one request may cost, and the caps on what grows with requests (twinkle.serve.core.bounds)
    caps: ServerCaps = Field(default_factory=ServerCaps)

    @model_validator(mode="after")
    def _model_names_unique(self):
        seen: set[str] = set()
        for m in self.models:
            for n in (m.name, *m.aliases):
                if n in seen:
                    raise ValueError(f"model name {n!r} is given twice (as a name or an alias of models)")
                seen.add(n)
        return self

    @model_validator(mode="after")
    def _remote_groups_exist(self):
        known = [g.name for g in self.ray.groups] if self.ray else []
        for m in self.models:
            for key in ("remote_group", "sampler_remote_group"):
                group = getattr(m, key)
                if group is None:
                    continue
                if self.ray is None:
                    raise ValueError(f"model {m.name!r}: {key}={group!r} needs a `ray` section with that group")
                if group not in known:
                    raise ValueError(f"model {m.name!r}: {key}={group!r} is not one of ray.groups {known}")
        return self

    def model_entries(self) -> list[ModelEntry]:
        if self.models:
            return self.models
        from twinkle.hub import DEFAULT_MODEL

        return [ModelEntry(name=DEFAULT_MODEL)]


def read_config_file(path: str | Path) -> dict:
    """A config file's contents (TOML, YAML or JSON by suffix), before validation."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        return tomllib.loads(text)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        return yaml.safe_load(text) or {}
    return json.loads(text)


def load_config(path: str | Path | None) -> ServeConfig:
    if path is None:
        return ServeConfig()
    data = read_config_file(path)
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"invalid config {path}:\n{e}") from None
