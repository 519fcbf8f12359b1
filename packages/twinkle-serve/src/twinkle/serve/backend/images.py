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
    from twinkle.serve.backend.base import UserError
    from twinkle.template.vision import image_sources

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


def check_expected_tokens(messages: list[dict], grid_thw, backend, where: str) -> None:
    """Each image part's ``expected_tokens`` (optional) against the tokens the model made of it, the
    same 400 as a Tinker ImageChunk's mismatch, naming both counts."""
    from twinkle.serve.backend.base import UserError
    from twinkle.template.vision import is_image_part

    expected = [
        p.get("expected_tokens")
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if is_image_part(p)
    ]
    merge = getattr(image_encoder(backend), "merge", 1)
    for k, (want, grid) in enumerate(zip(expected, grid_thw or ())):
        if want is None:
            continue
        if not isinstance(want, int) or isinstance(want, bool):
            raise UserError(f"{where} image {k}: expected_tokens must be an integer, got {want!r}")
        made = (int(grid[0]) * int(grid[1]) * int(grid[2])) // merge**2
        if want != made:
            raise UserError(
                f"{where} image {k}: expected_tokens is {want} but model {backend.base_model!r} makes {made} "
                "tokens of this image"
            )
