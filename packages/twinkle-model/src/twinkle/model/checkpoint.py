"""The one checkpoint format: library engines, the sampler and the server all read and write it.

A LoRA checkpoint is a folder:
- `adapter_config.json` written by peft's own `LoraConfig.save_pretrained`, with
  `base_model_name_or_path` the hub id when the base came from a hub (`hf://org/name` ->
  `org/name`, `ms://org/name` -> `org/name`), else the local folder the base was loaded from;
- `adapter_model.safetensors`: the weights under peft's saved names
  (`base_model.model.<module path>.lora_A.weight`), whatever the adapter is called, so
  `peft.PeftModel.from_pretrained(base, folder)` loads it;
- with training state, `training_state/state.safetensors` (every tensor: optimizer moments, RNG
  states) plus `training_state/state.json` (everything else: param groups, scheduler counters,
  Python/NumPy RNG, the engine's counters). Nothing is pickled, so loading runs no code.

A full-model checkpoint (no adapter) is a `save_pretrained` folder (`save_full` / `load_full`).

Stable API:
    save_adapter(path, config, tensors, base_model=None)       -> None
    load_adapter(path)                                         -> (LoraConfig, {peft name: tensor})
    save_training_state(path, optimizer, scheduler, counters, write=True)  -> None
    load_training_state(path, optimizer, scheduler)            -> counters (RNG restored)
    save_adapter_state(path, state, data_position=None) / resume_adapter_state(path, state)
                                                               -> the two above for an engine's AdapterState
    base_model_id(model_id, local_path)                        -> what base_model_name_or_path holds
    is_adapter_folder(path)                                    -> bool
Writers write; callers decide which rank writes (only rank 0 under torchrun).
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from twinkle.model.strategy import full_tensor

if TYPE_CHECKING:
    import os

    from peft import LoraConfig, PeftConfig
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from twinkle.model.state import AdapterState

    StrPath = str | os.PathLike

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
STATE_DIR, STATE_TENSORS, STATE_JSON = "training_state", "state.safetensors", "state.json"
HUB_SCHEMES = ("hf://", "ms://")


def base_model_id(model_id: str | None, local_path: str | None) -> str | None:
    """The hub id for a hub model (so `AutoPeftModel` finds it anywhere), else the local folder."""
    if isinstance(model_id, str):
        for scheme in HUB_SCHEMES:
            if model_id.startswith(scheme):
                return model_id.removeprefix(scheme)
    return local_path or model_id


def is_adapter_folder(path: StrPath) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


def save_adapter(
    path: StrPath, config: PeftConfig, tensors: dict[str, torch.Tensor], base_model: str | None = None
) -> None:
    """Write a peft LoRA folder: `config` (a peft LoraConfig, not modified) and `tensors` keyed by
    peft's saved names."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
        str(folder / WEIGHTS_NAME),
        metadata={"format": "pt"},
    )
    config = copy.deepcopy(config)
    config.base_model_name_or_path = base_model or config.base_model_name_or_path
    config.task_type = config.task_type or "CAUSAL_LM"
    config.inference_mode = False
    config.save_pretrained(str(folder))


def load_adapter(path: StrPath) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """(LoraConfig, tensors by peft's saved names) from a folder written by `save_adapter` or peft."""
    from peft import LoraConfig

    folder = Path(path)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder} is not a LoRA checkpoint: {name} is missing")
    return LoraConfig.from_pretrained(str(folder)), load_file(str(folder / WEIGHTS_NAME))


