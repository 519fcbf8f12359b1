"""Training/sampling backends behind one typed interface (`Backend`), chosen by the model entry."""

from twinkle.registry import Registry
from twinkle.serve.backend.base import (
    AdamParams,
    Backend,
    LoraSpec,
    RowsPass,
    UserError,
)

__all__ = [
    "BACKENDS",
    "AdamParams",
    "Backend",
    "LoraSpec",
    "RowsPass",
    "UserError",
    "create_backend",
]


# Backends by the name a model entry gives (`backend = "multi_lora"`); a package adds its own through
# the entry-point group `twinkle.serve_backend` (see twinkle-serve's pyproject for the built-ins).
BACKENDS: Registry[Backend] = Registry("serve backend", "twinkle.serve_backend", Backend)


def create_backend(base_model: str, model_path: str, backend: str = "multi_lora", **options) -> Backend:
    """The named backend, built from a model entry's options. `multi_lora` is twinkle.model's
    MultiLoraModel (tenants fused into shared passes), sampling with TorchSampler; `multi_lora_remote`
    the same with its training model and sampler as twinkle.mesh groups (`remote_group=` /
    `sampler_remote_group=`: Ray actor groups after `twinkle.mesh.initialize(mode='ray', ...)`, plain
    objects in this process where a group is None)."""
    return BACKENDS.get(backend)(base_model, model_path, **options)
