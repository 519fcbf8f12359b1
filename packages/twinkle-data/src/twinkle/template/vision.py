"""Images inside messages: finding them, loading them, and expanding their placeholder tokens.

A message's ``content`` may be a list of parts, as in the OpenAI and Hugging Face chat formats:
``{"type": "text", "text": ...}``, ``{"type": "image", "image": X}`` or
``{"type": "image_url", "image_url": {"url": X}}``, where X is a PIL image, PNG/JPEG/WebP bytes, a
local path, a ``data:image/...;base64,`` URL, or a datasets ``Image`` cell (``{"bytes", "path"}``). Remote
URLs are refused: encoding never touches the network. Bytes are decoded by ``image_decode`` (format from
the magic bytes, size from the header, before decoding).

The chat template writes one image placeholder per image; the model's image processor decides how
many tokens each image becomes (its grid of merged patches), and every placeholder is repeated that
many times, exactly as the Hugging Face processor does, before the text is tokenized.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from twinkle.dataset.errors import DataError
from twinkle.template import image_decode

if TYPE_CHECKING:
    from PIL import Image
    from transformers import PreTrainedTokenizerBase
    from transformers.image_processing_utils import BaseImageProcessor

IMAGE_PART_TYPES = ("image", "image_url")


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def normalise_content(content: Any) -> Any:
    """A list of parts with their None fields dropped (Arrow fills a struct's absent fields with
    nulls) and a ``type`` on each, so the chat template only ever reads ``part['type']``."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        elif isinstance(part, dict):
            part = {k: v for k, v in part.items() if v is not None}
            if "type" not in part:
                part["type"] = next((t for t in IMAGE_PART_TYPES if t in part), "text")
        parts.append(part)
    return parts


def part_source(part: dict) -> Any:
    """The image an image part names: ``part["image"]``, or ``part["image_url"]`` (its ``url`` if a dict)."""
    src = part.get("image", part.get("image_url"))
    return src.get("url") if isinstance(src, dict) and "url" in src else src


def image_sources(messages: list[dict]) -> list[Any]:
    """Every image of a conversation, in the order the chat template places them."""
    return [
        part_source(part)
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if is_image_part(part)
    ]


def text_of(content: Any) -> str:
    """The text parts of a content (a string or a list of parts), for checks on the text alone."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and not is_image_part(p))
    return ""


def load_image(src: Any) -> Image.Image:
    """A PIL RGB image from any of the accepted forms (see the module docs), local paths included: the
    library reads its own user's files. A server resolves parts to bytes before this (it opens no path)."""
    from PIL import Image

    if isinstance(src, Image.Image):
        return src if src.mode == "RGB" else src.convert("RGB")  # decoded already: no second copy
    if isinstance(src, dict) and ("bytes" in src or "path" in src):  # a datasets Image cell
        src = src.get("bytes") or src.get("path")
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
    elif isinstance(src, str) and src.startswith("data:"):
        data = image_decode.data_url_bytes(src, "image")
    elif isinstance(src, str) and src.startswith(("http://", "https://")):
        raise DataError(f"image URL {src[:60]!r} is remote: pass the image's bytes, a data URL or a local path")
    elif isinstance(src, (str, os.PathLike)):
        if not os.path.isfile(src):
            raise DataError(f"image file {os.fspath(src)!r} does not exist")
        with open(src, "rb") as f:
            data = f.read()
    else:
        raise DataError(f"cannot read an image from a {type(src).__name__}")
    return image_decode.decode_image(data, "image", image_decode.LOCAL_CAPS)


def expand_placeholders(
    text: str, placeholder: str, counts: list[int], spans: list[tuple[int, int]]
) -> tuple[str, list[tuple[int, int]]]:
    """Repeat the i-th ``placeholder`` ``counts[i]`` times; shift the character spans to match."""
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(counts):
        raise DataError(
            f"the chat template wrote {len(pieces) - 1} image placeholders for {len(counts)} images "
            f"(is {placeholder!r} written into a message's text?)"
        )
    out, shifts, pos = [pieces[0]], [], len(pieces[0])
    for n, piece in zip(counts, pieces[1:]):
        shifts.append((pos + len(placeholder), (n - 1) * len(placeholder)))  # after this point, move by this
        out.append(placeholder * n + piece)
        pos += len(placeholder) + len(piece)

    def moved(x: int) -> int:
        return x + sum(d for at, d in shifts if x >= at)

    return "".join(out), [(moved(lo), moved(hi)) for lo, hi in spans]


class ImageEncoder:
    """The model's image processor plus its placeholder token: images to pixels and token counts."""

    def __init__(
        self,
        image_processor: BaseImageProcessor,
        tokenizer: PreTrainedTokenizerBase,
        placeholder: str = "<|image_pad|>",
    ) -> None:
        self.image_processor = image_processor
        self.placeholder = placeholder
        self.token_id = tokenizer.convert_tokens_to_ids(placeholder)
        self.merge = getattr(image_processor, "merge_size", 1)
        self.patch_size: int | None = getattr(image_processor, "patch_size", None)  # Qwen-VL's processors have it

    def encode(self, sources: list[Any]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(pixel_values [patches, dim], image_grid_thw [images, 3], tokens per image)."""
        images = [load_image(s) for s in sources]
        out = self.image_processor(images=images, return_tensors="np")
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64)
        counts = [int(g.prod()) // (self.merge**2) for g in grid]
        return np.asarray(out["pixel_values"], dtype=np.float32), grid, counts


def load_image_encoder(model_path: str, tokenizer: PreTrainedTokenizerBase) -> ImageEncoder | None:
    """The encoder of a vision-language checkpoint folder; None for a text-only model."""
    if not os.path.isfile(os.path.join(model_path, "preprocessor_config.json")):
        return None
    from transformers import AutoImageProcessor

    return ImageEncoder(AutoImageProcessor.from_pretrained(model_path), tokenizer)
