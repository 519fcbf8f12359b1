"""Tinker image chunks: decoding them, checking them against the model, and expanding them to tokens.

A Tinker `ModelInput` may hold `ImageChunk`s (PNG or JPEG bytes, optional `expected_tokens`) between
its text chunks. The client writes the vision markers (`<|vision_start|>` ... `<|vision_end|>`) as
text; an image chunk stands for the model's image placeholder token repeated once per merged patch,
which the model's own image processor decides. So a chunk is kept as it was sent until the model is
known (`ImagePiece`, at its token position), then `expand` decodes it with the decoder every API uses
(twinkle.serve.backend.images: format from the magic bytes, caps from the header), inserts the
placeholder tokens there, checks them against the template's layout (the vision markers around each
image), and carries the pixels (`pixel_values`, `image_grid_thw`) with the datum.

`ImageAssetPointerChunk` names an image by location in the hosted service's asset store; this server
has none and fetches nothing, so it is refused by name.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, replace

import numpy as np

from twinkle.serve.backend import UserError
from twinkle.serve.backend.images import check_layout, decode_all, image_encoder, refuse_image_fields
from twinkle.serve.errors import BadRequest
from twinkle.serve.tinker.datums import Datum

FORMATS = {"png": "PNG", "jpeg": "JPEG"}  # the SDK's format names -> PIL's
ASSET_POINTER = "image_asset_pointer"


@dataclass(frozen=True)
class ImagePiece:
    at: int  # the token position its placeholder tokens go to
    data: bytes
    format: str
    expected_tokens: int | None


def asset_pointer_refused(where: str) -> BadRequest:
    return BadRequest(
        f"{where}: image_asset_pointer chunks need the hosted service's asset store, which this server does "
        "not have (it fetches nothing); send the image's bytes in an ImageChunk instead"
    )


def from_proto(msg, at: int) -> ImagePiece:
    expected = msg.expected_tokens if msg.HasField("expected_tokens") else None
    return ImagePiece(at, bytes(msg.data), msg.format, expected)


def from_json(chunk: dict, at: int, where: str) -> ImagePiece:
    """An SDK ImageChunk as JSON ({"type": "image", "data": base64, "format", "expected_tokens"})."""
    data, expected = chunk.get("data"), chunk.get("expected_tokens")
    if not isinstance(data, str):
        raise BadRequest(f"{where}: an image chunk's data must be a base64 string")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"{where}: an image chunk's data is not valid base64: {e}") from None
    if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool)):
        raise BadRequest(f"{where}: expected_tokens must be an integer, got {expected!r}")
    return ImagePiece(at, raw, str(chunk.get("format")), expected)


def _decoded(groups: list[tuple[str, list[ImagePiece]]], backend, model: str, caps) -> list[list]:
    """Each group's (a datum's, a prompt's) pieces decoded by the server's one decoder: the format label
    checked against the bytes, and every header within the caps before any image is decoded."""
    from twinkle.template.image_decode import sniff

    blobs = []
    for where, pieces in groups:
        if pieces and image_encoder(backend) is None:
            raise BadRequest(f"{where}: model {model!r} is text-only: it takes no image chunks")
        for k, piece in enumerate(pieces):
            if piece.format not in FORMATS:
                raise BadRequest(f"{where} image {k}: format must be one of {sorted(FORMATS)}, got {piece.format!r}")
            actual = sniff(piece.data)
            if actual in ("PNG", "JPEG", "WEBP") and actual != FORMATS[piece.format]:
                raise BadRequest(
                    f"{where} image {k}: the chunk says format {piece.format!r} but its bytes are {actual}"
                )
            blobs.append((piece.data, f"{where} image {k}"))
    try:
        images = iter(decode_all(blobs, caps))
    except UserError as e:
        raise BadRequest(str(e)) from None
    return [[next(images) for _ in pieces] for _, pieces in groups]


def _splice(tokens, pieces: list[ImagePiece], images: list, backend, model: str, where: str):
    """(tokens with each image's placeholder tokens inserted, {"pixel_values", "image_grid_thw"})."""
    enc = image_encoder(backend)
    pixels, grid, counts = enc.encode(images)
    tokens = np.asarray(tokens, dtype=np.int64).tolist()  # a datum's array or a prompt's list, spliced as a list
    out, last = [], 0
    for k, (piece, n) in enumerate(zip(pieces, counts)):
        if piece.expected_tokens is not None and piece.expected_tokens != n:
            raise BadRequest(
                f"{where} image {k}: expected_tokens is {piece.expected_tokens} but model {model!r} "
                f"makes {n} tokens of this {piece.format} image"
            )
        out += tokens[last : piece.at] + [enc.token_id] * n
        last = piece.at
    out += tokens[last:]
    try:
        check_layout(out, counts, backend, where)
    except UserError as e:
        raise BadRequest(str(e)) from None
    return out, {
        "pixel_values": np.asarray(pixels, np.float32),
        "image_grid_thw": np.asarray(grid, np.int64),
    }


def expand(tokens: list[int] | np.ndarray, pieces: list[ImagePiece], backend, model: str, where: str, caps):
    """(tokens with each image's placeholder tokens inserted, {"pixel_values", "image_grid_thw"});
    `caps`: the server's (image bytes and pixels)."""
    (images,) = _decoded([(where, pieces)], backend, model, caps)
    return _splice(tokens, pieces, images, backend, model, where)


def expand_datums(data: list[Datum], backend, model: str, caps) -> list[Datum]:
    """Each datum's image chunks expanded for `model` (datums without images unchanged)."""
    for i, d in enumerate(data):
        try:
            refuse_image_fields(d.inputs, f"datum {i}: loss_fn_inputs")
        except UserError as e:
            raise BadRequest(str(e)) from None
    groups = [(f"datum {i}", d.images or []) for i, d in enumerate(data)]
    out = []
    for (where, pieces), d, images in zip(groups, data, _decoded(groups, backend, model, caps)):
        if not pieces:
            out.append(d)
            continue
        tokens, columns = _splice(d.tokens, pieces, images, backend, model, where)
        out.append(replace(d, tokens=np.asarray(tokens, dtype=np.int64), images=columns))  # an array, as decoded
    return out
