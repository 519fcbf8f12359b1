"""Training/sampling backends behind one small interface (`Backend`), chosen by name in the config."""

from twinkle.serve.backend.base import (AdamParams, Backend, Datum, ForwardResult, LoraSpec, SampledSeq,
                                        SampleParams, SampleResult, UserError)

__all__ = ["AdamParams", "Backend", "Datum", "ForwardResult", "LoraSpec", "SampleParams", "SampleResult",
           "SampledSeq", "UserError", "create_backend"]


def create_backend(name: str, base_model: str, model_path: str, **options) -> Backend:
    """`peft`: transformers + peft adapters, twinkle.loss losses, TorchSampler (the default)."""
    if name == "peft":
        from twinkle.serve.backend.peft_backend import PeftBackend

        return PeftBackend(base_model, model_path, **options)
    raise ValueError(f"unknown backend {name!r}; known: peft")
