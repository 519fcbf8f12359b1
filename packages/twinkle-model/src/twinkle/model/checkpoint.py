"""Checkpoint folders.

- LoRA: `adapter_model.safetensors` + `adapter_config.json`, exactly what
  `peft.PeftModel.from_pretrained(base, path)` loads (flat, whatever the adapter's name).
- Full model: `save_pretrained` output, loadable with `AutoModelForCausalLM.from_pretrained`.
- Training state (on request): `training_state/` with optimizer.pt, scheduler.pt, rng.pt (tensors
  and plain containers only, loaded with `weights_only=True`: nothing arbitrary is unpickled) and
  state.json (counters, data position, numpy/python RNG).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from twinkle.model.strategy import full_tensor, is_main_process

STATE_DIR = "training_state"


def save_adapter(peft_model, adapter_name: str, path: Path, base_model_path: str | None) -> None:
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    state = {k: full_tensor(v).detach().to("cpu").contiguous() for k, v in state.items()}
    if is_main_process():
        path.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = peft_model.peft_config[adapter_name]
        original = config.base_model_name_or_path
        config.base_model_name_or_path = base_model_path or original
        try:
            config.save_pretrained(str(path))
        finally:
            config.base_model_name_or_path = original


def load_adapter(peft_model, adapter_name: str, path: Path) -> None:
    from peft import set_peft_model_state_dict

    file = path / "adapter_model.safetensors"
    if not file.exists():
        raise FileNotFoundError(f"{path} is not a LoRA checkpoint (no adapter_model.safetensors)")
    result = set_peft_model_state_dict(peft_model, load_file(str(file)), adapter_name=adapter_name)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"checkpoint {path} does not fit adapter {adapter_name!r}: unexpected keys {unexpected[:5]}")


def save_full(hf_model, wrapped, path: Path, tokenizer=None) -> None:
    state = {k: full_tensor(v).detach().to("cpu") for k, v in wrapped_state_dict(wrapped, hf_model).items()}
    if is_main_process():
        hf_model.save_pretrained(str(path), state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))


def wrapped_state_dict(wrapped, hf_model) -> dict:
    module = getattr(wrapped, "module", wrapped)  # DDP keeps the model under .module
    return (module if module is hf_model else hf_model).state_dict()


def load_full(hf_model, path: Path) -> None:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    tied = set(getattr(hf_model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_training_state(path: Path, state, data_position: int | None) -> None:
    if not is_main_process():
        return
    folder = path / STATE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    if state.optimizer is not None:
        torch.save(state.optimizer.state_dict(), folder / "optimizer.pt")
    if state.scheduler is not None:
        torch.save(state.scheduler.state_dict(), folder / "scheduler.pt")
    torch.save(_rng_state(), folder / "rng.pt")
    np_state = np.random.get_state()
    meta = {
        "adapter_name": state.name,
        "micro_step": state.micro_step,
        "optimizer_steps": state.optimizer_steps,
        "data_position": state.consumed_batches if data_position is None else data_position,
        "gradient_accumulation_steps": state.gradient_accumulation_steps,
        "python_rng": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    (folder / "state.json").write_text(json.dumps(meta))


def load_training_state(path: Path, state) -> dict:
    folder = path / STATE_DIR
    if not (folder / "state.json").exists():
        raise FileNotFoundError(f"{path} has no training state; save it with save(..., save_training_state=True)")
    meta = json.loads((folder / "state.json").read_text())
    if (folder / "optimizer.pt").exists():
        if state.optimizer is None:
            raise ValueError("the checkpoint has optimizer state: call set_optimizer(...) before resuming")
        state.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    if (folder / "scheduler.pt").exists():
        if state.scheduler is None:
            raise ValueError("the checkpoint has scheduler state: call set_lr_scheduler(...) before resuming")
        state.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    rng = torch.load(folder / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    version, internal, gauss = meta["python_rng"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy_rng"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    state.micro_step, state.optimizer_steps = meta["micro_step"], meta["optimizer_steps"]
    state.consumed_batches = meta["data_position"]
    return meta
