"""Training/sampling backends behind one typed interface (`Backend`), chosen by the model entry."""

from twinkle.serve.backend.base import (AdamParams, Backend, Datum, DatumsPass, ForwardResult, LoraSpec, Pass,
                                        RowsPass, SampledSeq, SampleParams, SampleResult, UserError)

__all__ = ["AdamParams", "Backend", "Datum", "DatumsPass", "ForwardResult", "LoraSpec", "Pass", "RowsPass",
           "SampleParams", "SampleResult", "SampledSeq", "UserError", "create_backend"]


def create_backend(base_model: str, model_path: str, **options) -> Backend:
    """twinkle.model's MultiLoraModel (tenants fused into shared passes), sampling with TorchSampler;
    with `remote_group=` / `sampler_remote_group=` the training model / the sampler run as twinkle.mesh
    remote groups (Ray actor groups after `twinkle.mesh.initialize(mode='ray', ...)`)."""
    if options.get("remote_group") or options.get("sampler_remote_group"):
        from twinkle.serve.backend.remote import RemoteBackend

        return RemoteBackend(base_model, model_path, **options)
    from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend

    return MultiLoraBackend(base_model, model_path, **options)
