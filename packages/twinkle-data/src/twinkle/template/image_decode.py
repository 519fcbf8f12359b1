"""One decoder for every image a chat or a Tinker chunk carries: its format, size and pixel count read
from the bytes' own header and checked before anything is decoded.

Only PNG, JPEG and WebP are taken, recognised by their magic bytes whatever a label or a file name says.
PIL is told to open only the one format the header showed, so none of its other plugins is ever reached
(GIF, BMP, TIFF, and EPS, whose plugin runs Ghostscript on the bytes where it is installed). Width and
height are parsed here and checked against the caps before PIL reads anything: a 69-byte PNG declaring
40000x40000 is refused without an allocation, and PIL's own decompression-bomb check (a warning past
``Image.MAX_IMAGE_PIXELS``, an error past twice that) cannot fire, because ``max_pixels`` is at most
that. Every refusal is an ``ImageRejected`` (a ``DataError``, so a ``ValueError``) naming the image.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from twinkle.dataset.errors import DataError

if TYPE_CHECKING:
    from PIL import Image

PIL_BOMB_PIXELS = 89_478_485  # PIL's Image.MAX_IMAGE_PIXELS default: past it PIL warns, past twice it raises
MAX_PNG_CHUNKS = 16_384  # PIL walks a PNG's chunks in Python; 16k chunks of 8 KB IDAT hold 128 MB
MAX_JPEG_SEGMENTS = 1024  # before the first scan; real encoders write fewer than 30
MAX_JPEG_SCANS = 256  # each progressive scan is a pass over the whole image; encoders write about 10

_MAGIC = {"PNG": b"\x89PNG\r\n\x1a\n", "JPEG": b"\xff\xd8\xff"}
_OTHERS = {  # recognised only to name them in the refusal
    b"GIF8": "GIF",
    b"BM": "BMP",
    b"%!PS": "PostScript/EPS",
    b"\xc5\xd0\xd3\xc6": "EPS",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
    b"%PDF": "PDF",
    b"\x00\x00\x01\x00": "ICO",
    b"<": "XML/SVG",
}


class ImageRejected(DataError):
    """An image's bytes refused before or while decoding; the message names the image and why."""


@dataclass(frozen=True)
class ImageCaps:
    """What one image may be: its encoded bytes and its pixels (width x height, from the header)."""

    max_bytes: int = 20 * 2**20
    max_pixels: int = 1 << 24  # 4096 x 4096

    def __post_init__(self) -> None:
        if not 0 < self.max_pixels <= PIL_BOMB_PIXELS:
            raise ValueError(
                f"max_pixels must be in (0, {PIL_BOMB_PIXELS}] (PIL's own bomb limit), got {self.max_pixels}"
            )


LOCAL_CAPS = ImageCaps(max_bytes=2**31, max_pixels=PIL_BOMB_PIXELS)  # the library's own files: PIL's limit


