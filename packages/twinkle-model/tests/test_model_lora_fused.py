"""The fused LoRA linear on a bf16 base (`twinkle.model.lora_fused`, issue 47): its factor gradients are
as close to an fp32 base's as peft's own bf16-base path (where the earlier prototype, factors multiplied
in bf16 inside the base GEMM, was ~100x further at the layer), lora_dropout still draws on the x that
feeds A, TransformersModel uses it on a bf16 base with peft's names and state dict, and an fp32 base
runs peft's forward unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from transformers import AutoModelForCausalLM

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel
from twinkle.model.lora_fused import FusedLoraLinear, fuse

N, D_IN, D_OUT, R = 384, 160, 224, 8


class _Proj(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(D_IN, D_OUT, bias=True)

    def forward(self, x):
        return self.proj(x)


class _BF16Factors(PeftLoraLinear):
    """The earlier prototype: the factors cast to bf16, the LoRA term added by the base's addmm."""

    def forward(self, x, *args, **kwargs):
        name, w = self.active_adapters[0], self.base_layer.weight
        a, b = self.lora_A[name].weight.to(x.dtype), self.lora_B[name].weight.to(x.dtype)
        y = F.linear(x, w, self.base_layer.bias)
        return torch.addmm(y, x @ a.t(), b.t(), alpha=self.scaling[name])


class _FixedMask(torch.nn.Module):
    """A dropout draw made deterministic: both paths see the same mask (values 0 and 2: exact in bf16)."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, x):
        return x * self.mask.to(x.dtype)


def _layer(dtype, kind: str, dropout_mask=None):
    torch.manual_seed(0)
    model = get_peft_model(_Proj(), LoraConfig(r=R, lora_alpha=2 * R, target_modules=["proj"], lora_dropout=0.1))
    layer = model.base_model.model.proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.05)  # a trained B (peft starts it at zero)
        layer.base_layer.to(dtype)
    layer.lora_dropout["default"] = _FixedMask(dropout_mask) if dropout_mask is not None else torch.nn.Identity()
    if kind == "fused":
        fuse(model)
    elif kind == "bf16 factors":
        layer.__class__ = _BF16Factors
    return model, layer


def _grads(kind: str, dtype, x_N_I, g_N_O, dropout_mask=None):
    model, layer = _layer(dtype, kind, dropout_mask)
    x = x_N_I.to(dtype, copy=True).requires_grad_()
    y = model(x)
    y.backward(g_N_O.to(dtype))
    return y.float(), layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad, x.grad.float()


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _bf16_exact_inputs():
    g = torch.Generator().manual_seed(1)
    # inputs a bf16 base sees exactly: the fp32 reference then differs only in how the layer computes
    x = torch.randn(N, D_IN, generator=g).bfloat16().float()
    grad_out = torch.randn(N, D_OUT, generator=g).bfloat16().float()
    return x, grad_out


def test_factor_gradients_as_exact_as_peft_at_the_layer():
    x, grad_out = _bf16_exact_inputs()
    y32, a32, b32, x32 = _grads("peft", torch.float32, x, grad_out)  # bf16-rounded weights, as the bases
    dist = {}
    for kind in ("peft", "fused", "bf16 factors"):
        y, a, b, gx = _grads(kind, torch.bfloat16, x, grad_out)
        dist[kind] = (_rel(a, a32), _rel(b, b32))
        assert _rel(y, y32) < 2**-8 and _rel(gx, x32) < 2**-8, kind  # the outputs: one bf16 rounding
    # both form the factor gradients in fp32 from the exact inputs: fp32 rounding apart
    assert max(dist["peft"]) < 1e-5, dist
    assert max(dist["fused"]) < 1e-5, dist
    assert min(dist["bf16 factors"]) > 1e-3, dist  # the prototype: bf16 products, ~2^-9


def test_dropout_feeds_only_the_lora_input():
    x, grad_out = _bf16_exact_inputs()
    mask = (torch.rand(N, D_IN, generator=torch.Generator().manual_seed(3)) > 0.5).float() * 2
    _, a32, b32, x32 = _grads("peft", torch.float32, x, grad_out, mask)
    _, a, b, gx = _grads("fused", torch.bfloat16, x, grad_out, mask)
    _, a0, _, _ = _grads("fused", torch.bfloat16, x, grad_out)  # without the mask
    assert _rel(a, a32) < 1e-5 and _rel(b, b32) < 1e-5 and _rel(gx, x32) < 2**-8
    assert _rel(a0, a32) > 0.1  # the mask made a difference the fused layer kept


def _model_grads(path, dtype, kind: str, ids):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dtype)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    if kind == "fused":
        assert fuse(model) == 7 * base.config.num_hidden_layers
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}


def test_whole_model_gradients_as_close_to_an_fp32_base_as_peft(tiny_path):
    ids = torch.randint(3, 800, (2, 48), generator=torch.Generator().manual_seed(2))
    ref = _model_grads(tiny_path, torch.float32, "peft", ids)  # the same bf16 weights, held in fp32
    total = {}
    for kind in ("peft", "fused"):
        grads = _model_grads(tiny_path, torch.bfloat16, kind, ids)
        err = sum(float((grads[n] - ref[n]).norm() ** 2) for n in ref) ** 0.5
        total[kind] = err / sum(float(ref[n].norm() ** 2) for n in ref) ** 0.5
    assert 0 < total["fused"] <= 1.1 * total["peft"], total


def test_transformers_model_fuses_a_bf16_base_only(rows):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    kinds, losses, keys = {}, {}, {}
    for base_dtype in ("bf16", "fp32"):
        torch.manual_seed(0)
        model = TransformersModel(model_id=TEST_MODEL, base_dtype=base_dtype)
        model.add_adapter_to_model("a", lora)
        kinds[base_dtype] = {type(m) for m in model.peft_model.modules() if isinstance(m, PeftLoraLinear)}
        keys[base_dtype] = sorted(model.peft_model.state_dict())
        losses[base_dtype] = model.forward_only(rows)["loss"]
        if base_dtype == "fp32":  # peft's own forward: the same loss as without the class
            for m in model.peft_model.modules():
                if type(m) is FusedLoraLinear:
                    m.__class__ = PeftLoraLinear
            assert model.forward_only(rows)["loss"] == losses["fp32"]
    assert kinds["bf16"] == {FusedLoraLinear}
    assert keys["bf16"] == keys["fp32"] and any("lora_A.a.weight" in k for k in keys["bf16"])
    assert abs(losses["bf16"] - losses["fp32"]) < 2e-2 * losses["fp32"]  # the mixed-precision tolerance
