"""Training state in the two formats servers wrote before the one checkpoint format
(`twinkle.model.checkpoint`), read so a server upgraded in place still resumes its tenants' checkpoints.
Nothing writes them any more.

- native API: `training_state.pt`, a `torch.save` dict {optimizer, scheduler (state dicts or None),
  optimizer_steps, step_calls, fb_count}; read with `weights_only=True`, so no code runs;
- Tinker API: `optimizer.safetensors`, AdamW moments keyed `{module}.lora_A.exp_avg` / `.exp_avg_sq` /
  `.step` (and `lora_B`), `module` the base model's module path.

Both sat beside a PEFT adapter folder, which the current reader loads as it is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from twinkle.model import checkpoint

NATIVE_STATE, TINKER_OPTIMIZER = "training_state.pt", "optimizer.safetensors"


def has_training_state(folder) -> bool:
    folder = Path(folder)
    return (
        (folder / checkpoint.STATE_DIR / checkpoint.STATE_JSON).is_file()
        or (folder / NATIVE_STATE).is_file()
        or (folder / TINKER_OPTIMIZER).is_file()
    )


def is_legacy(folder) -> bool:
    folder = Path(folder)
    return not (folder / checkpoint.STATE_DIR).is_dir() and (
        (folder / NATIVE_STATE).is_file() or (folder / TINKER_OPTIMIZER).is_file()
    )


def resume_legacy(engine, name: str, folder) -> dict:
    """Restore an old checkpoint's training state into the MultiLoraModel adapter `name` (its weights
    already loaded); the counters `checkpoint.resume_adapter_state` answers."""
    folder, state = Path(folder), engine.adapters[name]
    optimizer = state.ensure_optimizer()
    if (folder / NATIVE_STATE).is_file():
        blob = torch.load(folder / NATIVE_STATE, weights_only=True)
        optimizer.load_state_dict(blob["optimizer"])
        if blob["scheduler"] is not None and state.scheduler is not None:
            state.scheduler.load_state_dict(blob["scheduler"])
        state.set_counters(blob["step_calls"], blob["optimizer_steps"], blob["fb_count"])
    else:
        from safetensors.torch import load_file

        saved = load_file(str(folder / TINKER_OPTIMIZER))
        for module in state.module_names:
            layer = engine.base.get_submodule(module)
            for which in ("lora_A", "lora_B"):
                key, param = f"{module}.{which}", getattr(layer, which)[name].weight
                if f"{key}.exp_avg" in saved:
                    optimizer.state[param] = {
                        "step": saved[f"{key}.step"].reshape(()).clone(),
                        "exp_avg": saved[f"{key}.exp_avg"].to(param.device),
                        "exp_avg_sq": saved[f"{key}.exp_avg_sq"].to(param.device),
                    }
    return {
        "data_position": state.consumed_batches,
        "optimizer_steps": state.optimizer_steps,
        "micro_step": state.micro_step,
    }
