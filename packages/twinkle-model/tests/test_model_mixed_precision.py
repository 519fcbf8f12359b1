"""mixed_precision: bf16 autocast trains on CPU within a stated tolerance of fp32; fp16 is refused on
CPU by name and loss-scaled with torch.amp's GradScaler on CUDA."""

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel

BF16_LOSS_RTOL = 2e-2  # bf16 keeps 8 mantissa bits: ~0.4% per rounding, a few roundings per layer


def _losses(rows, mixed_precision, device=None, steps=3):
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL, mixed_precision=mixed_precision, device=device)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    out = []
    for _ in range(steps):
        out.append(model.forward_backward(inputs=rows)["loss"])
        assert model.clip_grad_and_step()["stepped"]
    return out, model


def test_bf16_autocast_on_cpu_is_close_to_fp32(rows):
    fp32, _ = _losses(rows, None)
    bf16, model = _losses(rows, "bf16")
    assert bf16 == pytest.approx(fp32, rel=BF16_LOSS_RTOL)
    assert bf16 != fp32  # autocast really ran in bf16
    assert bf16[-1] < bf16[0]  # and it trains
    assert all(p.dtype == torch.float32 for _, p in model.states["default"].named_params())  # fp32 master weights


@pytest.mark.no_float
def test_fp16_is_refused_on_cpu_by_name():
    with pytest.raises(ValueError, match="mixed_precision='fp16' needs CUDA.*use 'bf16'"):
        TransformersModel(model_id=TEST_MODEL, mixed_precision="fp16", device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (gathered by the gpu session)")
def test_fp16_on_cuda_scales_the_loss_and_matches_fp32(rows):
    fp32, _ = _losses(rows, None, device="cuda")
    fp16, model = _losses(rows, "fp16", device="cuda")
    scaler = model.states["default"].grad_scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() > 1.0
    assert fp16 == pytest.approx(fp32, rel=1e-2)
