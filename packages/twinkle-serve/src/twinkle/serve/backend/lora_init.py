"""Adapter initialisation that matches local training: a LoRA created over HTTP with seed S starts
from exactly the weights peft's `get_peft_model` draws right after `torch.manual_seed(S)`.

peft builds each adapted layer's `lora_A` and `lora_B` as `nn.Linear` (each draws a Kaiming-uniform
init from the global generator), then re-draws `lora_A` and zeroes `lora_B`, layer by layer in module
order. Replaying those draws on a private generator gives the same `lora_A` without touching the
server's global RNG, so `examples/sft_any_mode.py` in http mode follows the local loss curve.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def peft_like_init(engine, adapter: str, seed: int) -> None:
    state = engine.adapters[adapter]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module_name in state.module_names:
            layer = engine.base.get_submodule(module_name)
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            for shape in (a.shape, b.shape, a.shape):  # A's Linear init, B's Linear init, A's LoRA re-init
                draw = torch.empty(shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(draw, a=math.sqrt(5), generator=generator)
            a.copy_(draw.to(a.dtype))
            b.zero_()
