"""A decode step's attention in float32 over a half-precision model (issue 47).

On the CPU, sdpa's bf16 kernel is slow for the one-query rows of a decode step: at the Qwen3-0.6B
shape, 8 rows past a 160-token prompt, one layer's attention took 5-9 ms in bf16 and 1-2 ms in fp32
with the same keys (1 thread; 28 layers a step). So the sampler decodes on a float32 copy of the KV
cache (kv_room.make_room's `dtype`: the bf16 keys and values held exactly), and this attention
function, installed on the sampler's model only, runs a query whose keys are float32 in float32 and
rounds its output back to the query's dtype. Every other call (a prefill, a model in fp32, a vision
tower) is the model's attention as before: twinkle.model.preemption's, which is sdpa with pause points.
Both kernels accumulate in fp32; the fp32 one also keeps the probabilities in fp32 (bf16's rounds them).
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle.model import preemption

NAME = "twinkle_decode"


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any):
    """transformers' attention-function signature ([B, H, T, D] in, [B, T, H, D] out) over preemption's."""
    if key.dtype == query.dtype:
        return preemption.attention(module, query, key, *args, **kwargs)
    out_B_T_H_D, weights = preemption.attention(module, query.to(key.dtype), key, *args, **kwargs)
    return out_B_T_H_D.to(query.dtype), weights


def enable(hf_model) -> bool:
    """Install `attention` on `hf_model` where it runs preemption's sdpa (-> whether it did): a decode on
    a float32 cache then attends in float32; everything else runs as it did."""
    if getattr(hf_model.config, "_attn_implementation", None) != preemption.NAME:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    hf_model.set_attn_implementation(NAME)
    return True
