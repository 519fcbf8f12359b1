"""The server's frozen base (issue 47): a model entry's dtype "auto" (the default) holds the base in bf16
where the device multiplies bf16 fast and the base is large (twinkle.model.base_dtype), and the sampler
uses the training engine's tensors: one copy of the base, in one dtype, whatever the entry says."""

from __future__ import annotations

import pytest
import torch

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.model import base_dtype
from twinkle.serve.backend.multi_lora_backend import MultiLoraBackend
from twinkle.serve.config import ModelEntry


def _storages(module: torch.nn.Module) -> dict[int, torch.dtype]:
    return {p.untyped_storage().data_ptr(): p.dtype for p in module.parameters()}


def _frozen(module: torch.nn.Module) -> dict[int, torch.dtype]:
    return {p.untyped_storage().data_ptr(): p.dtype for n, p in module.named_parameters() if ".lora_" not in n}


@pytest.mark.parametrize(
    "dtype, large_and_fast, expected",
    [("auto", True, torch.bfloat16), ("auto", False, torch.float32), ("float32", True, torch.float32)],
    ids=["auto-fast-large", "auto-small", "float32"],
)
def test_one_copy_of_the_base_in_the_entrys_dtype(monkeypatch, dtype, large_and_fast, expected):
    if large_and_fast:  # as a 100M+ model on an AVX-512 BF16 / AMX CPU or a GPU: the test model stands in
        monkeypatch.setattr(base_dtype, "AUTO_BF16_MIN_PARAMS", 1)
        monkeypatch.setattr(base_dtype, "fast_bf16", lambda device: True)
    backend = MultiLoraBackend(TEST_MODEL, str(resolve_model_path(TEST_MODEL)), dtype=dtype)
    engine = _storages(backend.engine.base)
    assert set(engine.values()) == {expected}
    assert backend.base_dtype() == base_dtype.name(expected)
    sampler = _frozen(backend.sampler.model)
    assert sampler and set(sampler) <= set(engine), "the sampler holds a second copy of the base"


def test_the_entrys_default_is_auto_and_a_bad_dtype_is_named():
    assert ModelEntry(name=TEST_MODEL).dtype == "auto"
    with pytest.raises(ValueError, match="float16"):
        ModelEntry(name=TEST_MODEL, dtype="float16")
