"""The byte-level BPE tokenizer and chat template shipped in `assets/`, shared by every embedded
preset (text and vision-language); the presets themselves live in `embedded` and `embedded_vl`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ASSETS = Path(__file__).parent / "assets"
SCHEME = "twinkle://"


def build_tokenizer() -> PreTrainedTokenizerFast:
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


def token_ids(tokenizer: PreTrainedTokenizerFast, tokens: list[str]) -> list[int]:
    """The ids of `tokens`, in order (the tokenizer answers a list with a list)."""
    ids = tokenizer.convert_tokens_to_ids(tokens)
    assert isinstance(ids, list)
    return ids
