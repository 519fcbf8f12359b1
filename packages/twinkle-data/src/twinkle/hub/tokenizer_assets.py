"""The byte-level BPE tokenizer and chat template shipped in `assets/`, shared by every embedded
preset (text and vision-language); the presets themselves live in `embedded` and `embedded_vl`."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
SCHEME = "twinkle://"


def build_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(ASSETS / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=(ASSETS / "chat_template.jinja").read_text(),
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
