"""The server's one image decoder (twinkle.template.image_decode under the server's caps, through
twinkle.serve.backend.images.decode_all), without a server: what it takes, what it refuses and why, and
a hypothesis fuzz over random and mutated PNG, JPEG, WebP, GIF, BMP and EPS headers and bodies in which
every outcome is an RGB image within the caps or the decoder's typed refusal naming the image."""

from __future__ import annotations

import io
import struct
import zlib

import pytest

from twinkle.serve.backend import UserError
from twinkle.serve.backend.images import decode_all
from twinkle.serve.core.bounds import ServerCaps

CAPS = ServerCaps(max_image_bytes=1 << 20, max_image_pixels=1 << 16, max_request_image_pixels=1 << 17)


def _encoded(fmt: str, size=(12, 9), mode="RGB", **kw) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, size, 90).save(buffer, fmt, **kw)
    return buffer.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _ihdr(w: int, h: int) -> bytes:
    return _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))


def _decode(data: bytes, caps: ServerCaps = CAPS):
    (image,) = decode_all([(data, "image 0")], caps)
    return image


def _refusal(data: bytes, caps: ServerCaps = CAPS) -> str:
    with pytest.raises(UserError) as refused:
        _decode(data, caps)
    return str(refused.value)


SEEDS = {
    "png": _encoded("PNG"),
    "png-rgba16": _encoded("PNG", mode="I;16"),
    "png-palette": _encoded("PNG", mode="P"),
    "jpeg": _encoded("JPEG"),
    "jpeg-progressive": _encoded("JPEG", progressive=True),
    "jpeg-cmyk": _encoded("JPEG", mode="CMYK"),
    "webp": _encoded("WEBP"),
    "webp-lossless": _encoded("WEBP", lossless=True),
    "webp-extended": _encoded("WEBP", exif=b"Exif\x00\x00II*\x00"),  # a VP8X header
    "gif": _encoded("GIF"),
    "bmp": _encoded("BMP"),
    "eps": _encoded("EPS"),
}


@pytest.mark.parametrize("name", [n for n in SEEDS if n.split("-")[0] in ("png", "jpeg", "webp")])
def test_png_jpeg_and_webp_decode_to_rgb_at_their_header_size(name):
    image = _decode(SEEDS[name])
    assert image.mode == "RGB" and image.size == (12, 9)


@pytest.mark.parametrize("name, shown", [("gif", "GIF"), ("bmp", "BMP"), ("eps", "PostScript/EPS")])
def test_other_formats_are_refused_before_pil_sees_them(name, shown, monkeypatch):
    from PIL import BmpImagePlugin, EpsImagePlugin, GifImagePlugin

    for plugin in (EpsImagePlugin.EpsImageFile, GifImagePlugin.GifImageFile, BmpImagePlugin.BmpImageFile):
        monkeypatch.setattr(plugin, "_open", lambda self: pytest.fail(f"{type(self).__name__} was opened"))
    message = _refusal(SEEDS[name])
    assert message == f"image 0: the bytes are {shown}, not a PNG/JPEG/WebP image (the only formats taken)"
    assert "unknown format" in _refusal(b"\x00" * 64)


def test_sizes_are_read_from_the_header_and_capped_before_decoding():
    png = SEEDS["png"]
    bomb = png[:8] + _ihdr(40000, 40000) + png[33:]
    assert len(bomb) < 100
    assert _refusal(bomb).startswith("image 0: the PNG header declares 40000x40000 = 1600000000 pixels; an image")
    second = png[:33] + _ihdr(5000, 5000) + png[33:]  # a later IHDR: any size a header declares counts
    assert "declares 5000x5000" in _refusal(second)
    assert "declares 0x9 = 0 pixels" in _refusal(png[:8] + _ihdr(0, 9) + png[33:])
    jpeg = SEEDS["jpeg"]
    sof = jpeg.index(b"\xff\xc0")
    huge = jpeg[: sof + 5] + struct.pack(">HH", 30000, 30000) + jpeg[sof + 9 :]
    assert "the JPEG header declares 30000x30000" in _refusal(huge)
    assert "a truncated or malformed PNG header" in _refusal(png[:12])
    big = ServerCaps(max_image_bytes=1024)
    assert (
        _refusal(b"\x89PNG\r\n\x1a\n" + bytes(2000), big)
        == "image 0: 2008 bytes are more than an image may have (1024)"
    )
    many = jpeg[:2] + b"\xff\xda" * 300
    assert _refusal(many) == "image 0: a JPEG header with more than 256 scans"


