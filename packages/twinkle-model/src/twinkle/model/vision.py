"""What a vision-language checkpoint changes for the engines: the class that loads it, and which of
its Linear layers are the language model's.

A Qwen-VL style checkpoint (its config has a ``vision_config``) is not mapped by
``AutoModelForCausalLM``; ``AutoModelForImageTextToText`` loads it with the same ``forward`` plus
image inputs. Its vision tower has Linear layers named like the language model's (``mlp.gate_proj``),
but they run on image patches, not on the batch's token rows, so the multi-LoRA engine, which routes
rows of ``[B, T, D]`` activations to tenants, keeps adapters on the language model only.

``train_vision`` names the vision parts an adapter also trains, full-parameter: ``"projector"`` (the
merger that maps patch features into the language model's width) and ``"tower"`` (the vision
encoder's other layers: patch embedding and blocks). Each flagged module gets a trainable per-adapter
copy (peft's ``modules_to_save``), so the base weights, and every other adapter, stay untouched; by
default nothing on the vision side trains.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

TrainVision = str | Iterable[str] | None  # "projector", "tower", or both

VISION_PREFIXES = ("visual.", "vision_tower.", "vision_model.")
VISION_PARTS = ("projector", "tower")
PROJECTOR_NAMES = ("merger", "multi_modal_projector")


def is_vision_language(config: PretrainedConfig) -> bool:
    return hasattr(config, "vision_config")


def auto_model_class(config: PretrainedConfig) -> type[_BaseAutoModelClass]:
    """The transformers Auto class that loads a checkpoint with this config."""
    import transformers

    if is_vision_language(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


# Returns a PreTrainedModel, unsaid while multi_lora/model.py calls its tenants' own methods on
# base.get_submodule(...) (typed nn.Module), which that return type would flag.
def load_pretrained(path: str, **kwargs: Any):  # noqa: ANN201
    """A causal LM or a vision-language model from a local folder, whichever its config is."""
    from transformers import AutoConfig

    trust = {k: kwargs[k] for k in ("trust_remote_code",) if k in kwargs}
    return auto_model_class(AutoConfig.from_pretrained(path, **trust)).from_pretrained(path, **kwargs)


def in_vision_tower(module_name: str) -> bool:
    return any(module_name.startswith(p) or f".{p}" in module_name for p in VISION_PREFIXES)


def language_modules(names: list[str]) -> list[str]:
    """The module names outside the vision tower; an error if that leaves none."""
    kept = [n for n in names if not in_vision_tower(n)]
    if names and not kept:
        raise ValueError(
            f"target_modules match only vision-tower layers ({names[0]}, ...): the multi-LoRA engine "
            "trains adapters on the language model"
        )
    return kept


def vision_parts(train_vision: TrainVision) -> tuple[str, ...]:
    """``train_vision`` as a tuple of known parts; a ValueError names anything else."""
    parts = (train_vision,) if isinstance(train_vision, str) else tuple(train_vision or ())
    unknown = [p for p in parts if p not in VISION_PARTS]
    if unknown:
        raise ValueError(f"train_vision: unknown part(s) {unknown}; choose from {list(VISION_PARTS)}")
    return parts


def vision_module_names(model: PreTrainedModel, train_vision: TrainVision) -> list[str]:
    """Full names of the modules that ``train_vision`` trains: the projector, and the tower's own
    layers (its patch embedding and each block; a ModuleList is iterated by its owner, so its
    elements are named, not the list)."""
    parts = vision_parts(train_vision)
    if not parts:
        return []
    if not is_vision_language(model.config):
        raise ValueError(f"train_vision={list(parts)}: the model ({type(model.config).__name__}) is text-only")
    import torch

    tower_name, tower = next((n, m) for n, m in model.named_modules() if n.split(".")[-1] + "." in VISION_PREFIXES)
    while hasattr(tower, "copies"):  # the fused engine's per-tenant wrapper (multi_lora.vision_tenants)
        tower = tower.get_submodule("base")
    names = []
    for child_name, child in tower.named_children():
        is_projector = child_name in PROJECTOR_NAMES
        if not any(True for _ in child.parameters()) or ("projector" if is_projector else "tower") not in parts:
            continue
        kids = list(child.named_children()) if isinstance(child, torch.nn.ModuleList) else [("", child)]
        names += [".".join(x for x in (tower_name, child_name, k) if x) for k, _ in kids]
    for n, _ in model.named_modules():  # a projector beside the tower (Llava's multi_modal_projector)
        if "projector" in parts and n.split(".")[-1] in PROJECTOR_NAMES and not n.startswith(tower_name + "."):
            names.append(n)
    return names


def with_vision_modules(model: PreTrainedModel, config: LoraConfig, train_vision: TrainVision) -> LoraConfig:
    """A copy of the peft ``config`` whose ``modules_to_save`` adds the flagged vision modules."""
    import copy

    names = vision_module_names(model, train_vision)
    if not names:
        return config
    config = copy.copy(config)
    config.modules_to_save = [*(config.modules_to_save or []), *names]
    return config


def packed_rope_positions(model: PreTrainedModel, batch: dict) -> torch.Tensor | None:
    """``[4, 1, T]`` position ids for a packed (padding-free) batch with images, else None.

    A Qwen-VL model takes packed rows as ``[4, B, T]`` positions: row 0 the text positions that
    restart at each sequence (from which it builds the block-diagonal mask), rows 1-3 the 3-D rope
    positions (time, height, width). The model's own ``get_rope_index`` builds those, one packed
    sequence at a time with that sequence's image grids, so each restarts exactly as if alone.
    """
    import itertools

    import torch

    from twinkle.model.inputs import sequence_spans

    if "attention_mask" in batch or batch.get("position_ids") is None or batch["position_ids"].dim() != 2:
        return None
    # a PeftModel's base; nn.Module.__getattr__ types what hasattr found as Tensor | Module
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # ty: ignore[not-callable]
    rope_index = inner.model.get_rope_index  # a Qwen-VL model's
    merge = model.config.vision_config.spatial_merge_size
    ids, mm = batch["input_ids"], (batch["input_ids"] == model.config.image_token_id).int()
    grids, used = batch["image_grid_thw"], 0
    out = torch.zeros(3, *ids.shape, dtype=torch.long, device=ids.device)
    for b, start, n in sequence_spans(batch):
        seq_mm = mm[b, start : start + n]
        images = sum(1 for key, _ in itertools.groupby(seq_mm.tolist()) if key == 1)  # one run per image
        mine = grids[used : used + images]
        tokens = int(mine.prod(-1).sum()) // merge**2 if images else 0
        if tokens != int(seq_mm.sum()):
            raise ValueError(f"packed sequence at {start}: {int(seq_mm.sum())} image tokens, its grids make {tokens}")
        used += images
        seq_ids = ids[b : b + 1, start : start + n]
        if images:
            pos, _ = rope_index(seq_ids, mm_token_type_ids=seq_mm[None], image_grid_thw=mine)
        else:
            pos = torch.arange(n, device=ids.device).view(1, 1, -1).expand(3, 1, -1)
        out[:, b, start : start + n] = pos[:, 0]
    return torch.cat([batch["position_ids"][None], out])


def split_vision_modules(config: LoraConfig) -> tuple[LoraConfig, tuple[str, ...]]:
    """(the peft ``config`` without its vision ``modules_to_save``, the ``train_vision`` parts they meant)."""
    import copy

    saved = list(getattr(config, "modules_to_save", None) or [])
    ours = [n for n in saved if in_vision_tower(n) or n.split(".")[-1] in PROJECTOR_NAMES]
    if not ours:
        return config, ()
    parts = tuple(
        p for p in VISION_PARTS if any((n.split(".")[-1] in PROJECTOR_NAMES) == (p == "projector") for n in ours)
    )
    config = copy.copy(config)
    config.modules_to_save = [n for n in saved if n not in ours] or None
    return config, parts
