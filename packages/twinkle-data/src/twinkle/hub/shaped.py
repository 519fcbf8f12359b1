"""Models at published Qwen3 shapes with random weights: `twinkle://qwen3-0.6b-shape` (and, for a lent
GPU, `-1.7b-shape`, `-8b-shape`), built offline.

Random weights measure speed and memory, not quality: a step over them costs what a step over the
real checkpoint costs (the same classes, shapes, vocabulary and dtype), but what they generate is noise
and their losses sit near log(151,936) ≈ 11.9. Use them for benchmarks and memory checks, never to
judge training results.

Each is transformers' `Qwen3ForCausalLM` from a `Qwen3Config` at the published shape (hidden size,
intermediate size, layers, query / key-value heads, head_dim 128, the 151,936-row padded vocabulary,
RoPE theta 1e6, tied embeddings up to 4B), seeded random weights (one seeded generator per tensor;
norms at 1) saved as bf16 safetensors as the real checkpoints are, and the real Qwen tokenizer built
offline from `qwen.tiktoken` (`twinkle.hub.qwen_vocab`, the qwen-agent wheel) with the embedded models'
ChatML template. Built on first use into the cache like the embedded models (once per machine: the
0.6B shape takes ~1 min and 1.2 GB on disk); too large for the default tests.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.hub.tokenizer_assets import ASSETS, SCHEME, token_ids

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config

VOCAB_SIZE = 151936  # Qwen3's embedding rows: the 151,665 tokens padded to a multiple of 128
SHAPE_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "twinkle_shape.json")


@dataclass(frozen=True)
class ShapePreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    head_dim: int = 128
    max_position_embeddings: int = 40960
    seed: int = 0


SHAPE_PRESETS: dict[str, ShapePreset] = {  # Qwen3's published config.json values
    "qwen3-0.6b-shape": ShapePreset(1024, 3072, 28, 16, 8, tie_word_embeddings=True),
    "qwen3-1.7b-shape": ShapePreset(2048, 6144, 28, 16, 8, tie_word_embeddings=True),
    "qwen3-8b-shape": ShapePreset(4096, 12288, 36, 32, 8, tie_word_embeddings=False),
}
SHAPE_MODEL = SCHEME + "qwen3-0.6b-shape"


def shape_config(name: str, tokenizer: PreTrainedTokenizerFast) -> Qwen3Config:
    from transformers import Qwen3Config

    p = SHAPE_PRESETS[name]
    eos, pad = token_ids(tokenizer, ["<|im_end|>", "<|endoftext|>"])
    fields = {k: v for k, v in asdict(p).items() if k != "seed"}
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        **fields,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="bfloat16",
    )


def random_bf16_weights(config: Qwen3Config, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state dict, drawn without building the model in fp32: the modules
    are made on the meta device for their names and shapes; norms 1, the rest N(0, initializer_range)."""
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen3ForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=torch.bfloat16)
            continue
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        out[name] = torch.empty(shape).normal_(0.0, config.initializer_range, generator=g).to(torch.bfloat16)
    return out


def write_shape_folder(name: str, folder: Path, tokenizer_cache: Path) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from twinkle.hub.qwen_vocab import base_tokenizer_json, qwen_tokenizer

    tokenizer = qwen_tokenizer(base_tokenizer_json(tokenizer_cache), (ASSETS / "chat_template.jinja").read_text())
    config = shape_config(name, tokenizer)
    config.architectures = ["Qwen3ForCausalLM"]
    config.to_json_file(folder / "config.json")
    GenerationConfig(
        eos_token_id=[config.eos_token_id, config.pad_token_id], pad_token_id=config.pad_token_id, do_sample=False
    ).to_json_file(folder / "generation_config.json")
    save_file(random_bf16_weights(config, SHAPE_PRESETS[name].seed), folder / "model.safetensors", {"format": "pt"})
    tokenizer.save_pretrained(folder)
    note = "random weights: they measure speed and memory, not quality"
    preset = asdict(SHAPE_PRESETS[name])
    (folder / "twinkle_shape.json").write_text(json.dumps({"model_id": SCHEME + name, "preset": preset, "note": note}))


def check_shape_folder(name: str, folder: Path) -> None:
    missing = [f for f in SHAPE_FILES if not (folder / f).is_file()]
    if missing:
        raise RuntimeError(f"building {SCHEME}{name} left out {', '.join(missing)} in {folder}")
    config = json.loads((folder / "config.json").read_text())
    p = SHAPE_PRESETS[name]
    if (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) != (
        p.hidden_size,
        p.num_hidden_layers,
        VOCAB_SIZE,
    ):
        raise RuntimeError(f"building {SCHEME}{name} wrote a config of another shape: {config}")
