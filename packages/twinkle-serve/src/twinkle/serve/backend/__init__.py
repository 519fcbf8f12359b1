"""Training/sampling backends behind one small interface (`Backend`), chosen by name in the config."""

from twinkle.serve.backend.base import (AdamParams, Backend, Datum, ForwardResult, LoraSpec, SampledSeq,
                                        SampleParams, SampleResult, UserError)

__all__ = ["AdamParams", "Backend", "Datum", "ForwardResult", "LoraSpec", "SampleParams", "SampleResult",
           "SampledSeq", "UserError", "create_backend"]


def create_backend(name: str, base_model: str, model_path: str, **options) -> Backend:
    """`multi_lora` (default): twinkle.model's MultiLoraModel, tenants fused into shared passes.
    `peft`: one peft adapter per tenant, run one request at a time. Both sample with TorchSampler.
    `remote_group=` / `sampler_remote_group=` (multi_lora only): the training model / the sampler as
    twinkle.mesh remote groups (Ray actor groups after `twinkle.mesh.initialize(mode='ray', ...)`)."""
    if options.get("remote_group") or options.get("sampler_remote_group"):
        if name != "multi_lora":
            raise ValueError(f"remote groups run the 'multi_lora' backend, not {name!r}")
        from twinkle.serve.backend.remote import RemoteBackend

        return RemoteBackend(base_model, model_path, **options)
    if name == "multi_lora":
        from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend

        return MultiLoraBackend(base_model, model_path, **options)
    if name == "peft":
        from twinkle.serve.backend.peft_backend import PeftBackend

        return PeftBackend(base_model, model_path, **options)
    raise ValueError(f"unknown backend {name!r}; known: multi_lora, peft")
