"""Merged export: a base model with a LoRA checkpoint folded into its weights, written as a plain
transformers folder (safetensors, config, generation config, tokenizer) that anything loading
`AutoModelForCausalLM` (vLLM included) serves without peft.

The checkpoint is any folder in the one checkpoint format (twinkle.model.checkpoint): a local PEFT
folder, or a server checkpoint folder (which also names its base model in `twinkle_checkpoint.json`).
The merge runs in float32 and is cast once at the end, so rounding happens once, not per layer.
A LoRA on a tied `lm_head` changes the output projection only (that is what training saw), so the
merged model gets its own untied `lm_head`; the input embeddings stay the base's.

Stable API:
    export_merged(checkpoint, out, base=None, dtype=None) -> Path of the written folder
    checkpoint_base(checkpoint)                           -> the base model the checkpoint names
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from twinkle.model.checkpoint import CONFIG_NAME, is_adapter_folder, load_adapter

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

SERVER_META = "twinkle_checkpoint.json"  # written beside the adapter by the server's checkpoint store
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_base(checkpoint: str | os.PathLike) -> str:
    """The base model a checkpoint was trained on: the server's record, else peft's `base_model_name_or_path`."""
    folder = Path(checkpoint)
    meta = folder / SERVER_META
    if meta.is_file() and json.loads(meta.read_text()).get("base_model"):
        return json.loads(meta.read_text())["base_model"]
    base = json.loads((folder / CONFIG_NAME).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{folder} does not say which base model it adapts ({CONFIG_NAME} has no "
            "base_model_name_or_path); pass the base model explicitly (--base)"
        )
    return base


def export_merged(
    checkpoint: str | os.PathLike, out: str | os.PathLike, base: str | None = None, dtype: str | None = None
) -> Path:
    """Write base + LoRA merged to `out` (a new or empty folder). `dtype`: float32, bfloat16 or float16
    (default: the base model's own)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twinkle.hub import resolve_model_path

    folder, out = Path(checkpoint), Path(out)
    if not is_adapter_folder(folder):
        raise ValueError(f"{folder} is not a LoRA checkpoint folder ({CONFIG_NAME} is missing)")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; choose a new folder")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    base_path = resolve_model_path(base or checkpoint_base(folder))
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    target_dtype = DTYPES[dtype] if dtype else _saved_dtype(model.config)
    config, tensors = load_adapter(folder)
    if any(".lm_head." in k for k in tensors):
        _untie_output_embeddings(model)
    merged = PeftModel.from_pretrained(model, str(folder), config=config).merge_and_unload()
    merged.to(target_dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:  # written beside `out` and renamed into place: never half a model under its name
        merged.save_pretrained(str(staging), safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(base_path)
        if tokenizer is None:
            raise ValueError(f"the base model at {base_path} has no tokenizer to export with the merged weights")
        tokenizer.save_pretrained(str(staging))
        if out.exists():
            out.rmdir()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _saved_dtype(config: PretrainedConfig) -> torch.dtype:
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, saved) if isinstance(saved, str) else saved


def _untie_output_embeddings(model: PreTrainedModel) -> None:
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
    for config in (model.config, getattr(model.config, "text_config", None)):
        if config is not None and getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
