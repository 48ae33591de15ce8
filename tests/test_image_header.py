"""Header-only image sizes (length_index/image_header.py) against what PIL reports on open.

Every case encodes a real image with PIL (or writes the bytes a PIL-readable file holds where PIL
cannot write the variant: interlaced PNG, a GIF frame past its screen) and compares
``image_size`` with ``Image.open(...).size``, on bytes and on streams; the error cases check
that a truncated or damaged header raises ``SampleLengthError`` and nothing else.
"""

from __future__ import annotations

import io
import random
import struct
import zlib
from collections.abc import Callable

import pytest
from PIL import Image

from energon_ordering.errors import SampleLengthError
from energon_ordering.length_index.image_header import image_size

RNG_SEED = 1234
EDGE_SIZES = [(1, 1), (1, 7), (7, 1), (2, 3), (15, 17), (255, 257), (641, 479), (4000, 3000)]


def _random_sizes(count: int, seed: int, limit: int = 900) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(1, limit), rng.randint(1, limit)) for _ in range(count)]


def _image(size: tuple[int, int], mode: str) -> Image.Image:
    color = {"RGB": (200, 30, 60), "RGBA": (200, 30, 60, 128), "CMYK": (1, 2, 3, 4), "L": 77,
             "P": 3, "I;16": 1000}[mode]
    return Image.new(mode, size, color)


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _interlaced_png(width: int, height: int) -> bytes:
    """An Adam7-interlaced 8-bit grey PNG (PIL reads these but does not write them)."""
    passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2),
              (0, 1, 1, 2)]
    raw = bytearray()
    for x0, y0, dx, dy in passes:
        cols, rows = len(range(x0, width, dx)), len(range(y0, height, dy))
        if cols and rows:
            raw += (b"\x00" + bytes([9]) * cols) * rows

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 1)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(raw)))
            + chunk(b"IEND", b""))


def _jpeg_exif_rotated(size: tuple[int, int]) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees on display
    return _encode(_image(size, "RGB"), "JPEG", exif=exif)


def _jpeg_big_app_segments(size: tuple[int, int]) -> bytes:
    """A JPEG with a 60 KiB ICC profile (APP2) and a 50 KiB comment before its frame header."""
    rng = random.Random(7)
    icc = bytes(rng.getrandbits(8) for _ in range(60_000))
    return _encode(_image(size, "RGB"), "JPEG", icc_profile=icc, comment=b"c" * 50_000)


def _animated(fmt: str, size: tuple[int, int]) -> bytes:
    frames = [_image(size, "RGB"), Image.new("RGB", size, (0, 255, 0)), Image.new("RGB", size, 5)]
    return _encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, loop=0)


