"""Model FLOPs and the hardware peak that MFU is measured against.

The peak is measured, not looked up: the best of a few large square matmuls in the training dtype,
once per (device, dtype) per process. FLOPs are the ones a step *needs*: 2·N per token forward
for the N matmul parameters, the same again backward for activation gradients, plus 2·N_trainable
for weight gradients (so a LoRA step, whose base weights are frozen, is ~4N not 6N), plus attention
scores and values (2·2·T·d per layer per token forward, causal masking not discounted).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_PEAKS: dict[tuple[str, torch.dtype], float] = {}


def measure_matmul_peak(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 8
) -> float:
    """Best observed matmul FLOP/s on `device` in `dtype` (cached per process)."""
    device = torch.device(device)
    key = (str(device), dtype)
    if key not in _PEAKS:
        # a private generator: measuring must not move the caller's RNG (LoRA init, dropout)
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(size, size, device=device, generator=gen).to(dtype)
        b = torch.randn(size, size, device=device, generator=gen).to(dtype)
        best = float("inf")
        for i in range(repeats + 2):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:  # the first runs warm caches and pick kernels
                best = min(best, time.perf_counter() - t0)
        _PEAKS[key] = 2 * size**3 / best
    return _PEAKS[key]


def _embeddings(model: torch.nn.Module) -> tuple[torch.nn.Embedding | None, torch.nn.Linear | None]:
    """(input, output) embeddings of a transformers model; None for a model without them."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    return (get_in() if get_in is not None else None), (get_out() if get_out is not None else None)


def matmul_params(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters that take part in matmuls, trainable ones); embedding lookups are not matmuls,
    but a tied output projection is, so it is counted once through the output embedding."""
    embed, out = _embeddings(model)
    skip = {id(embed.weight)} if embed is not None else set()
    total = trainable = 0
    seen = set()
    for p in model.parameters():
        if id(p) in seen or (id(p) in skip and (out is None or out.weight is not p)):
            continue
        seen.add(id(p))
        if p.dim() < 2:  # norms and biases: elementwise
            continue
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    if out is not None and id(out.weight) not in seen:
        total += out.weight.numel()
    return total, trainable


def attention_dims(config: PretrainedConfig) -> tuple[int, int]:
    """(layers, query width = heads·head_dim) from a transformers config."""
    layers = getattr(config, "num_hidden_layers", 0)
    heads = getattr(config, "num_attention_heads", 0)
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // max(heads, 1))
    return layers, heads * head_dim


def step_flops(
    tokens: int, seq_len: int, n_matmul: int, n_trainable: int, layers: int, q_width: int, backward: bool = True
) -> float:
    """FLOPs of a forward (and backward) pass over `tokens` tokens in rows of `seq_len`."""
    attn_fwd = 4 * layers * seq_len * q_width  # QK^T and AV, per token
    forward = 2 * n_matmul + attn_fwd
    if not backward:
        return tokens * forward
    # backward: activation grads everywhere (≈ forward), weight grads only where trainable
    return tokens * (forward + (2 * n_matmul + attn_fwd) + 2 * n_trainable)
