"""The files of a built text model's checkpoint, written by hand the same way for every embedded preset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.hub.tokenizer_assets import SCHEME

if TYPE_CHECKING:
    from tqdm import tqdm
    from transformers import PreTrainedModel, PreTrainedTokenizerFast


def write_checkpoint(
    folder: Path,
    name: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    preset: dict,
    bar: tqdm | None = None,
) -> None:
    """A built text model's checkpoint files (config, weights without the tied head, tokenizer, preset)."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]
    model.config.to_json_file(folder / "config.json")
    model.generation_config.to_json_file(folder / "generation_config.json")
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in tied}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    if bar is not None:
        bar.update()
    tokenizer.save_pretrained(folder)
    if bar is not None:
        bar.update()
    (folder / "twinkle_embedded.json").write_text(json.dumps({"model_id": SCHEME + name, "preset": preset}, indent=2))
