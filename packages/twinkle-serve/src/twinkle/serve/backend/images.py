"""A backend's image encoder: its model's image processor and placeholder token, or None (text-only).

Both facades expand images with it (Tinker image chunks, native and OpenAI chats with image parts),
so a model's text-only refusal and its token counts are the same whichever API asks.
"""

from __future__ import annotations

_ENCODERS: dict[str, object] = {}  # a model folder -> its ImageEncoder (None: text-only)


def image_encoder(backend):
    """twinkle.template.vision.ImageEncoder of the backend's model folder, or None for a text-only model."""
    path = backend.tokenizer_path
    if path not in _ENCODERS:
        from twinkle.template.vision import load_image_encoder

        _ENCODERS[path] = load_image_encoder(path, backend.tokenizer)
    return _ENCODERS[path]


def check_images(messages: list[dict], backend, where: str) -> None:
    """Refuse, naming the model, images in the messages of a text-only model; and remote image URLs
    (the server fetches nothing)."""
    from twinkle.template.vision import image_sources

    from twinkle.serve.backend.base import UserError

    sources = image_sources(messages)
    if not sources:
        return
    if image_encoder(backend) is None:
        raise UserError(f"{where}: model {backend.base_model!r} is text-only: it takes no images")
    for src in sources:
        if isinstance(src, str) and src.startswith(("http://", "https://")):
            raise UserError(
                f"{where}: image {src[:60]!r} is a remote URL; this server fetches nothing: send a data: URL"
            )
        if not (isinstance(src, str) and src.startswith("data:")):
            raise UserError(f"{where}: an image must be a data:image/...;base64 URL, got a {type(src).__name__}")