def test_a_request_s_images_share_one_pixel_budget():
    png = _encoded("PNG", size=(256, 256))  # 65,536 pixels: one image's cap
    assert len(decode_all([(png, "image 0"), (png, "image 1")], CAPS)) == 2
    with pytest.raises(UserError, match=r"the request's 3 images have 196608 pixels; one request may have at most"):
        decode_all([(png, f"image {k}") for k in range(3)], CAPS)


def test_pil_s_bomb_check_never_fires(recwarn):
    """Sizes past PIL's bomb threshold (a warning past it, an error past twice it) are the decoder's
    typed refusal, even at the largest cap a config may set."""
    from PIL import Image

    assert ServerCaps.model_fields["max_image_pixels"].metadata[-1].le <= Image.MAX_IMAGE_PIXELS
    widest = ServerCaps(max_image_pixels=89_478_485, max_request_image_pixels=1 << 30)
    png = SEEDS["png"]
    for side in (9500, 14000):  # 90 Mpx: PIL would warn; 196 Mpx: PIL would raise DecompressionBombError
        assert f"declares {side}x{side}" in _refusal(png[:8] + _ihdr(side, side) + png[33:], widest)
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]


def _mutated(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    """Each edit: (kind, position, bytes): 0 overwrite, 1 insert, 2 delete len(bytes), 3 truncate."""
    out = bytearray(data)
    for kind, at, blob in edits:
        at %= max(len(out), 1)
        if kind == 0:
            out[at : at + len(blob)] = blob
        elif kind == 1:
            out[at:at] = blob
        elif kind == 2:
            del out[at : at + len(blob)]
        else:
            del out[at:]
    return bytes(out)


def test_fuzzed_images_decode_within_the_caps_or_are_refused_by_name():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    edit = st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8))
    dims = st.tuples(st.integers(0, 1 << 17), st.integers(0, 1 << 17))
    mutated = st.builds(_mutated, st.sampled_from(list(SEEDS.values())), st.lists(edit, max_size=4))
    resized = st.builds(  # a seed's header patched to other sizes (PNG IHDR, JPEG SOF, WebP VP8X)
        lambda name, wh: _resized(SEEDS[name], *wh), st.sampled_from(["png", "jpeg", "webp-extended"]), dims
    )
    magic = st.sampled_from(
        [b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"RIFF\x00\x00\x00\x00WEBPVP8X", b"GIF89a", b"%!PS"]
    )
    noise = st.builds(lambda m, tail: m + tail, magic, st.binary(max_size=256))
    outcomes: dict[str, int] = {}

    @settings(max_examples=600, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.one_of(mutated, resized, noise, st.binary(max_size=64)))
    def one(data: bytes):
        try:
            image = _decode(data)
        except UserError as e:
            assert str(e).startswith("image 0"), e  # noqa: PT017 - one of many drawn inputs: refusals are counted
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            return
        w, h = image.size
        assert image.mode == "RGB" and 0 < w * h <= CAPS.max_image_pixels
        outcomes["decoded"] = outcomes.get("decoded", 0) + 1

    one()
    assert outcomes.get("decoded", 0) >= 10 and outcomes.get("refused", 0) >= 100, outcomes  # both reached


def _resized(data: bytes, w: int, h: int) -> bytes:
    if data.startswith(b"\x89PNG"):
        return data[:8] + _ihdr(w, h) + data[33:]
    if data.startswith(b"\xff\xd8"):
        sof = data.index(b"\xff\xc0")
        return data[: sof + 5] + struct.pack(">HH", h & 0xFFFF, w & 0xFFFF) + data[sof + 9 :]
    return (
        data[:24]
        + ((w - 1) % (1 << 24)).to_bytes(3, "little")
        + ((h - 1) % (1 << 24)).to_bytes(3, "little")
        + data[30:]
    )
