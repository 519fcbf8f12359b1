"""Which weights a request's `model` names: a served base model, or a checkpoint the key may read
(its `tinker://` path, or the name it was saved under: the newest of that name wins).

Another tenant's unpublished checkpoint answers 404 exactly like one that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from twinkle.serve.core.checkpoints import sampler_adapter_name
from twinkle.serve.core.records import Checkpoint
from twinkle.serve.core.service import Service
from twinkle.serve.errors import NotFound
from twinkle.serve.openai.errors import OpenAIError
from twinkle.serve.runtime import Engine


@dataclass(frozen=True)
class Target:
    model: str  # the id answered back to the client
    engine: Engine
    checkpoint: Checkpoint | None = None

    @property
    def adapter(self) -> str | None:
        """The checkpoint's name on the sampler: the one the Tinker routes load it under too."""
        return None if self.checkpoint is None else sampler_adapter_name(self.checkpoint)


def _missing(model: str) -> OpenAIError:
    return OpenAIError(
        404, f"The model {model!r} does not exist or you do not have access to it.", "model", "model_not_found"
    )


class ModelResolver:
    def __init__(self, svc: Service):
        self.svc, self.rt = svc, svc.rt

    def resolve(self, tenant: str, model: str) -> Target:
        if model in self.rt.engines:
            return Target(model, self.rt.engines[model])
        if model.startswith("tinker://"):
            try:
                ckpt = self.svc.checkpoints.readable(tenant, model)
            except NotFound:
                raise _missing(model) from None
        else:
            ckpt = next((c for c in self.sampler_checkpoints(tenant) if c.name == model), None)
            if ckpt is None:
                raise _missing(model)
        base = self._base_of(ckpt)
        if base not in self.rt.engines:
            raise OpenAIError(
                404,
                f"checkpoint {model!r} was trained on base model {base!r}, which this server "
                f"no longer serves (it serves {sorted(self.rt.engines)})",
                "model",
                "model_not_found",
            )
        return Target(model, self.rt.engines[base], ckpt)

    def _base_of(self, ckpt: Checkpoint) -> str:
        run = self.rt.store.runs.get(ckpt.model_id)
        if run is None:
            raise OpenAIError(
                404,
                f"checkpoint {ckpt.tinker_path!r} belongs to a run that no longer exists",
                "model",
                "model_not_found",
            )
        return run.base_model

    def sampler_checkpoints(self, tenant: str) -> list[Checkpoint]:
        """The tenant's sampler checkpoints, newest first."""
        return [c for c in self.svc.checkpoints.of_tenant(tenant) if c.kind == "sampler"]

    def listing(self, tenant: str) -> list[dict]:
        base = [{"id": name, "object": "model", "created": 0, "owned_by": "twinkle"} for name in self.rt.engines]
        return base + [
            {
                "id": c.tinker_path,
                "object": "model",
                "created": int(c.created_at),
                "owned_by": tenant,
                "name": c.name,
                "parent": self._base_of(c),
            }
            for c in self.sampler_checkpoints(tenant)
        ]
