"""How many tokens an image expands to in the common multimodal encoders, from its size alone.

Each encoder family is a frozen dataclass of the settings its image processor and model use,
with one pure method ``image_tokens(width, height) -> int``: the number of embeddings (sequence
positions) the language model sees for one image of ``width`` x ``height`` pixels, as the
image arrives at the processor (``PIL.Image.open(...).size``, which is what
:func:`~energon_ordering.length_index.image_header.image_size` reads without decoding). Sizes
are (width, height) in pixels, in that order, everywhere in this module. Text tokens (chat
template, image start/end markers written in the prompt) are not included unless a family's
docstring says so.

The rules are those of the transformers 4.57 implementations, reproduced with the same integer
and floating-point operations so that the counts are exact (the tests compare them with the
installed transformers functions and processors on many sizes, 0 mismatches):

- :class:`FixedImageTokens`: LLaVA-1.5 (and any encoder that resizes or pads to one square):
  the same count for every image, ``(image_size // patch_size) ** 2`` (576 for CLIP-L/14 at 336).
- :class:`LlavaNextTokens`: LLaVA-NeXT "anyres": the best grid pinpoint, its tiles' features
  with the padding removed, one newline per row, and the base image.
- :class:`InternVLTokens`: InternVL's dynamic tiles: the grid with the closest aspect ratio among
  ``min_tiles..max_tiles`` tiles, plus a thumbnail when there is more than one tile.
- :class:`Qwen2VLTokens`: Qwen2-VL / Qwen2.5-VL dynamic resolution: ``smart_resize`` to multiples
  of ``patch_size * merge_size`` within ``[min_pixels, max_pixels]``, one token per merged patch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from energon_ordering.errors import OrderingConfigError, SampleLengthError, show

__all__ = [
    "FixedImageTokens",
    "InternVLTokens",
    "LlavaNextTokens",
    "Qwen2VLTokens",
    "internvl_grid",
    "llava_next_best_resolution",
    "qwen2_vl_resize",
]


def _check_settings(owner: str, minimum: int = 1, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise OrderingConfigError(
                f"{owner}.{name} = {show(value)}: must be an integer >= {minimum}; give the "
                "value of the model's image processor / vision config."
            )


def _check_size(width: int, height: int) -> None:
    for name, value in (("width", width), ("height", height)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SampleLengthError(
                f"image {name} = {show(value)}: must be a positive integer number of pixels; "
                "pass the size image_size() read from the image (width, height)."
            )


@dataclass(frozen=True)
class FixedImageTokens:
    """Every image is resized (or padded and resized) to one square: a fixed token count.

    LLaVA-1.5 with CLIP ViT-L/14 at 336 px: ``(336 // 14) ** 2 = 576`` (the CLS feature is
    dropped by ``vision_feature_select_strategy="default"``), matching ``LlavaProcessor``'s
    expansion of ``<image>``.

    Args:
        tokens_per_image: Embeddings per image.
    """

    tokens_per_image: int = 576

    def __post_init__(self) -> None:
        _check_settings("FixedImageTokens", tokens_per_image=self.tokens_per_image)

    @classmethod
    def from_vision_tower(cls, image_size: int = 336, patch_size: int = 14) -> FixedImageTokens:
        """``(image_size // patch_size) ** 2`` tokens: a ViT's patch grid without its CLS."""
        _check_settings("FixedImageTokens", image_size=image_size, patch_size=patch_size)
        return cls((image_size // patch_size) ** 2)

    def image_tokens(self, width: int, height: int) -> int:
        """``tokens_per_image``, whatever the size (checked to be a real size)."""
        _check_size(width, height)
        return self.tokens_per_image


#: LLaVA-NeXT's (llava-v1.6) grid pinpoints, (height, width) pixels.
LLAVA_NEXT_PINPOINTS: tuple[tuple[int, int], ...] = (
    (336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def llava_next_best_resolution(
    width: int, height: int, pinpoints: tuple[tuple[int, int], ...]
) -> tuple[int, int]:
    """The pinpoint ``(height, width)`` LLaVA-NeXT resizes an image to.

    The one that keeps the most of the image's pixels when the image is scaled to fit inside
    it (``int`` of the scaled sides), ties broken by the least padded area; the first such in
    ``pinpoints`` order. transformers' ``image_processing_utils.select_best_resolution``.
    """
    best, best_effective, best_wasted = pinpoints[0], 0, math.inf
    for pin_h, pin_w in pinpoints:
        scale = min(pin_w / width, pin_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_w * pin_h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (pin_h, pin_w), effective, wasted
    return best


@dataclass(frozen=True)
class LlavaNextTokens:
    """LLaVA-NeXT "anyres" (``vision_feature_select_strategy="default"``, with newlines).

    The image is resized into the best pinpoint (:func:`llava_next_best_resolution`), cut into
    ``tile_size`` tiles of ``(tile_size // patch_size) ** 2`` features each; the features of the
    tile grid lose the rows (or columns) that are padding (``unpad_image``: the image scaled
    to the grid's feature width, ``int(round(x, 7))``, padding split evenly), and every
    remaining row gains one newline embedding. The base image (the whole image at
    ``tile_size``) adds its ``(tile_size // patch_size) ** 2`` features. Tokens:
    ``base + rows * cols + rows`` after unpadding. Matches ``LlavaNextModel.pack_image_features``
    and ``LlavaNextProcessor._get_number_of_features`` (minus the CLS).

    Args:
        grid_pinpoints: ``image_grid_pinpoints``: (height, width) pixels, multiples of
            ``tile_size``.
        tile_size: The vision tower's ``image_size`` (pixels).
        patch_size: The vision tower's ``patch_size`` (pixels).
    """

    grid_pinpoints: tuple[tuple[int, int], ...] = LLAVA_NEXT_PINPOINTS
    tile_size: int = 336
    patch_size: int = 14

    def __post_init__(self) -> None:
        _check_settings("LlavaNextTokens", tile_size=self.tile_size, patch_size=self.patch_size)
        pins = tuple(tuple(p) for p in self.grid_pinpoints)
        if not pins or any(len(p) != 2 or not all(isinstance(v, int) and v >= self.tile_size
                                                  and v % self.tile_size == 0 for v in p)
                           for p in pins):
            raise OrderingConfigError(
                f"LlavaNextTokens.grid_pinpoints = {show(self.grid_pinpoints)}: must be a "
                f"non-empty list of (height, width) pairs, each a multiple of tile_size="
                f"{self.tile_size}; give the model config's image_grid_pinpoints."
            )
        object.__setattr__(self, "grid_pinpoints", pins)

    def image_tokens(self, width: int, height: int) -> int:
        """Embeddings of one ``width`` x ``height`` image (see the class docstring)."""
        _check_size(width, height)
        side = self.tile_size // self.patch_size
        best_h, best_w = llava_next_best_resolution(width, height, self.grid_pinpoints)
        rows = best_h // self.tile_size * side
        cols = best_w // self.tile_size * side
        if width / height > cols / rows:
            new_rows = int(round(height * (cols / width), 7))
            rows -= (rows - new_rows) // 2 * 2
        else:
            new_cols = int(round(width * (rows / height), 7))
            cols -= (cols - new_cols) // 2 * 2
        return side * side + rows * cols + rows


def internvl_grid(
    width: int, height: int, tile_size: int, min_tiles: int, max_tiles: int
) -> tuple[int, int]:
    """``(columns, rows)`` of InternVL's tile grid for an image.

    Among the grids of ``min_tiles..max_tiles`` tiles (ordered by tile count, then columns),
    the one whose aspect ratio ``columns / rows`` is closest to ``width / height``; on a tie
    the later one, while the image's area exceeds half the grid's pixel area. transformers'
    ``got_ocr2.get_optimal_tiled_canvas`` (InternVL's ``find_closest_aspect_ratio``; the
    original iterates a set, so it may order the tied grids of one tile count differently).
    """
    grids = sorted(((c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
                    if min_tiles <= c * r <= max_tiles), key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), math.inf
    for cols, rows in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile_size * tile_size * cols * rows:
            best = (cols, rows)
    return best


@dataclass(frozen=True)
class InternVLTokens:
    """InternVL (1.5 - 3) dynamic tiles.

    The image is resized to the :func:`internvl_grid` of ``tile_size`` tiles; more than one
    tile adds a ``tile_size`` thumbnail of the whole image (``use_thumbnail``). Each tile is
    ``tokens_per_tile`` embeddings (``(tile_size / patch_size) ** 2 * downsample_ratio ** 2``,
    256 for 448 px, patch 14, ratio 0.5), and the placeholder is wrapped in ``<img>``
    ``</img>`` (``wrap_tokens``). Tokens: ``tiles * tokens_per_tile + wrap_tokens``, what
    ``InternVLProcessor`` writes into the prompt for one image (``crop_to_patches=True``).

    Args:
        tile_size: Tile side in pixels (``force_image_size``).
        min_tiles: ``min_dynamic_patch`` / ``min_patches``.
        max_tiles: ``max_dynamic_patch`` / ``max_patches``; 1 disables tiling.
        tokens_per_tile: Embeddings per tile (``image_seq_length``).
        use_thumbnail: Add the thumbnail tile when the grid has more than one tile.
        wrap_tokens: Start/end tokens around the image's embeddings (0 to count them as text).
    """

    tile_size: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    tokens_per_tile: int = 256
    use_thumbnail: bool = True
    wrap_tokens: int = 2

    def __post_init__(self) -> None:
        _check_settings("InternVLTokens", tile_size=self.tile_size, min_tiles=self.min_tiles,
                        max_tiles=self.max_tiles, tokens_per_tile=self.tokens_per_tile)
        _check_settings("InternVLTokens", minimum=0, wrap_tokens=self.wrap_tokens)
        if self.min_tiles > self.max_tiles:
            raise OrderingConfigError(
                f"InternVLTokens.min_tiles = {self.min_tiles} exceeds max_tiles = "
                f"{self.max_tiles}; give min_tiles <= max_tiles."
            )

    def tiles(self, width: int, height: int) -> int:
        """Tiles of one image, the thumbnail included."""
        _check_size(width, height)
        cols, rows = internvl_grid(width, height, self.tile_size, self.min_tiles, self.max_tiles)
        grid = cols * rows
        return grid + 1 if self.use_thumbnail and grid > 1 else grid

    def image_tokens(self, width: int, height: int) -> int:
        """``tiles * tokens_per_tile + wrap_tokens`` (see the class docstring)."""
        return self.tiles(width, height) * self.tokens_per_tile + self.wrap_tokens


#: The largest aspect ratio Qwen2-VL's ``smart_resize`` accepts.
QWEN2_VL_MAX_ASPECT = 200


def qwen2_vl_resize(
    width: int, height: int, factor: int = 28, min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """``(width, height)`` Qwen2-VL resizes an image to: transformers' ``smart_resize``.

    Each side rounded (half to even) to a multiple of ``factor``; if that exceeds
    ``max_pixels``, both sides scaled by ``sqrt(height * width / max_pixels)`` and floored to
    multiples of ``factor`` (at least ``factor``); if below ``min_pixels``, scaled up and
    ceiled. Raises :class:`SampleLengthError` for an aspect ratio over 200, which the processor
    refuses.
    """
    _check_size(width, height)
    if max(height, width) / min(height, width) > QWEN2_VL_MAX_ASPECT:
        raise SampleLengthError(
            f"image size {width}x{height}: aspect ratio {max(height, width) / min(height, width):.1f} "
            f"exceeds {QWEN2_VL_MAX_ASPECT}, which Qwen2-VL's image processor refuses; crop or "
            "pad such images before training, or skip them with --skip-bad-samples."
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return w_bar, h_bar


@dataclass(frozen=True)
class Qwen2VLTokens:
    """Qwen2-VL and Qwen2.5-VL dynamic resolution (one image, ``grid_t = 1``).

    The image is resized by :func:`qwen2_vl_resize` with ``factor = patch_size * merge_size``,
    cut into ``patch_size`` patches, and every ``merge_size x merge_size`` block of patches is
    merged into one token: ``(h / patch_size) * (w / patch_size) / merge_size ** 2``, the
    number of ``<|image_pad|>`` tokens of ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor``
    (``image_grid_thw.prod() // merge_size ** 2``). The ``<|vision_start|>`` /
    ``<|vision_end|>`` markers come from the prompt and are not counted.

    The defaults are ``Qwen2VLImageProcessor()``'s; Qwen2.5-VL's released
    ``preprocessor_config.json`` uses ``max_pixels=12845056``.

    Args:
        patch_size: Vision patch side in pixels.
        merge_size: Patches merged per side into one token.
        min_pixels: Smallest resized area in pixels (``size["shortest_edge"]``).
        max_pixels: Largest resized area in pixels (``size["longest_edge"]``).
    """

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def __post_init__(self) -> None:
        _check_settings("Qwen2VLTokens", patch_size=self.patch_size, merge_size=self.merge_size,
                        min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        if self.min_pixels > self.max_pixels:
            raise OrderingConfigError(
                f"Qwen2VLTokens.min_pixels = {self.min_pixels} exceeds max_pixels = "
                f"{self.max_pixels}; give min_pixels <= max_pixels."
            )

    def image_tokens(self, width: int, height: int) -> int:
        """Merged patch tokens of one ``width`` x ``height`` image (see the class docstring)."""
        factor = self.patch_size * self.merge_size
        w_bar, h_bar = qwen2_vl_resize(width, height, factor, self.min_pixels, self.max_pixels)
        return (h_bar // self.patch_size) * (w_bar // self.patch_size) // self.merge_size ** 2
