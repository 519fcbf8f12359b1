"""Images in requests: resolved once, into decoded pixels, where the server loads them; and a backend's
image encoder (its model's image processor and placeholder token, or None for a text-only model).

Every API's images reach the model through here: the image parts of native and OpenAI chats
(`resolve_chats`) and the bytes of Tinker ImageChunks (`decode_all`). A part is read as the chat template
reads it (`vision.normalise_content`, `vision.part_source`), so the check and the use see one value. Only
a ``data:`` URL's bytes are taken: the server opens no path and fetches no URL that a request names, and
its refusal is the same whether such a file exists or not. The bytes go through the one decoder
(`twinkle.template.image_decode`) under the server's caps, every image's header (format, pixels) checked
before any is decoded; the template then gets decoded images and loads nothing itself. After encoding,
`check_layout` holds the image tokens to the template's layout (each image's placeholder run between the
model's vision markers), so a misplaced image is a 400 here, not an error inside the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twinkle.serve.backend.base import UserError

IMAGE_KEYS = ("pixel_values", "image_grid_thw")  # computed here from image parts, never taken from a request
_ENCODERS: dict[str, object] = {}  # a model folder -> its ImageEncoder (None: text-only)
_MARKERS: dict[str, tuple[int | None, int | None]] = {}  # a model folder -> its (vision start, end) token ids


def image_encoder(backend):
    """twinkle.template.vision.ImageEncoder of the backend's model folder, or None for a text-only model."""
    path = backend.tokenizer_path
    if path not in _ENCODERS:
        from twinkle.template.vision import load_image_encoder

        _ENCODERS[path] = load_image_encoder(path, backend.tokenizer)
    return _ENCODERS[path]


def image_caps(caps):
    """The decoder's per-image caps from the server's `caps` (twinkle.serve.core.bounds.ServerCaps)."""
    from twinkle.template.image_decode import ImageCaps

    return ImageCaps(max_bytes=caps.max_image_bytes, max_pixels=caps.max_image_pixels)


def request_bytes(src: Any, where: str) -> bytes:
    """An image part's bytes: only from a data: URL. The refusal of anything else never depends on what
    the server's disk or network holds, and never repeats the path."""
    from twinkle.template.image_decode import ImageRejected, data_url_bytes

    if isinstance(src, str) and src.startswith("data:"):
        try:
            return data_url_bytes(src, where)
        except ImageRejected as e:
            raise UserError(str(e)) from None
    if isinstance(src, str) and src.lower().startswith(("http://", "https://")):
        raise UserError(f"{where} is a remote URL; this server fetches nothing: send a data:image/...;base64 URL")
    what = "a path or URL" if isinstance(src, str) else f"a {type(src).__name__}"
    raise UserError(
        f"{where} is {what}, not a data: URL; this server opens no file or URL named by a request: send the "
        "image's bytes as a data:image/...;base64 URL"
    )


def decode_all(blobs: list[tuple[bytes, str]], caps) -> list:
    """PIL RGB images of (bytes, where) pairs: every header within the per-image caps and the request's
    pixel total within `caps.max_request_image_pixels` before the first image is decoded."""
    from twinkle.template.image_decode import ImageRejected, decode, read_header

    per_image = image_caps(caps)
    try:
        headers = [read_header(data, where, per_image) for data, where in blobs]
        total = sum(h.pixels for h in headers)
        if total > caps.max_request_image_pixels:
            raise UserError(
                f"the request's {len(blobs)} images have {total} pixels; one request may have at most "
                f"{caps.max_request_image_pixels} (caps.max_request_image_pixels)"
            )
        return [decode(data, h, where) for (data, where), h in zip(blobs, headers)]
    except ImageRejected as e:
        raise UserError(str(e)) from None


def resolve_chats(chats: list[list[dict]], backend, caps, wheres: list[str]) -> list[list[dict]]:
    """The chats with every image part replaced by ``{"type": "image", "image": <decoded image>}`` (its
    ``expected_tokens`` kept); a text-only model's images refused naming the model."""
    from twinkle.template.vision import is_image_part, normalise_content, part_source

    out, slots = [], []  # slots: (the parts list, the part's index in it, the part, its name)
    for chat, where in zip(chats, wheres):
        messages = [{**m, "content": normalise_content(m.get("content"))} for m in chat]
        parts = [
            (m["content"], j, p)
            for m in messages
            if isinstance(m["content"], list)
            for j, p in enumerate(m["content"])
            if is_image_part(p)
        ]
        if parts and image_encoder(backend) is None:
            raise UserError(f"{where}: model {backend.base_model!r} is text-only: it takes no images")
        slots += [(content, j, p, f"{where} image {k}") for k, (content, j, p) in enumerate(parts)]
        out.append(messages)
    blobs = [(request_bytes(part_source(part), w), w) for _, _, part, w in slots]
    for (content, j, part, _), image in zip(slots, decode_all(blobs, caps)):
        kept = {"expected_tokens": part["expected_tokens"]} if "expected_tokens" in part else {}
        content[j] = {"type": "image", "image": image, **kept}
    return out


