"""The frozen base a backend loads, in the dtype its model entry names (`ModelEntry.dtype`).

"auto" is the library's rule (twinkle.model.base_dtype): bf16 where the device multiplies bf16 fast
and the base has 100M parameters or more, fp32 otherwise. The training engine and the sampler each
load through here, so they arrive at the same dtype and the sampler can use the engine's tensors
(twinkle.model.multi_lora.memory.share_frozen_weights matches on dtype): one copy of the base."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = ("auto", "float32", "bfloat16")


def load_frozen_base(model_path: str, dtype: str, device=None, trust_remote_code: bool = False) -> PreTrainedModel:
    from twinkle.model import base_dtype, vision

    if dtype not in DTYPES:
        raise ValueError(f"model dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype != "auto":
        return vision.load_pretrained(model_path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    model = vision.load_pretrained(model_path, dtype="auto", trust_remote_code=trust_remote_code)  # as stored
    n_params = sum(p.numel() for p in model.parameters())
    base_dtype.cast_parameters(model, base_dtype.resolve("auto", None, device or "cpu", n_params))
    return model