def _gif_frame_past_screen(size: tuple[int, int]) -> bytes:
    """A GIF whose first frame reaches past its logical screen (PIL grows the size to it)."""
    data = bytearray(_encode(_image(size, "P"), "GIF"))
    struct.pack_into("<HH", data, 6, max(size[0] // 2, 1), max(size[1] // 3, 1))
    return bytes(data)


def _webp_scaled(size: tuple[int, int]) -> bytes:
    """A lossy WebP whose VP8 size fields carry the (ignored) upscaling bits."""
    data = bytearray(_encode(_image(size, "RGB"), "WEBP"))
    data[27] |= 0x40
    data[29] |= 0xC0
    return bytes(data)


#: variant name -> (encoder of a size, the sizes it is checked on)
VARIANTS: dict[str, tuple[Callable[[tuple[int, int]], bytes], list[tuple[int, int]]]] = {
    "jpeg": (lambda s: _encode(_image(s, "RGB"), "JPEG"), EDGE_SIZES + _random_sizes(40, 1)),
    "jpeg-progressive": (lambda s: _encode(_image(s, "RGB"), "JPEG", progressive=True),
                         EDGE_SIZES + _random_sizes(20, 2)),
    "jpeg-cmyk": (lambda s: _encode(_image(s, "CMYK"), "JPEG"), EDGE_SIZES[:-1] + _random_sizes(10, 3)),
    "jpeg-grey": (lambda s: _encode(_image(s, "L"), "JPEG"), _random_sizes(10, 4)),
    "jpeg-exif-orientation": (_jpeg_exif_rotated, [(640, 480), (3, 5)] + _random_sizes(5, 5)),
    "jpeg-big-app-segments": (_jpeg_big_app_segments, [(1, 1), (333, 222)]),
    "png": (lambda s: _encode(_image(s, "RGB"), "PNG"), EDGE_SIZES + _random_sizes(30, 6)),
    "png-rgba": (lambda s: _encode(_image(s, "RGBA"), "PNG"), _random_sizes(10, 7)),
    "png-palette": (lambda s: _encode(_image(s, "P"), "PNG"), _random_sizes(10, 8)),
    "png-16bit": (lambda s: _encode(_image(s, "I;16"), "PNG"), _random_sizes(5, 9)),
    "png-interlaced": (lambda s: _interlaced_png(*s), [(1, 1), (3, 2), (9, 9)] + _random_sizes(10, 10, 300)),
    "png-animated": (lambda s: _animated("PNG", s), [(1, 1), (31, 17)]),
    "webp-lossy": (lambda s: _encode(_image(s, "RGB"), "WEBP"), EDGE_SIZES + _random_sizes(20, 11)),
    "webp-scale-bits": (_webp_scaled, [(1, 1), (37, 23), (1000, 999)]),
    "webp-lossless": (lambda s: _encode(_image(s, "RGB"), "WEBP", lossless=True),
                      EDGE_SIZES + _random_sizes(20, 12)),
    "webp-alpha": (lambda s: _encode(_image(s, "RGBA"), "WEBP"), EDGE_SIZES[:-1] + _random_sizes(10, 13)),
    "webp-animated": (lambda s: _animated("WEBP", s), [(1, 1), (31, 17), (400, 300)]),
    "gif": (lambda s: _encode(_image(s, "P"), "GIF"), EDGE_SIZES + _random_sizes(20, 14)),
    "gif-animated": (lambda s: _animated("GIF", s), [(1, 1), (31, 17), (400, 300)]),
    "gif-frame-past-screen": (_gif_frame_past_screen, [(2, 3), (31, 17), (400, 300)]),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_image_size_is_what_pil_reports(variant: str) -> None:
    encode, sizes = VARIANTS[variant]
    for size in sizes:
        data = encode(size)
        expected = Image.open(io.BytesIO(data)).size
        assert image_size(data) == expected, (variant, size)
        assert image_size(io.BytesIO(data)) == expected, (variant, size)
        assert image_size(memoryview(data)) == expected, (variant, size)


def test_exif_orientation_is_not_applied() -> None:
    """PIL's size (and an encoder's ``convert("RGB")``) ignores EXIF orientation, so do we."""
    data = _jpeg_exif_rotated((640, 480))
    assert Image.open(io.BytesIO(data)).getexif()[0x0112] == 6
    assert image_size(data) == (640, 480)


def test_variants_cover_every_webp_chunk_and_jpeg_frame_kind() -> None:
    """The generated files really are the kinds the cases are named after."""
    assert _encode(_image((5, 5), "RGB"), "WEBP")[12:16] == b"VP8 "
    assert _encode(_image((5, 5), "RGB"), "WEBP", lossless=True)[12:16] == b"VP8L"
    assert _encode(_image((5, 5), "RGBA"), "WEBP")[12:16] == b"VP8X"
    assert b"\xff\xc2" in _encode(_image((64, 64), "RGB"), "JPEG", progressive=True)
    assert Image.open(io.BytesIO(_encode(_image((5, 5), "CMYK"), "JPEG"))).mode == "CMYK"
    assert Image.open(io.BytesIO(_interlaced_png(9, 9))).info.get("interlace") == 1
    assert Image.open(io.BytesIO(_interlaced_png(9, 9))).convert("L").getpixel((8, 8)) == 9
    assert Image.open(io.BytesIO(_animated("GIF", (4, 4)))).n_frames == 3


class _CountingStream(io.RawIOBase):
    """A stream that counts the bytes read from it; seekable or not."""

    def __init__(self, data: bytes, seekable: bool):
        self._inner = io.BytesIO(data)
        self._seekable = seekable
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._seekable

    def read(self, n: int = -1) -> bytes:
        data = self._inner.read(n)
        self.bytes_read += len(data)
        return data

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if not self._seekable:
            raise io.UnsupportedOperation("seek")
        return self._inner.seek(offset, whence)


def test_a_seekable_stream_is_read_only_at_the_header_fields() -> None:
    data = _jpeg_big_app_segments((333, 222))
    assert len(data) > 110_000
    stream = _CountingStream(data, seekable=True)
    assert image_size(stream) == (333, 222)
    assert stream.bytes_read < 1024  # the 60 KiB ICC profile and the comment were seeked past
    unseekable = _CountingStream(data, seekable=False)
    assert image_size(unseekable) == (333, 222)
    big = _encode(_image((4000, 3000), "RGB"), "PNG")
    for fmt_data in (big, _encode(_image((4000, 3000), "RGB"), "WEBP", lossless=True)):
        stream = _CountingStream(fmt_data, seekable=False)
        image_size(stream)
        assert stream.bytes_read <= 64


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "not a JPEG, PNG, WebP or GIF"),
        (b"BM" + bytes(60), r"not a JPEG, PNG, WebP or GIF \(starts with b'BM"),
        (b"\xff\xd8\xff\xd9" + bytes(10), "JPEG ends \\(EOI\\) before its first scan"),
        (b"\xff\xd8\xff\xda\x00\x08" + bytes(10), "JPEG has no frame header \\(SOF\\)"),
        (b"\xff\xd8\xff\xc0\x00\x01" + bytes(10), "JPEG has a segment 0xFFC0 of length 1"),
        (b"\xff\xd8\xff\x42\x00\x08" + bytes(10), "JPEG has an unknown marker 0xFF42"),
        (b"GIF89a\x05\x00\x05\x00\x00\x00\x00;", "GIF has no frame"),
        (b"GIF89a\x05\x00\x05\x00\x00\x00\x00?", "GIF has an unknown block b'\\?'"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8Q" + bytes(20), "WebP starts with chunk b'VP8Q'"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 " + bytes(20), "WebP has a VP8 frame without its start code"),
    ],
)
def test_bad_headers_raise_a_typed_error_naming_the_problem(data: bytes, match: str) -> None:
    with pytest.raises(SampleLengthError, match=match):
        image_size(data)


