"""peft's LoRA linear on a half-precision frozen base, in one accumulation and without fp32 [tokens, out].

peft computes `base(x) + B(A(dropout(x.float()))) * scale` with fp32 factors: on a bf16 base that is an
fp32 upcast of x, an fp32 rank-r product whose [tokens, out] output is fp32, a scale and an add over
that fp32 tensor, and a cast back to bf16; backward walks the same chain in fp32. At the Qwen3-0.6B
shape (LoRA r16 on every projection, 4 x 512 tokens) that chain was about a third of a step's CPU time,
bound by the bytes of the fp32 [tokens, out] tensors, not by the rank-16 arithmetic.

`FusedLoraLinear.forward` computes the same sum with only [tokens, r] tensors in fp32:
- h = dropout(x) A^T in fp32 (the [tokens, r] product, kept for backward);
- y = x W^T (+ bias) in the base's dtype, then `addmm_` adds scale * h B^T into y inside the GEMM's
  fp32 accumulation, with h and B each split into a bf16 high and low part (h_hi B_hi + h_hi B_lo +
  h_lo B_hi: the LoRA term to ~2^-16, against bf16's 2^-8), so y is rounded once, as peft's sum is.
Backward forms the factors' gradients in fp32 exactly as peft does (dB = scale g^T h, dA = (scale g B)^T
dropout(x), from g upcast once and freed at once), and grad x as the base's g W with the LoRA term added
in the same one-accumulation way. Saved for backward: x (bf16; also dropout(x) when dropout draws) and
h (fp32 [tokens, r]), where peft keeps x and its fp32 upcast. On bf16-exact inputs the factor gradients
match an fp32 layer's to fp32 rounding, as peft's do, where the bf16 products of an earlier prototype
were ~3e-3 off (tests/test_model_lora_fused.py). Doing the backward's rank-r products in bf16 too (hi/lo
halves, a residual GEMM for what the output's rounding lost) kept that precision but read g and x
twice each: measured slower than the one upcast on AVX-512 BF16.

Used by TransformersModel where the base is half precision and the model trains in one process (data,
tensor and context parallel runs keep peft's forward); each call falls back to peft's forward where
the fused one does not apply: adapters disabled or merged, several active adapters or `adapter_names`,
a LoRA variant (DoRA...), a bias on the LoRA factors, factors not fp32, input not in the base's dtype,
a trained base weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

HALF = (torch.bfloat16, torch.float16)


def _split(t_fp32: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` as high + low halves in `dtype` (hi + lo equals t to ~2^-16 relative for bf16)."""
    hi = t_fp32.to(dtype)
    return hi, (t_fp32 - hi.float()).to(dtype)


def _add_product(out: torch.Tensor, left_fp32: torch.Tensor, right_fp32: torch.Tensor) -> torch.Tensor:
    """out += left @ right with fp32 operands as hi/lo halves in out's dtype: one GEMM over [3r]."""
    l_hi, l_lo = _split(left_fp32, out.dtype)
    r_hi, r_lo = _split(right_fp32, out.dtype)
    return out.addmm_(torch.cat([l_hi, l_hi, l_lo], 1), torch.cat([r_hi, r_lo, r_hi], 0))


class _FusedLora(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_lora, weight, bias, lora_A, lora_B, scale: float):
        lead, d_in = x.shape[:-1], x.shape[-1]
        x_N_I = x.reshape(-1, d_in)
        xl_N_I = x_N_I if x_lora is x else x_lora.reshape(-1, d_in)
        h_N_R = xl_N_I.float() @ lora_A.t()
        y_N_O = F.linear(x_N_I, weight, bias)
        _add_product(y_N_O, h_N_R * scale, lora_B.t())
        ctx.scale, ctx.shared = scale, x_lora is x
        ctx.save_for_backward(x_N_I, None if ctx.shared else xl_N_I, weight, lora_A, lora_B, h_N_R)
        return y_N_O.view(*lead, -1)

    @staticmethod
    def backward(ctx, *grad_outputs):
        (g,) = grad_outputs
        x_N_I, xl_N_I, weight, lora_A, lora_B, h_N_R = ctx.saved_tensors
        if xl_N_I is None:
            xl_N_I = x_N_I
        lead = g.shape[:-1]
        g_N_O = g.reshape(-1, g.shape[-1]).to(weight.dtype)
        # the factors' gradients in fp32, as peft forms them: g upcast once (freed before grad x's GEMM)
        gf_N_O = g_N_O.float()
        dh_N_R = (gf_N_O @ lora_B).mul_(ctx.scale)  # d(loss) / d(dropout(x) A^T)
        d_B = (gf_N_O.t() @ h_N_R).mul_(ctx.scale)
        del gf_N_O
        d_A = dh_N_R.t() @ xl_N_I.float()
        grad_x = g_N_O @ weight
        grad_xl = None
        if ctx.shared:
            _add_product(grad_x, dh_N_R, lora_A)
        else:
            grad_xl = _add_product(torch.zeros_like(xl_N_I), dh_N_R, lora_A).view(*lead, -1)
        grad_bias = g_N_O.sum(0) if ctx.needs_input_grad[3] else None
        return grad_x.view(*lead, -1), grad_xl, None, grad_bias, d_A, d_B, None


class FusedLoraLinear(PeftLoraLinear):
    """peft's `lora.Linear` (same parameters, names, merging) with the fused forward above."""

    def _fused_adapter(self, x: torch.Tensor, args, kwargs) -> str | None:
        if args or kwargs or self.disable_adapters or self.merged or len(self.active_adapters) != 1:
            return None
        name = self.active_adapters[0]
        base = self.base_layer
        if name not in self.lora_A or name in self.lora_variant or type(base) is not nn.Linear:
            return None
        lora_A, lora_B = self.lora_A[name], self.lora_B[name]
        if lora_A.bias is not None or lora_B.bias is not None or self.fan_in_fan_out:
            return None
        w = base.weight
        if w.dtype not in HALF or x.dtype != w.dtype or w.requires_grad:
            return None
        if lora_A.weight.dtype != torch.float32 or lora_B.weight.dtype != torch.float32:
            return None
        return name

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = self._fused_adapter(x, args, kwargs)
        if name is None:
            return super().forward(x, *args, **kwargs)
        dropout = self.lora_dropout[name]
        x_lora = dropout(x) if dropout.training and not isinstance(dropout, nn.Identity) else x
        base = self.base_layer
        with torch.autocast(x.device.type, enabled=False):  # the dtypes above are the point
            return _FusedLora.apply(
                x,
                x_lora,
                base.weight,
                base.bias,
                self.lora_A[name].weight,
                self.lora_B[name].weight,
                self.scaling[name],
            )


def fuse(model: nn.Module) -> int:
    """Give every peft `lora.Linear` in `model` the fused forward (in place: parameters, names and
    state dict unchanged); returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is PeftLoraLinear:
            module.__class__ = FusedLoraLinear
            n += 1
    return n


def fits(model) -> bool:
    """Whether TransformersModel `model` uses the fused forward: trained in one process. Data, tensor
    and context parallel runs keep peft's (FSDP2 / DTensor weights and their hooks are verified with it)."""
    from twinkle.model.strategy import data_parallel_size, tensor_parallel_size

    mesh = getattr(model, "device_mesh", None)
    return data_parallel_size(mesh) == 1 and tensor_parallel_size(mesh) == 1 and getattr(model, "cp_size", 1) == 1
