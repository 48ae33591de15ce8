"""Header-only length functions for ``energon-ordering index --raw-length-fn MODULE:FUNCTION``.

A raw length function receives a webdataset sample's still-compressed files
(``{"__key__": ..., "jpg": b"...", "txt": b"..."}``, see
:func:`~energon_ordering.length_index.build.build_length_index`) and returns its length in
tokens. The ones here read every image's size from its header
(:func:`~energon_ordering.length_index.image_header.image_size`: no pixel decoded), count the
tokens each image expands to with a :mod:`~energon_ordering.length_index.media_tokens` rule, and
add the caption's whitespace tokens::

    energon-ordering index DATASET \\
        --raw-length-fn energon_ordering.length_index.header_length:qwen2_vl_caption_length

The text count is the synthetic datasets' (whitespace tokens of the ``txt`` part); for a real
tokenizer write your own three-line function over :func:`header_length`, e.g.
``header_length(raw, Qwen2VLTokens(max_pixels=...), text_tokens=lambda t: len(tok(t).input_ids))``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from energon_ordering.errors import SampleLengthError, show
from energon_ordering.length_index.image_header import image_size
from energon_ordering.length_index.media_tokens import (
    FixedImageTokens,
    InternVLTokens,
    LlavaNextTokens,
    Qwen2VLTokens,
)

__all__ = [
    "IMAGE_PARTS",
    "header_length",
    "internvl_caption_length",
    "llava_caption_length",
    "llava_next_caption_length",
    "qwen2_vl_caption_length",
    "raw_image_sizes",
]

#: File extensions of a sample's parts read as images (``jpg``, ``0.png``, ``image.webp``, ...).
IMAGE_PARTS = ("jpg", "jpeg", "png", "webp", "gif")


class ImageTokens(Protocol):
    """A media token rule: tokens of one ``width`` x ``height`` image."""

    def image_tokens(self, width: int, height: int) -> int: ...


def raw_image_sizes(raw: Mapping[str, Any]) -> list[tuple[int, int]]:
    """``(width, height)`` of every image part of a raw sample, in part-name order."""
    return [image_size(data) for part, data in sorted(raw.items())
            if not part.startswith("__") and part.rsplit(".", 1)[-1].lower() in IMAGE_PARTS]


def _whitespace_tokens(text: str) -> int:
    return len(text.split())


def header_length(
    raw: Mapping[str, Any],
    media: ImageTokens,
    *,
    text_part: str = "txt",
    text_tokens: Callable[[str], int] = _whitespace_tokens,
) -> int:
    """Tokens of a raw sample: its images' tokens under ``media`` plus ``text_tokens`` of its
    ``text_part`` (UTF-8).

    Raises:
        SampleLengthError: The sample has no ``text_part``, it is not UTF-8, or an image header
            is unreadable.
    """
    if text_part not in raw:
        raise SampleLengthError(
            f"header length: sample {show(raw.get('__key__'))} has no part {show(text_part)} "
            f"(it has {show(sorted(k for k in raw if not k.startswith('__')))}); pass the caption's "
            "extension as text_part."
        )
    text = raw[text_part]
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise SampleLengthError(
                f"header length: part {show(text_part)} of sample {show(raw.get('__key__'))} is "
                f"not UTF-8 ({e}); re-encode the caption as UTF-8."
            ) from None
    images = sum(media.image_tokens(w, h) for w, h in raw_image_sizes(raw))
    return images + text_tokens(text)


_LLAVA, _LLAVA_NEXT, _INTERNVL, _QWEN2_VL = (
    FixedImageTokens(), LlavaNextTokens(), InternVLTokens(), Qwen2VLTokens())


def llava_caption_length(raw: Mapping[str, Any]) -> int:
    """LLaVA-1.5 (576 tokens per image) + whitespace tokens of ``txt``."""
    return header_length(raw, _LLAVA)


def llava_next_caption_length(raw: Mapping[str, Any]) -> int:
    """LLaVA-NeXT anyres (llava-v1.6 pinpoints, 336 px CLIP-L/14) + whitespace tokens of ``txt``."""
    return header_length(raw, _LLAVA_NEXT)


def internvl_caption_length(raw: Mapping[str, Any]) -> int:
    """InternVL dynamic tiles (448 px, 1-12 tiles, thumbnail) + whitespace tokens of ``txt``."""
    return header_length(raw, _INTERNVL)


def qwen2_vl_caption_length(raw: Mapping[str, Any]) -> int:
    """Qwen2-VL dynamic resolution (``Qwen2VLImageProcessor()`` defaults) + whitespace tokens
    of ``txt``."""
    return header_length(raw, _QWEN2_VL)