def test_png_header_damage_is_caught_by_its_crc() -> None:
    data = bytearray(_encode(_image((10, 10), "RGB"), "PNG"))
    data[18] ^= 0x01  # a bit of the width
    with pytest.raises(SampleLengthError, match="PNG has an IHDR chunk whose CRC does not match"):
        image_size(bytes(data))


def test_zero_sized_header_is_refused() -> None:
    data = bytearray(_encode(_image((10, 10), "P"), "GIF"))
    struct.pack_into("<HH", data, 6, 0, 0)
    struct.pack_into("<HH", data, data.index(b",") + 5, 0, 0)
    with pytest.raises(SampleLengthError, match="GIF gives a size of 0x0 pixels"):
        image_size(bytes(data))


@pytest.mark.parametrize("variant", ["jpeg-progressive", "jpeg-cmyk", "png", "webp-lossy",
                                     "webp-lossless", "webp-alpha", "gif-animated"])
def test_truncated_or_damaged_headers_raise_only_the_typed_error(variant: str) -> None:
    """Every prefix of the header region, and random byte damage in it, gives a size or a
    SampleLengthError: never an IndexError, struct.error or a hang."""
    data = VARIANTS[variant][0]((37, 23))
    header = min(len(data), 700)
    needed = None  # the shortest prefix that holds the size: every longer one gives it too
    for cut in range(header):
        try:
            assert image_size(data[:cut]) == (37, 23)
            needed = cut if needed is None else needed
        except SampleLengthError as e:
            assert needed is None, f"prefix {cut} failed after prefix {needed} succeeded: {e}"
    assert needed is not None and needed <= 700
    rng = random.Random(RNG_SEED)
    for _ in range(300):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(header)] = rng.getrandbits(8)
        try:
            width, height = image_size(bytes(damaged))
        except SampleLengthError:
            continue
        assert width > 0 and height > 0
