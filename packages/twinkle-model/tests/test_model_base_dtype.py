"""The frozen base in bf16 (issue 47): `base_dtype` resolves as documented, the base's weights are held
in bf16 while LoRA factors and their AdamW moments stay fp32 (TransformersModel through peft, and
MultiLoraModel's own layers), buffers keep their dtype, mixed_precision='bf16' no longer keeps an fp32
base, a model whose every weight trains gets fp32 master weights back, and the loss stays within the
mixed-precision tolerance of the fp32 run."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel
from twinkle.model import base_dtype as base_dtypes
from twinkle.model.multi_lora import MultiLoraModel

BF16_LOSS_RTOL = 2e-2  # test_model_mixed_precision's: bf16 keeps 8 mantissa bits, a few roundings per layer
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def test_resolution_rules(monkeypatch):
    big, small = base_dtypes.AUTO_BF16_MIN_PARAMS, base_dtypes.AUTO_BF16_MIN_PARAMS - 1
    assert base_dtypes.resolve("fp32", "bf16", "cpu", big) == torch.float32  # explicit wins
    assert base_dtypes.resolve("bf16", None, "cpu", 10) == torch.bfloat16
    assert base_dtypes.resolve("auto", "bf16", "cpu", 10) == torch.bfloat16  # autocast multiplies in bf16 anyway
    assert base_dtypes.resolve("auto", "fp16", "cuda", big) == torch.float32
    monkeypatch.setattr(base_dtypes, "fast_bf16", lambda device: True)
    assert base_dtypes.resolve("auto", None, "cpu", big) == torch.bfloat16
    assert base_dtypes.resolve("auto", None, "cpu", small) == torch.float32  # the test models: fp32 everywhere
    monkeypatch.setattr(base_dtypes, "fast_bf16", lambda device: False)
    assert base_dtypes.resolve("auto", None, "cpu", big) == torch.float32
    with pytest.raises(ValueError, match="base_dtype must be 'auto', 'bf16' or 'fp32', got 'half'"):
        base_dtypes.resolve("half", None, "cpu", 10)


def test_a_cpu_forced_to_avx2_has_no_fast_bf16(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not base_dtypes.fast_bf16("cpu")
    assert base_dtypes.fast_bf16("cuda")


def _losses(rows, steps=3, **kwargs):
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL, **kwargs)
    model.add_adapter_to_model("default", LORA)
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for _ in range(steps):
        losses.append(model.forward_backward(rows)["loss"])
        assert model.clip_grad_and_step()["stepped"]
    return losses, model


def _base_and_lora_dtypes(named_params) -> tuple[set, set]:
    base, lora = set(), set()
    for name, p in named_params:
        (lora if "lora_" in name else base).add(p.dtype)
    return base, lora


def test_transformers_model_bf16_base_fp32_adapter_and_moments(rows):
    fp32, _ = _losses(rows)
    bf16, model = _losses(rows, base_dtype="bf16")
    base, lora = _base_and_lora_dtypes(model.hf_model.named_parameters())
    assert base == {torch.bfloat16} and lora == {torch.float32}
    moments = [t for s in model.states["default"].optimizer.state.values() for t in s.values() if t.dim()]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    rotary = [b for n, b in model.hf_model.named_buffers() if "inv_freq" in n]
    assert rotary and all(b.dtype == torch.float32 for b in rotary)
    assert model.get_info()["base_dtype"] == "bf16"
    assert bf16 == pytest.approx(fp32, rel=BF16_LOSS_RTOL) and bf16 != fp32 and bf16[-1] < bf16[0]


def test_mixed_precision_bf16_holds_the_base_in_bf16_and_full_training_gets_fp32_back():
    model = TransformersModel(model_id=TEST_MODEL, mixed_precision="bf16")
    assert model.get_info()["base_dtype"] == "bf16"  # not an fp32 base under autocast (2x its bytes)
    model.set_optimizer("AdamW", lr=1e-3)  # no adapter: the whole model trains
    assert {p.dtype for p in model.hf_model.parameters()} == {torch.float32}
    assert TransformersModel(model_id=TEST_MODEL).get_info()["base_dtype"] == "fp32"  # auto, a 0.15M model
    with pytest.raises(ValueError, match="not both"):
        TransformersModel(model_id=TEST_MODEL, torch_dtype=torch.float32, base_dtype="bf16")


def test_multi_lora_bf16_base_keeps_fp32_factors_and_moments(rows):
    losses = {}
    for dtype in ("fp32", "bf16"):
        model = MultiLoraModel(TEST_MODEL, base_dtype=dtype)
        model.add_adapter_to_model("ada", LORA)
        model.set_optimizer("AdamW", adapter_name="ada", lr=1e-2)
        losses[dtype] = []
        for _ in range(3):
            losses[dtype].append(model.forward_backward(rows, "ada")["loss"])
            model.clip_grad_and_step(adapter_name="ada")
    assert model.get_info()["base_dtype"] == "bf16"
    assert {p.dtype for n, p in model.base.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    assert {p.dtype for p in model.adapters["ada"].params} == {torch.float32}
    moments = [t for s in model.adapters["ada"].optimizer.state.values() for t in s.values() if t.dim()]
    assert moments and {t.dtype for t in moments} == {torch.float32}
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=BF16_LOSS_RTOL) and losses["bf16"] != losses["fp32"]
