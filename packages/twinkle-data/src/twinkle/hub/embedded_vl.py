"""The embedded vision-language preset: `twinkle://qwen2.5-vl-tiny`, a tiny Qwen2.5-VL built offline.

transformers' own `Qwen2_5_VLForConditionalGeneration` from a fixed config and seed, the embedded
byte-level BPE extended with Qwen's vision special tokens, a chat template that places
`<|vision_start|><|image_pad|><|vision_end|>` where a message's content holds an image, and a PIL
image processor whose pixel budget keeps any picture at a few patches (56x56 gives 4 image tokens)
so a training step takes a fraction of a second on a CPU. Built only when something asks for it,
pinned by a digest of its weights exactly like the text presets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinkle.hub.portable_init import portable_init
from twinkle.hub.tokenizer_assets import ASSETS, SCHEME, build_tokenizer, token_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# Qwen's own names for the vision tokens: the HF processor and the model config look them up by name.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TEMPLATE = ASSETS / "chat_template_vl.jinja"
PATCH, MERGE = 14, 2
# One merged token covers 28x28 pixels; images are resized to at most 112x112 (16 tokens), at least
# 56x56 (4 tokens): enough to tell a colour and a shape, small enough for CPU tests.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112

VL_PRESETS: dict[str, dict] = {
    "qwen2.5-vl-tiny": {
        "text": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            # head_dim 16 -> 8 rotary frequencies split over (time, height, width)
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        },
        "vision": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        "seed": 0,
    },
}
PINNED_VL_WEIGHTS = {
    "qwen2.5-vl-tiny": "308ed10c044c4cf004829f4b7000e24278375ca24e9e5b2b893e2c2a84499a0e",
}
VL_TEST_MODEL = SCHEME + "qwen2.5-vl-tiny"
VL_FILES = ("preprocessor_config.json", "processor_config.json")
ASSET_FILES = ("tokenizer.json", "chat_template.jinja", "chat_template_vl.jinja")


def build_vl_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()
    return tokenizer


def build_image_processor() -> Qwen2VLImageProcessorPil:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2
    )


def build_vl_model(name: str, tokenizer: PreTrainedTokenizerFast) -> Qwen2_5_VLForConditionalGeneration:
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    p = VL_PRESETS[name]
    eos, pad = token_ids(tokenizer, ["<|im_end|>", "<|endoftext|>"])
    start, end, image, video = token_ids(tokenizer, list(VISION_TOKENS))
    # on the outer config too: transformers keeps keywords its signature lacks as attributes
    special: dict[str, Any] = {"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad}
    config = Qwen2_5_VLConfig(
        text_config={**p["text"], "vocab_size": len(tokenizer), **special},
        vision_config=p["vision"],
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
        tie_word_embeddings=True,
        **special,
    )
    with torch.random.fork_rng(devices=[]):  # never disturb the caller's RNG stream
        torch.manual_seed(p["seed"])
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    portable_init(model, p["seed"], config.get_text_config().initializer_range)
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=pad, do_sample=False
    )
    return model


def write_vl_folder(name: str, folder: Path) -> None:
    """Every file by hand, as `embedded.write_folder` does (and for the same reason)."""
    from safetensors.torch import save_file

    tokenizer = build_vl_tokenizer()
    model = build_vl_model(name, tokenizer)
    model.config.architectures = [type(model).__name__]
    model.config.to_json_file(folder / "config.json")
    model.generation_config.to_json_file(folder / "generation_config.json")
    tied = {"lm_head.weight"}
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in tied}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    build_image_processor().save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}, indent=2))
    (folder / "twinkle_embedded.json").write_text(
        json.dumps({"model_id": SCHEME + name, "preset": VL_PRESETS[name]}, indent=2)
    )