@dataclass(frozen=True)
class ImageHeader:
    format: str  # "PNG", "JPEG" or "WEBP"
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def sniff(data: bytes) -> str:
    """The format the magic bytes show: PNG, JPEG, WEBP, or the name of a refused one ("unknown")."""
    for name, magic in _MAGIC.items():
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in _OTHERS.items() if data.startswith(magic)), "unknown")


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL."""
    header, _, payload = url.partition(",")
    if ";base64" not in header or not header.startswith("data:image/"):
        raise ImageRejected(f"{where}: an image data URL must be data:image/...;base64,..., got {header[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageRejected(f"{where}: an image data URL has invalid base64: {e}") from None


def read_header(data: bytes, where: str, caps: ImageCaps) -> ImageHeader:
    """Format and size from the header alone, within the caps; nothing is decoded."""
    if len(data) > caps.max_bytes:
        raise ImageRejected(f"{where}: {len(data)} bytes are more than an image may have ({caps.max_bytes})")
    kind = sniff(data)
    if kind not in ("PNG", "JPEG", "WEBP"):
        shown = "of an unknown format" if kind == "unknown" else kind
        raise ImageRejected(f"{where}: the bytes are {shown}, not a PNG/JPEG/WebP image (the only formats taken)")
    try:
        sizes = {"PNG": _png_sizes, "JPEG": _jpeg_sizes, "WEBP": _webp_sizes}[kind](data)
    except (struct.error, IndexError):
        sizes = []
    except ValueError as e:
        raise ImageRejected(f"{where}: a {kind} header with {e}") from None
    if not sizes:
        raise ImageRejected(f"{where}: a truncated or malformed {kind} header (no image size in it)")
    for w, h in sizes:  # every size a header declares: a decoder may take any of them
        if w <= 0 or h <= 0 or w * h > caps.max_pixels:
            raise ImageRejected(
                f"{where}: the {kind} header declares {w}x{h} = {w * h} pixels; an image may have 1 to "
                f"{caps.max_pixels} (refused before decoding)"
            )
    return ImageHeader(kind, *sizes[-1])


def decode(data: bytes, header: ImageHeader, where: str) -> Image.Image:
    """The RGB image of bytes whose header `read_header` passed; any decoder failure is ImageRejected."""
    from PIL import Image

    try:
        im = Image.open(io.BytesIO(data), formats=[header.format])
        if im.size != (header.width, header.height):
            raise ValueError(
                f"PIL reads its size as {im.size[0]}x{im.size[1]}, the header {header.width}x{header.height}"
            )
        return im.convert("RGB")
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, EOFError... for malformed bodies
        raise ImageRejected(f"{where}: {len(data)} bytes of {header.format} do not decode: {e}") from None


def decode_image(data: bytes, where: str, caps: ImageCaps = LOCAL_CAPS) -> Image.Image:
    """`read_header` then `decode`: a PIL RGB image, or ImageRejected."""
    return decode(data, read_header(data, where, caps), where)


def _png_sizes(data: bytes) -> list[tuple[int, int]]:
    sizes, pos = [], 8
    for _ in range(MAX_PNG_CHUNKS):
        if pos + 8 > len(data):
            return sizes
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"IHDR":
            sizes.append(struct.unpack_from(">II", data, pos + 8))
        pos += 12 + length
    raise ValueError(f"more than {MAX_PNG_CHUNKS} chunks")


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_sizes(data: bytes) -> list[tuple[int, int]]:
    if data.count(b"\xff\xda") > MAX_JPEG_SCANS:
        raise ValueError(f"more than {MAX_JPEG_SCANS} scans")
    sizes, pos = [], 2
    for _ in range(MAX_JPEG_SEGMENTS):
        while pos < len(data) and data[pos] == 0xFF:  # fill bytes before a marker
            pos += 1
        if pos >= len(data):
            return sizes
        marker, pos = data[pos], pos + 1
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            continue
        if marker in (0xD9, 0xDA):  # the end of the image, or its first scan: the header is over
            return sizes
        (length,) = struct.unpack_from(">H", data, pos)
        if length < 2:
            raise ValueError(f"a segment of length {length}")
        if marker in _SOF:
            h, w = struct.unpack_from(">HH", data, pos + 3)
            sizes.append((w, h))
        pos += length
    raise ValueError(f"more than {MAX_JPEG_SEGMENTS} segments before the first scan")


def _webp_sizes(data: bytes) -> list[tuple[int, int]]:
    kind = data[12:16]
    if kind == b"VP8X":  # the canvas: 24-bit width-1 and height-1; every frame lies within it
        return [(int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1)]
    if kind == b"VP8L" and data[20] == 0x2F:
        (bits,) = struct.unpack_from("<I", data, 21)
        return [((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)]
    if kind == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack_from("<HH", data, 26)
        return [(w & 0x3FFF, h & 0x3FFF)]
    return []
