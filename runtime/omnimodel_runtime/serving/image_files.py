"""What an uploaded image file is, read from its header alone (no decoder in the gateway): PNG, JPEG or
WebP, and its size in pixels. Enough to refuse a file that is not an image, or too large, with a 400
naming the field before any stage is asked, and to tell the stages the input's size (which decides
the size the pipeline works at). The entry stage decodes the bytes with Pillow and checks they agree.
"""

from __future__ import annotations

import struct
from typing import Final

_PNG: Final = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic), which carry the size.
# PNG colour types with an alpha channel: grey + alpha (4), RGBA (6).
_PNG_ALPHA_TYPES: Final = frozenset({4, 6})
_SOF: Final = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def image_info(data: bytes) -> tuple[str, int, int] | None:
    """``(mime type, width, height)`` of a PNG, JPEG or WebP file; None for anything else (or a header
    too broken to read)."""
    try:
        if data.startswith(_PNG) and data[12:16] == b"IHDR":
            width, height = struct.unpack(">II", data[16:24])
            return "image/png", width, height
        if data.startswith(b"\xff\xd8"):
            return _jpeg(data)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return _webp(data)
    except struct.error:
        return None
    return None


def png_has_alpha(data: bytes) -> bool:
    """Whether a PNG file has transparency: a colour type with an alpha channel (grey + alpha, RGBA) or a
    ``tRNS`` chunk (a palette's alpha, or one transparent grey/RGB value), which PNG puts before the image
    data. An edit's mask says where to edit by its transparent pixels, so a mask without any is refused."""
    if not (data.startswith(_PNG) and data[12:16] == b"IHDR") or len(data) < 26:
        return False
    if data[25] in _PNG_ALPHA_TYPES:
        return True
    offset = 8
    while offset + 8 <= len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        tag = data[offset + 4 : offset + 8]
        if tag == b"tRNS":
            return True
        if tag in (b"IDAT", b"IEND"):
            return False
        offset += 12 + length  # length, tag, data, CRC
    return False


def _jpeg(data: bytes) -> tuple[str, int, int] | None:
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            i += 2
            continue
        (length,) = struct.unpack(">H", data[i + 2 : i + 4])
        if marker in _SOF:
            height, width = struct.unpack(">HH", data[i + 5 : i + 9])
            return "image/jpeg", width, height
        i += 2 + length
    return None


def _webp(data: bytes) -> tuple[str, int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return "image/webp", width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and data[20] == 0x2F:
        (bits,) = struct.unpack("<I", data[21:25])
        return "image/webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        width = int.from_bytes(data[24:27], "little") + 1
        height = int.from_bytes(data[27:30], "little") + 1
        return "image/webp", width, height
    return None
