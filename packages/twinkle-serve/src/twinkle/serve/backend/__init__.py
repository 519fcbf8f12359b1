"""Training/sampling backends behind one typed interface (`Backend`), chosen by the model entry."""

from twinkle.registry import Registry
from twinkle.serve.backend.base import (
    AdamParams,
    Backend,
    LoraSpec,
    RowsPass,
    SampledSeq,
    SampleParams,
    SampleResult,
    UserError,
)

__all__ = [
    "BACKENDS",
    "AdamParams",
    "Backend",
    "LoraSpec",
    "RowsPass",
    "SampleParams",
    "SampleResult",
    "SampledSeq",
    "UserError",
    "create_backend",
]


# Backends by the name a model entry gives (`backend: multi_lora`); a package adds its own through the
# entry-point group `twinkle.serve_backend` (see twinkle-serve's pyproject for the built-ins). A
# backend that runs on Ray remote groups is registered as `<name>_remote`.
BACKENDS: Registry[Backend] = Registry("serve backend", "twinkle.serve_backend", Backend)


def create_backend(base_model: str, model_path: str, backend: str = "multi_lora", **options) -> Backend:
    """The named backend. `multi_lora` is twinkle.model's MultiLoraModel (tenants fused into shared
    passes), sampling with TorchSampler; with `remote_group=` / `sampler_remote_group=` its training
    model / sampler run as twinkle.mesh remote groups (Ray actor groups after
    `twinkle.mesh.initialize(mode='ray', ...)`)."""
    name = backend
    if options.get("remote_group") or options.get("sampler_remote_group"):
        name = f"{backend}_remote"
        if name not in BACKENDS.names():
            remote = [n.removesuffix("_remote") for n in BACKENDS.names() if n.endswith("_remote")]
            raise ValueError(f"backend {backend!r} does not run on Ray remote groups; {', '.join(remote)} does")
    return BACKENDS.get(name)(base_model, model_path, **options)
