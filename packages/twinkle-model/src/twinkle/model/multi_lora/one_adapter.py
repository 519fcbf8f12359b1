"""A multi-LoRA layer's update when one adapter covers the whole batch and nothing needs a gradient.

A served decode step of a GRPO group is that case in every adapted Linear: 8 rows, one token each, one
adapter (issue 47: at the Qwen3-0.6B shape, 197 adapted Linears a step). The general path (layer.py's
`_add_low_rank`: a plan of groups, buffers sized for several tenants, row spans) costs 54 torch ops per
call there, against ~12 for the base GEMM alone; this one does the same arithmetic in 13: the same
conversion of x to the factors' dtype, the same two products on the same shapes, the same scaling and
the same single add into the base output, so the result is bit for bit the general path's.
"""

from __future__ import annotations

import torch


def add_update(x: torch.Tensor, out: torch.Tensor, a_R_I: torch.Tensor, b_O_R: torch.Tensor, scaling: float) -> None:
    """out += scaling * (x @ A.T) @ B.T, in place, in the factors' dtype, as `_add_low_rank` computes it."""
    x_N_I = x.reshape(-1, x.shape[-1])
    if x_N_I.dtype != a_R_I.dtype:
        x_N_I = x_N_I.to(a_R_I.dtype)
    low_N_R = torch.mm(x_N_I, a_R_I.t()).mul_(scaling)
    if out.dtype == b_O_R.dtype:  # a base in the factors' dtype: accumulated into out by the GEMM itself
        out.view(-1, out.shape[-1]).addmm_(low_N_R, b_O_R.t())
    else:  # fp32 factors on a bf16 base: the product in fp32, rounded to the base's dtype once, by the add
        out.add_(torch.mm(low_N_R, b_O_R.t()).view(out.shape))
