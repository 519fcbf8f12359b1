"""The real 151,643-token Qwen byte-level BPE vocabulary, built offline from `qwen.tiktoken` (shipped in
the qwen-agent wheel: `pip install --no-deps qwen-agent`), as a Hugging Face `tokenizer.json` plus
Qwen's 22 added tokens (`<|endoftext|>` 151643, `<|im_start|>` 151644, `<|im_end|>` 151645, ...).
Used by the shape presets (`twinkle.hub.shaped`) and the tokenizer tests.
"""

from __future__ import annotations

import base64
import hashlib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# GPT-2/Qwen pre-tokenisation: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_ADDED = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
NOT_SPECIAL = {"<tool_call>", "</tool_call>"}  # plain added tokens: they appear in decoded text


def qwen_tiktoken_path() -> Path:
    try:
        dist = distribution("qwen-agent")
    except PackageNotFoundError:
        raise FileNotFoundError(
            "the Qwen vocabulary is built from qwen.tiktoken in the qwen-agent wheel: pip install --no-deps qwen-agent"
        ) from None
    for f in dist.files or []:
        if f.name == "qwen.tiktoken":
            return Path(str(dist.locate_file(f)))
    raise FileNotFoundError("qwen.tiktoken not found in the qwen-agent distribution")


def _byte_to_char() -> dict[int, str]:
    """Byte-level BPE's reversible map from bytes to printable characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The last merge that builds ``token``: run BPE on its bytes with ranks below its own."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = None, limit
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best is None:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts[0], parts[1]


def build_tokenizer_json(out: Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks: dict[bytes, int] = {}
    for line in qwen_tiktoken_path().read_text().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    to_char = _byte_to_char()
    text = lambda b: "".join(to_char[x] for x in b)  # noqa: E731
    vocab = {text(b): r for b, r in ranks.items()}
    merges = sorted((r, _merge_of(b, ranks)) for b, r in ranks.items() if len(b) > 1)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(text(a), text(b)) for _, (a, b) in merges], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out))
    return out


def base_tokenizer_json(cache: Path) -> Path:
    """Built once per qwen.tiktoken content, then reused from ``cache``."""
    digest = hashlib.sha256(qwen_tiktoken_path().read_bytes()).hexdigest()[:12]
    out = cache / f"qwen151k-{digest}.json"
    if not out.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        build_tokenizer_json(tmp).rename(out)
    return out


def qwen_tokenizer(base_json: Path, chat_template: str) -> PreTrainedTokenizerFast:
    """A fast tokenizer over the vocabulary with Qwen's added tokens, eos `<|im_end|>`, pad `<|endoftext|>`."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(base_json), clean_up_tokenization_spaces=False)
    for name in QWEN_ADDED:
        special = name not in NOT_SPECIAL
        tok.add_tokens([AddedToken(name, special=special, normalized=False)], special_tokens=special)
    tok.eos_token, tok.pad_token, tok.chat_template = "<|im_end|>", "<|endoftext|>", chat_template
    return tok