def refuse_image_fields(names, where: str) -> None:
    """Image columns come only from the server's own encoding of image parts."""
    for name in names:
        if name in IMAGE_KEYS:
            raise UserError(f"{where}: {name} is computed by the server from image parts; it cannot be sent")


def vision_markers(backend) -> tuple[int | None, int | None]:
    """The special tokens the model's chat template writes right before and after an image's placeholder
    (Qwen-VL: <|vision_start|>, <|vision_end|>); None where it writes none."""
    path = backend.tokenizer_path
    if path not in _MARKERS:
        from twinkle.template import Template

        tok, enc = backend.tokenizer, image_encoder(backend)
        text = Template(model_id=path, tokenizer=tok).render_text([{"role": "user", "content": [{"type": "image"}]}])
        ids = tok(text, add_special_tokens=False)["input_ids"]
        at = ids.index(enc.token_id) if enc.token_id in ids else None  # None: the template places no marker
        special = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
        before = ids[at - 1] if at and ids[at - 1] in special else None
        after = ids[at + 1] if at is not None and at + 1 < len(ids) and ids[at + 1] in special else None
        _MARKERS[path] = (before, after)
    return _MARKERS[path]


def check_layout(ids, counts: list[int], backend, where: str) -> None:
    """Image tokens as the template lays them out: one run of placeholder tokens per image, of the length
    the model made of it, each between the model's vision markers, and no marker without its image."""
    enc, (start, end) = image_encoder(backend), vision_markers(backend)
    tok = backend.tokenizer
    ids = np.asarray(ids, dtype=np.int64)
    pad = ids == enc.token_id
    edges = np.flatnonzero(np.diff(np.concatenate([[0], pad.astype(np.int8), [0]])))
    runs = list(zip(edges[::2].tolist(), edges[1::2].tolist()))
    name = tok.convert_ids_to_tokens(enc.token_id)
    if int(pad.sum()) != sum(counts):
        raise UserError(
            f"{where}: {int(pad.sum())} {name} tokens, but the {len(counts)} image(s) make {sum(counts)}: "
            f"{name} tokens come only from images, never from text"
        )
    if [e - s for s, e in runs] != list(counts):
        raise UserError(
            f"{where}: the {len(counts)} images' {name} tokens form {len(runs)} run(s): images next to each "
            "other need the model's vision markers between them"
        )
    for k, (s, e) in enumerate(runs):
        if (start is not None and (s == 0 or ids[s - 1] != start)) or (
            end is not None and (e >= len(ids) or ids[e] != end)
        ):
            marks = " and ".join(tok.convert_ids_to_tokens(t) for t in (start, end) if t is not None)
            raise UserError(
                f"{where} image {k} (tokens {s}-{e}) is not between the model's vision markers {marks}: the "
                "tokens before an image end with the first, those after it begin with the second"
            )
    if start is not None and int((ids == start).sum()) != len(counts):
        raise UserError(
            f"{where}: {int((ids == start).sum())} {tok.convert_ids_to_tokens(start)} tokens for {len(counts)} "
            "image(s): each opens exactly one image"
        )


def check_encoded(messages: list[dict], encoded: dict, backend, where: str) -> None:
    """An encoded chat's images: each part's ``expected_tokens`` (optional) against the tokens the model
    made of it, the same 400 as a Tinker ImageChunk's mismatch, and the layout of its image tokens."""
    from twinkle.template.vision import is_image_part

    grid = encoded.get("image_grid_thw")
    if grid is None:
        return
    merge = getattr(image_encoder(backend), "merge", 1)
    counts = [(int(g[0]) * int(g[1]) * int(g[2])) // merge**2 for g in grid]
    expected = [
        p.get("expected_tokens")
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if is_image_part(p)
    ]
    for k, (want, made) in enumerate(zip(expected, counts)):
        if want is None:
            continue
        if not isinstance(want, int) or isinstance(want, bool):
            raise UserError(f"{where} image {k}: expected_tokens must be an integer, got {want!r}")
        if want != made:
            raise UserError(
                f"{where} image {k}: expected_tokens is {want} but model {backend.base_model!r} makes {made} "
                "tokens of this image"
            )
    check_layout(encoded["input_ids"], counts, backend, where)
