"""Image width and height from the file header, without decoding a pixel.

:func:`image_size` reads JPEG, PNG, WebP and GIF headers and returns exactly what
``PIL.Image.open(data).size`` reports, which is the size a task encoder that decodes with PIL
sees, so a length function built on it counts the media tokens the encoder counts:

- JPEG: the frame header (any SOF marker: baseline, progressive, lossless, arithmetic; CMYK
  too), walking the marker segments up to the first scan and seeking past each segment's
  payload (an EXIF thumbnail or an ICC profile is skipped, never read). EXIF orientation is NOT
  applied: ``Image.open(...).size`` ignores it, and so does every encoder that decodes with
  ``Image.open(...).convert("RGB")`` without calling ``ImageOps.exif_transpose``. An encoder
  that transposes must swap width and height itself for orientations 5-8.
- PNG (and APNG): the IHDR chunk, its CRC checked.
- WebP: the first chunk: ``VP8`` (lossy), ``VP8L`` (lossless) or ``VP8X`` (extended: alpha,
  animation; the canvas size).
- GIF: the logical screen, enlarged to the first frame's extent where that frame reaches past
  it, as PIL does when it opens the file (the frame PIL's ``convert`` decodes).

What is read: 12 bytes to recognise the format, then the header fields only (a JPEG's segment
markers and lengths up to its frame header, a GIF's extension blocks before its first frame).
Anything else (an unknown format, a truncated or corrupt header, a zero width or height) raises
:class:`~energon_ordering.errors.SampleLengthError` naming the format and the problem.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import BinaryIO

from energon_ordering.errors import SampleLengthError, show

__all__ = ["image_size"]

#: JPEG markers PIL reads a frame header from (SOF0-3, 5-7, 9-11, 13-15 and DHP).
_JPEG_SOF = frozenset({*range(0xC0, 0xC4), *range(0xC5, 0xC8), *range(0xC9, 0xCC), 0xCD, 0xCE, 0xCF, 0xDE})
#: JPEG markers without a length field (JPG, RSTn, SOI, EOI, JPGn), as PIL treats them.
_JPEG_STANDALONE = frozenset({0xC8, *range(0xD0, 0xDA), *range(0xF0, 0xFE)})
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_FIX = "re-encode the image, or skip such samples with --skip-bad-samples"


def _bad(fmt: str, problem: str) -> SampleLengthError:
    return SampleLengthError(f"image header: {fmt} {problem}; {_FIX}.")


class _Reader:
    """Exact reads and skips over a binary stream, the first bytes served from ``prefix``."""

    def __init__(self, stream: BinaryIO, prefix: bytes):
        self._stream = stream
        self._prefix = prefix
        self._seekable = stream.seekable() if hasattr(stream, "seekable") else False
        self.fmt = "image"
        self.offset = 0

    def take(self, n: int) -> bytes:
        data, self._prefix = self._prefix[:n], self._prefix[n:]
        if len(data) < n:
            data += self._stream.read(n - len(data))
        if len(data) != n:
            raise _bad(self.fmt, f"is truncated: {n} bytes wanted at offset {self.offset}, "
                                 f"{len(data)} left")
        self.offset += n
        return data

    def skip(self, n: int) -> None:
        if n > len(self._prefix) + 1 and self._seekable:
            n -= len(self.take(len(self._prefix)))
            self._stream.seek(n - 1, io.SEEK_CUR)
            self.offset += n - 1
            self.take(1)  # a skip past the end is a truncation, as a read is
            return
        while n > 0:
            n -= len(self.take(min(n, 1 << 16)))


def image_size(data: bytes | bytearray | memoryview | BinaryIO) -> tuple[int, int]:
    """``(width, height)`` in pixels of a JPEG, PNG, WebP or GIF, read from its header.

    Equal to ``PIL.Image.open(data).size`` (EXIF orientation not applied; see the module
    docstring). Nothing is decoded.

    Args:
        data: The encoded file, as bytes or a binary stream positioned at its start (read
            from there on; seekable streams are seeked past skipped segments).

    Raises:
        SampleLengthError: Not one of the four formats, or a truncated or corrupt header.
    """
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    head = stream.read(12)
    reader = _Reader(stream, head)
    if head.startswith(b"\xff\xd8\xff"):
        reader.fmt = "JPEG"
        return _jpeg(reader)
    if head.startswith(_PNG_SIGNATURE):
        reader.fmt = "PNG"
        return _png(reader)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        reader.fmt = "WebP"
        return _webp(reader)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        reader.fmt = "GIF"
        return _gif(reader)
    raise SampleLengthError(
        f"image header: not a JPEG, PNG, WebP or GIF (starts with {show(bytes(head))}); give "
        "one of these formats, or measure this image with the task encoder instead of a "
        "header-only length function."
    )


def _checked(fmt: str, width: int, height: int) -> tuple[int, int]:
    if width <= 0 or height <= 0:
        raise _bad(fmt, f"gives a size of {width}x{height} pixels")
    return width, height


def _jpeg(reader: _Reader) -> tuple[int, int]:
    """The last frame header before the first scan, as PIL's ``JpegImageFile._open`` reads it."""
    reader.take(2)  # SOI
    size: tuple[int, int] | None = None
    while True:
        if reader.take(1)[0] != 0xFF:
            continue  # junk between segments: PIL skips it
        marker = reader.take(1)[0]
        while marker == 0xFF:  # fill bytes
            marker = reader.take(1)[0]
        if marker == 0xD9:
            raise _bad("JPEG", "ends (EOI) before its first scan")
        if marker == 0x00 or marker in _JPEG_STANDALONE:
            continue
        if marker < 0xC0:
            raise _bad("JPEG", f"has an unknown marker 0xFF{marker:02X} before its first scan")
        (length,) = struct.unpack(">H", reader.take(2))
        if length < 2:
            raise _bad("JPEG", f"has a segment 0xFF{marker:02X} of length {length} (minimum 2)")
        if marker == 0xDA:  # start of scan: the frame header came before it
            if size is None:
                raise _bad("JPEG", "has no frame header (SOF) before its first scan")
            return _checked("JPEG", *size)
        if marker in _JPEG_SOF:
            segment = reader.take(length - 2)
            if len(segment) < 6:
                raise _bad("JPEG", f"has a frame header of {len(segment)} bytes (minimum 6)")
            height, width = struct.unpack_from(">HH", segment, 1)
            size = (width, height)
        else:
            reader.skip(length - 2)


