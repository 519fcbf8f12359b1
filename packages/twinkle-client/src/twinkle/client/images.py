"""Images in chats sent to a Twinkle server: every image part travels as a ``data:`` URL.

The server computes pixels with its model's own image processor and opens or fetches nothing a request
names, so a chat's images go as their bytes: a local path is read here (the caller's own file), bytes
and PIL images become PNG/JPEG/WebP data URLs, and a remote ``http(s)`` URL is refused before anything
is sent. No imaging library is needed here; the server's decoder checks the bytes again.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Mapping

IMAGE_PART_TYPES = ("image", "image_url")
_MAGIC = {b"\x89PNG\r\n\x1a\n": "png", b"\xff\xd8\xff": "jpeg"}


def is_image_part(part) -> bool:
    return isinstance(part, Mapping) and part.get("type", next((t for t in IMAGE_PART_TYPES if t in part), None)) in (
        IMAGE_PART_TYPES
    )


def has_images(messages) -> bool:
    return any(
        isinstance(m, Mapping) and isinstance(m.get("content"), list) and any(is_image_part(p) for p in m["content"])
        for m in messages
    )


def data_url(src) -> str:
    """A ``data:image/...;base64,`` URL for an image given as bytes, a path, a PIL image, a data URL or a
    datasets Image cell ({"bytes", "path"})."""
    if isinstance(src, Mapping) and ("bytes" in src or "path" in src):
        src = src.get("bytes") or src.get("path")
    if isinstance(src, str) and src.startswith("data:"):
        return src
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        raise ValueError(f"image {src[:60]!r} is a remote URL: the server fetches nothing; send the image's bytes")
    if hasattr(src, "save") and hasattr(src, "mode"):  # a PIL image, without importing PIL
        buffer = io.BytesIO()
        src.save(buffer, format="PNG")
        src = buffer.getvalue()
    elif isinstance(src, (str, os.PathLike)):
        if not os.path.isfile(src):
            raise ValueError(f"image file {os.fspath(src)!r} does not exist")
        with open(src, "rb") as f:
            src = f.read()
    if not isinstance(src, (bytes, bytearray, memoryview)):
        raise ValueError(f"cannot send a {type(src).__name__} as an image: pass bytes, a path or a PIL image")
    data = bytes(src)
    kind = next((k for magic, k in _MAGIC.items() if data.startswith(magic)), None)
    if kind is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        kind = "webp"
    if kind is None:
        raise ValueError(f"image bytes ({len(data)} bytes) are not PNG, JPEG or WebP (the formats the server takes)")
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def wire_messages(messages) -> list[dict]:
    """The messages with every image part as ``{"type": "image_url", "image_url": {"url": data URL}}``
    (plus its ``expected_tokens``, if given: the image tokens the caller expects the model to make)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if is_image_part(p):
                    src = p.get("image", p.get("image_url"))
                    src = src.get("url") if isinstance(src, Mapping) and "url" in src else src
                    part = {"type": "image_url", "image_url": {"url": data_url(src)}}
                    if p.get("expected_tokens") is not None:  # the server checks it, as Tinker's does
                        part["expected_tokens"] = p["expected_tokens"]
                    parts.append(part)
                else:
                    parts.append(dict(p) if isinstance(p, Mapping) else {"type": "text", "text": str(p)})
            m = {**m, "content": parts}
        out.append(dict(m))
    return out