# -- training state: nested containers as JSON, their tensors as safetensors -------------------------
def _flatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:  # nested containers -> JSON
    if isinstance(obj, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = full_tensor(obj.detach()).to("cpu").contiguous()  # a sharded moment: gathered (collective)
        return {"tensor": key}
    if isinstance(obj, dict):
        return {"items": [[_flatten(k, tensors), _flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"tuple": [_flatten(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in a training state (tensors and plain containers only)")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:  # JSON -> nested containers
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "tensor" in obj:
        return tensors[obj["tensor"]]
    if "tuple" in obj:
        return tuple(_unflatten(v, tensors) for v in obj["tuple"])
    return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in obj["items"]}


def _shard_like_params(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """Whole saved moments cut to this rank's shard where the optimizer's parameter is a DTensor
    (FSDP2); every rank holds the whole tensor, so no communication is needed."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]  # state_dict's numbering
    for index, moments in state["state"].items():
        param = params[index]
        if isinstance(param, DTensor):
            state["state"][index] = {
                k: distribute_tensor(v, param.device_mesh, param.placements, src_data_rank=None)
                if v.shape == param.shape
                else v
                for k, v in moments.items()
            }
    return state


def _rng_state() -> dict:
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=True)
    if not isinstance(numpy_state, tuple):  # legacy=True gives a dict only for a non-MT19937 generator
        raise TypeError("numpy's global RNG is not MT19937: its state cannot be checkpointed")
    kind, keys, pos, has_gauss, cached = numpy_state
    state = {
        "torch": torch.get_rng_state(),
        "python": (version, list(internal), gauss),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_training_state(
    path: StrPath,
    optimizer: torch.optim.Optimizer | None,
    scheduler: LRScheduler | None,
    counters: dict,
    write: bool = True,
) -> None:
    """Optimizer, scheduler (either may be None), this process's RNG and the engine's `counters`
    (plain JSON values) under `path/training_state/`. Sharded (DTensor) optimizer state is gathered
    whole, a collective: under FSDP2 every rank calls this, and only the one with `write` writes."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = {
        "optimizer": _flatten(optimizer.state_dict() if optimizer is not None else None, tensors),
        "scheduler": _flatten(scheduler.state_dict() if scheduler is not None else None, tensors),
        "rng": _flatten(_rng_state(), tensors),
        "counters": counters,
    }
    if not write:
        return
    folder = Path(path) / STATE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / STATE_TENSORS), metadata={"format": "pt"})
    (folder / STATE_JSON).write_text(json.dumps(skeleton))


def load_training_state(path: StrPath, optimizer: torch.optim.Optimizer | None, scheduler: LRScheduler | None) -> dict:
    """Restore what `save_training_state` wrote into `optimizer` / `scheduler` (built as in the saved
    run) and the RNG; returns the counters."""
    folder = Path(path) / STATE_DIR
    if not (folder / STATE_JSON).is_file():
        raise FileNotFoundError(f"{path} has no training state; save it with save(..., save_training_state=True)")
    skeleton = json.loads((folder / STATE_JSON).read_text())
    saved = _unflatten(
        {"items": [[k, v] for k, v in skeleton.items() if k != "counters"]}, load_file(str(folder / STATE_TENSORS))
    )
    if saved["optimizer"] is not None:
        if optimizer is None:
            raise ValueError("the checkpoint has optimizer state: call set_optimizer(...) before resuming")
        optimizer.load_state_dict(_shard_like_params(saved["optimizer"], optimizer))
    if saved["scheduler"] is not None:
        if scheduler is None:
            raise ValueError("the checkpoint has scheduler state: call set_lr_scheduler(...) before resuming")
        scheduler.load_state_dict(saved["scheduler"])
    _set_rng_state(saved["rng"])
    return skeleton["counters"]


# -- an engine's per-adapter state ---------------------------------------------------------------
def save_adapter_state(
    path: StrPath,
    state: AdapterState,
    data_position: int | None = None,
    write: bool = True,
    consumed_train_samples: int | None = None,
) -> None:
    """`save_training_state` for an engine's adapter state (optimizer, scheduler, micro_step,
    optimizer_steps, consumed_batches, gradient_accumulation_steps; and, when the caller counts them,
    the consumed training samples, as twinkle-kit's DataLoader.get_state() reports them)."""
    counters = {
        "micro_step": state.micro_step,
        "optimizer_steps": state.optimizer_steps,
        "data_position": state.consumed_batches if data_position is None else data_position,
        "gradient_accumulation_steps": state.gradient_accumulation_steps,
    }
    if consumed_train_samples is not None:
        counters["consumed_train_samples"] = int(consumed_train_samples)
    save_training_state(path, state.optimizer, state.scheduler, counters, write)


RESUMED = ("data_position", "optimizer_steps", "micro_step")


def resume_adapter_state(path: StrPath, state: AdapterState) -> dict:
    """Restore what `save_adapter_state` wrote; {'data_position', 'optimizer_steps', 'micro_step'} (plus
    'consumed_train_samples' when it was saved)."""
    counters = load_training_state(path, state.optimizer, state.scheduler)
    state.set_counters(counters["micro_step"], counters["optimizer_steps"], counters["data_position"])
    return {k: counters[k] for k in (*RESUMED, "consumed_train_samples") if k in counters}


def record_consumed_samples(path: StrPath, consumed_train_samples: int) -> None:
    """Add the consumed training samples to a training state already written (a server's save: the
    engine wrote the state, the client counted the samples)."""
    folder = Path(path) / STATE_DIR
    skeleton = json.loads((folder / STATE_JSON).read_text())
    skeleton["counters"]["consumed_train_samples"] = int(consumed_train_samples)
    (folder / STATE_JSON).write_text(json.dumps(skeleton))


def has_training_state(path: StrPath) -> bool:
    """Whether the folder holds what `save_training_state` writes (a checkpoint that can resume)."""
    return (Path(path) / STATE_DIR / STATE_JSON).is_file()


def read_counters(path: StrPath) -> dict:
    """The counters `save_adapter_state` wrote, restoring nothing (a weights-only resume reports them)."""
    folder = Path(path) / STATE_DIR
    if not (folder / STATE_JSON).is_file():
        raise FileNotFoundError(f"{path} has no training state; save it with save(..., save_training_state=True)")
    counters = json.loads((folder / STATE_JSON).read_text())["counters"]
    return {k: counters[k] for k in (*RESUMED, "consumed_train_samples") if k in counters}


# -- full-model checkpoints ----------------------------------------------------------------------
def save_full(
    hf_model: PreTrainedModel,
    state: dict[str, torch.Tensor],
    path: StrPath,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> None:
    hf_model.save_pretrained(str(path), state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))


def load_full(hf_model: torch.nn.Module, path: StrPath) -> None:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    tied = set(getattr(hf_model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