def _png(reader: _Reader) -> tuple[int, int]:
    """The IHDR chunk, which the PNG specification puts first."""
    reader.take(8)  # signature
    chunk = reader.take(4 + 4 + 13 + 4)
    length, kind = struct.unpack_from(">I4s", chunk)
    if kind != b"IHDR" or length != 13:
        raise _bad("PNG", f"starts with chunk {show(kind)} of {length} bytes, not the 13-byte IHDR")
    if zlib.crc32(chunk[4:21]) != struct.unpack_from(">I", chunk, 21)[0]:
        raise _bad("PNG", "has an IHDR chunk whose CRC does not match (the header is corrupt)")
    width, height = struct.unpack_from(">II", chunk, 8)
    return _checked("PNG", width, height)


def _webp(reader: _Reader) -> tuple[int, int]:
    """The first chunk of the RIFF container: VP8, VP8L or VP8X."""
    reader.take(12)  # RIFF, size, WEBP
    kind, _size = struct.unpack("<4sI", reader.take(8))
    if kind == b"VP8 ":
        frame = reader.take(10)
        if frame[3:6] != b"\x9d\x01\x2a":
            raise _bad("WebP", f"has a VP8 frame without its start code ({show(frame[3:6])})")
        width, height = struct.unpack_from("<HH", frame, 6)
        return _checked("WebP", width & 0x3FFF, height & 0x3FFF)
    if kind == b"VP8L":
        frame = reader.take(5)
        (bits,) = struct.unpack_from("<I", frame, 1)
        if frame[0] != 0x2F or bits >> 29:
            raise _bad("WebP", "has a VP8L chunk with a bad signature or version")
        return _checked("WebP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if kind == b"VP8X":
        frame = reader.take(10)
        width = int.from_bytes(frame[4:7], "little") + 1
        height = int.from_bytes(frame[7:10], "little") + 1
        return _checked("WebP", width, height)
    raise _bad("WebP", f"starts with chunk {show(kind)}, not VP8, VP8L or VP8X")


def _gif(reader: _Reader) -> tuple[int, int]:
    """The logical screen, grown to the first frame's extent, as PIL's ``GifImageFile._seek(0)``."""
    width, height, flags = struct.unpack_from("<6xHHB", reader.take(13))
    if flags & 0x80:
        reader.skip(3 << ((flags & 7) + 1))  # global colour table
    while True:
        block = reader.take(1)
        if block == b",":  # the first frame's image descriptor
            x0, y0, w, h = struct.unpack("<HHHH", reader.take(8))
            return _checked("GIF", max(width, x0 + w), max(height, y0 + h))
        if block == b"!":  # an extension: a label, then data sub-blocks up to an empty one
            reader.take(1)
            while size := reader.take(1)[0]:
                reader.skip(size)
        elif block == b";":
            raise _bad("GIF", "has no frame (its trailer comes first)")
        else:
            raise _bad("GIF", f"has an unknown block {show(block)} before its first frame")
