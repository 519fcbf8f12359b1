"""What a custom loss may name (tinker/custom_loss.py): pure tensor math from torch, torch.nn.functional,
math and operator, Tensor methods and read-only attributes, and the dtypes, layouts and memory formats
an argument may spell. Nothing outside these tables is ever looked up, imported or evaluated.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch.fx.node import _get_qualified_name

_TORCH = (
    "abs neg exp exp2 expm1 log log1p log2 log10 sqrt rsqrt square pow sigmoid tanh relu sign floor ceil round "
    "trunc clamp clip clamp_min clamp_max minimum maximum fmin fmax where sum mean nansum nanmean prod amax amin "
    "max min argmax argmin logsumexp softmax log_softmax cumsum cumprod std var norm dot matmul outer stack cat "
    "gather masked_fill isfinite isnan isinf nan_to_num zeros_like ones_like full_like add sub subtract mul "
    "multiply div true_divide reciprocal lerp logaddexp xlogy sort topk flatten reshape squeeze unsqueeze "
    "transpose t detach numel logical_and logical_or logical_not eq ne lt le gt ge any all tensor scalar_tensor "
    "as_tensor sinh cosh sin cos"
).split()
_FUNCTIONAL = (
    "softplus logsigmoid log_softmax softmax relu leaky_relu gelu silu elu mse_loss l1_loss smooth_l1_loss "
    "huber_loss kl_div binary_cross_entropy_with_logits normalize cosine_similarity hardtanh"
).split()
_MATH = "sqrt log exp log1p expm1 pow fabs floor ceil tanh".split()
_OPERATOR = (
    "add sub mul truediv floordiv mod pow neg pos abs getitem lt le gt ge eq ne and_ or_ xor invert matmul".split()
)
METHODS = frozenset(
    (
        "size dim numel float double long int bool to type_as view view_as reshape reshape_as flatten squeeze "
        "unsqueeze t transpose permute contiguous clone detach sum mean prod max min amax amin argmax argmin exp log "
        "log1p expm1 abs neg sqrt rsqrt square pow sigmoid tanh relu sign clamp clip clamp_min clamp_max minimum "
        "maximum where masked_fill gather logsumexp softmax log_softmax cumsum std var norm isfinite isnan "
        "nan_to_num add sub mul div reciprocal floor ceil round lerp dot matmul eq ne lt le gt ge logical_and "
        "logical_or logical_not any all sort topk exp2 nansum nanmean"
    ).split()
)
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T", "mT", "real"})
DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "bool",
        "float",
        "double",
        "long",
        "int",
    )
}
LAYOUTS = {"strided": torch.strided}
MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format}


def _function_table() -> dict:
    fns = [getattr(torch, n) for n in _TORCH] + [getattr(F, n) for n in _FUNCTIONAL]
    fns += [getattr(math, n) for n in _MATH]
    table = {_get_qualified_name(f): f for f in fns}
    # the SDK names Python operators by their public module (fx records CPython's private `_operator`)
    table.update({f"operator.{n}": getattr(operator, n) for n in _OPERATOR})
    # a Tensor method used as a function: torch.Tensor.sum(x)
    table.update({f"torch.Tensor.{m}": getattr(torch.Tensor, m) for m in METHODS})
    return table


FUNCTIONS = _function_table()
assert all(hasattr(torch.Tensor, m) for m in METHODS)
