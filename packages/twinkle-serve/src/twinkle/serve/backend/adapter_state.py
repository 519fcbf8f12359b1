"""An adapter's LoRA tensors and AdamW moments in and out of a checkpoint, for every backend.

Keys are `{module}.lora_A` / `{module}.lora_B` for weights and `{key}.exp_avg`, `.exp_avg_sq`,
`.step` for the optimizer, so a checkpoint written by one backend loads into another.
"""

from __future__ import annotations

import torch

from twinkle.serve.backend.base import UserError


def adam_state_tensors(optimizer: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> dict:
    out = {}
    for key, p in params.items():
        state = optimizer.state.get(p)
        if state:
            out[f"{key}.exp_avg"] = state["exp_avg"].detach().clone()
            out[f"{key}.exp_avg_sq"] = state["exp_avg_sq"].detach().clone()
            out[f"{key}.step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1).clone()
    return out


def load_adapter_state(params: dict[str, torch.nn.Parameter], weights, optimizer_tensors: dict | None,
                       optimizer: torch.optim.Optimizer) -> None:
    """Copy `weights` (AdapterWeights) into `params`; with `optimizer_tensors`, restore AdamW moments."""
    with torch.no_grad():
        for module, a in weights.lora_A.items():
            for suffix, t in (("lora_A", a), ("lora_B", weights.lora_B[module])):
                key = f"{module}.{suffix}"
                if key not in params or params[key].shape != t.shape:
                    raise UserError(f"checkpoint tensor {key} {tuple(t.shape)} does not fit this model")
                params[key].copy_(t)
    if optimizer_tensors:
        for key, p in params.items():
            if f"{key}.exp_avg" in optimizer_tensors:
                optimizer.state[p] = {"step": optimizer_tensors[f"{key}.step"].reshape(()).clone(),
                                      "exp_avg": optimizer_tensors[f"{key}.exp_avg"].clone(),
                                      "exp_avg_sq": optimizer_tensors[f"{key}.exp_avg_sq"].clone()}
