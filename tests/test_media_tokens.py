"""Media token counts (length_index/media_tokens.py) against transformers' own implementations.

Two levels of reference, both from the installed transformers (no weights, no network):

- the pure functions and processor formulas (``select_best_resolution``, ``smart_resize``,
  ``get_optimal_tiled_canvas``, ``LlavaNextProcessor._get_number_of_features``,
  ``InternVLProcessor._get_num_multimodal_tokens``) on thousands of random sizes;
- the real image processors on real PIL images (``Qwen2VLImageProcessor()``,
  ``GotOcr2ImageProcessor``, ``LlavaNextImageProcessor``, ``CLIPImageProcessor``), and for
  LLaVA-NeXT the model's own ``pack_image_features`` on zero features of the processor's output
  shape: what the language model really receives.

Exact equality is the target everywhere: every test allows 0 mismatches.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
from PIL import Image

from energon_ordering.errors import OrderingConfigError, SampleLengthError
from energon_ordering.length_index.media_tokens import (
    LLAVA_NEXT_PINPOINTS,
    FixedImageTokens,
    InternVLTokens,
    LlavaNextTokens,
    Qwen2VLTokens,
    internvl_grid,
    llava_next_best_resolution,
    qwen2_vl_resize,
)


@pytest.fixture(scope="module")
def transformers():
    """transformers, importable beside the CPU build of torch (see torchvision_cpu_shim)."""
    pytest.importorskip("torch")
    import torchvision_cpu_shim

    torchvision_cpu_shim.install()
    return pytest.importorskip("transformers")


def _sizes(count: int, seed: int, limit: int, extreme: bool = True) -> list[tuple[int, int]]:
    """Random (width, height): uniform, plus thin strips and tiny images when ``extreme``."""
    rng = random.Random(seed)
    sizes = [(rng.randint(1, limit), rng.randint(1, limit)) for _ in range(count)]
    if extreme:
        sizes += [(rng.randint(1, 9), rng.randint(1, limit)) for _ in range(count // 10)]
        sizes += [(rng.randint(1, limit), rng.randint(1, 9)) for _ in range(count // 10)]
    return sizes + [(1, 1), (1, 2), (2, 1), (336, 336), (448, 448), (4000, 3000), (3000, 4000)]


def _random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


# --- LLaVA-1.5 -------------------------------------------------------------------------------


def test_fixed_tokens_match_llava_1_5_processor_expansion(transformers) -> None:
    """LlavaProcessor expands ``<image>`` to (crop // patch)**2 (+1 CLS, -1 "default")
    tokens of the CLIP processor's output, whatever the input size."""
    from transformers import CLIPImageProcessor
    from transformers.models.llava.processing_llava import LlavaProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    fake = types.SimpleNamespace(patch_size=14, num_additional_image_tokens=1,
                                 vision_feature_select_strategy="default", image_processor=processor)
    fixed = FixedImageTokens.from_vision_tower(336, 14)
    assert fixed == FixedImageTokens(576)
    for width, height in [(1, 1), (17, 900), (1024, 768), (336, 336)]:
        pixels = processor(_random_image(width, height, 0), return_tensors="np", input_data_format="channels_last")["pixel_values"]
        expected = LlavaProcessor._get_num_multimodal_tokens(
            fake, image_sizes=[pixels.shape[-2:]])["num_image_tokens"][0]
        assert fixed.image_tokens(width, height) == expected == 576


# --- LLaVA-NeXT ------------------------------------------------------------------------------

#: (tile_size, patch_size, pinpoints (height, width)) of the checked configurations
PINPOINT_SETS = {
    "llava-v1.6": (336, 14, LLAVA_NEXT_PINPOINTS),
    "anyres-3x3-siglip384": (384, 14, tuple((r * 384, c * 384) for r in range(1, 4) for c in range(1, 4))),
    "one-pin": (336, 14, ((672, 1008),)),
    "clip224-wide": (224, 14, ((224, 448), (448, 224), (224, 1344), (1344, 224), (448, 448), (896, 672))),
    "random-336": (336, 14, tuple((336 * random.Random(i).randint(1, 4), 336 * random.Random(-i).randint(1, 4))
                                  for i in range(7))),
}


def _model_token_count(transformers, config: LlavaNextTokens, width: int, height: int,
                       num_patches: int | None = None) -> int:
    """``LlavaNextModel.pack_image_features`` on zero features of the right shape: the number
    of embeddings the language model receives for the image (CLS already dropped)."""
    import torch
    from transformers.models.llava_next.modeling_llava_next import (
        LlavaNextModel,
        image_size_to_num_patches,
    )

    pins = [list(p) for p in config.grid_pinpoints]
    side = config.tile_size // config.patch_size
    if num_patches is None:
        num_patches = image_size_to_num_patches((height, width), pins, config.tile_size)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(
        vision_config=types.SimpleNamespace(image_size=config.tile_size, patch_size=config.patch_size),
        image_grid_pinpoints=pins))
    _, lengths = LlavaNextModel.pack_image_features(
        fake, [torch.zeros(num_patches, side * side, 1)], torch.tensor([[height, width]]), "default",
        torch.zeros(1))
    return int(lengths[0])


def _processor_token_count(transformers, config: LlavaNextTokens, width: int, height: int) -> int:
    """``LlavaNextProcessor._get_number_of_features`` minus the CLS ("default" strategy)."""
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    fake = types.SimpleNamespace(
        image_processor=types.SimpleNamespace(image_grid_pinpoints=[list(p) for p in config.grid_pinpoints]),
        patch_size=config.patch_size, num_additional_image_tokens=1)
    fake._get_unpadded_features = lambda *a: LlavaNextProcessor._get_unpadded_features(fake, *a)
    return LlavaNextProcessor._get_number_of_features(
        fake, height, width, config.tile_size, config.tile_size) - 1


@pytest.mark.parametrize("pinpoint_set", list(PINPOINT_SETS))
def test_llava_next_tokens_match_the_model_and_the_processor(transformers, pinpoint_set: str) -> None:
    from transformers.image_processing_utils import select_best_resolution

    tile, patch, pins = PINPOINT_SETS[pinpoint_set]
    config = LlavaNextTokens(grid_pinpoints=pins, tile_size=tile, patch_size=patch)
    mismatches = []
    for width, height in _sizes(250, seed=len(pinpoint_set), limit=4000):
        assert llava_next_best_resolution(width, height, config.grid_pinpoints) == tuple(
            select_best_resolution((height, width), [list(p) for p in pins]))
        ours = config.image_tokens(width, height)
        model = _model_token_count(transformers, config, width, height)
        processor = _processor_token_count(transformers, config, width, height)
        if not ours == model == processor:
            mismatches.append(((width, height), ours, model, processor))
    assert mismatches == []


def test_llava_next_tokens_through_the_real_image_processor(transformers) -> None:
    """The real processor's patches and image_sizes, packed by the model, on real images."""
    from transformers import LlavaNextImageProcessor

    config = LlavaNextTokens()
    processor = LlavaNextImageProcessor(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
        image_grid_pinpoints=[list(p) for p in config.grid_pinpoints])
    for i, (width, height) in enumerate(_sizes(6, seed=5, limit=1400, extreme=False)[:10]):
        out = processor(_random_image(width, height, i), return_tensors="np", input_data_format="channels_last")
        num_patches = out["pixel_values"].shape[1]
        assert tuple(out["image_sizes"][0]) == (height, width)
        model = _model_token_count(transformers, config, width, height, num_patches=num_patches)
        assert config.image_tokens(width, height) == model, (width, height)


# --- InternVL --------------------------------------------------------------------------------

INTERNVL_SETTINGS = [(448, 1, 12), (448, 1, 6), (448, 2, 12), (448, 1, 1), (448, 1, 40), (224, 3, 9)]


@pytest.mark.parametrize("tile, min_tiles, max_tiles", INTERNVL_SETTINGS)
def test_internvl_tokens_match_the_processor(transformers, tile: int, min_tiles: int, max_tiles: int) -> None:
    from transformers import GotOcr2ImageProcessor
    from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    config = InternVLTokens(tile_size=tile, min_tiles=min_tiles, max_tiles=max_tiles)
    fake = types.SimpleNamespace(image_processor=GotOcr2ImageProcessor(size={"height": tile, "width": tile}),
                                 image_seq_length=256)
    mismatches = []
    for width, height in _sizes(1500, seed=max_tiles, limit=5000):
        if max_tiles > 1:
            assert internvl_grid(width, height, tile, min_tiles, max_tiles) == get_optimal_tiled_canvas(
                (height, width), (tile, tile), min_tiles, max_tiles)
        expected = InternVLProcessor._get_num_multimodal_tokens(
            fake, image_sizes=[(height, width)], min_patches=min_tiles,
            max_patches=max_tiles)["num_image_tokens"][0]
        if config.image_tokens(width, height) != expected:
            mismatches.append(((width, height), config.image_tokens(width, height), expected))
    assert mismatches == []


def test_internvl_tiles_through_the_real_image_processor(transformers) -> None:
    from transformers import GotOcr2ImageProcessor

    config = InternVLTokens(max_tiles=6)
    processor = GotOcr2ImageProcessor(size={"height": 448, "width": 448}, crop_to_patches=True,
                                      min_patches=1, max_patches=6)
    sizes = [(1, 1), (448, 448), (900, 300), (300, 900), (1280, 720), (2000, 2000), (3, 200), (1001, 999)]
    for i, (width, height) in enumerate(sizes):
        out = processor(_random_image(width, height, i), return_tensors="np", input_data_format="channels_last")
        assert config.tiles(width, height) == int(out["num_patches"][0]) == out["pixel_values"].shape[0]


# --- Qwen2-VL / Qwen2.5-VL -------------------------------------------------------------------

QWEN_SETTINGS = {
    "qwen2-vl-default": Qwen2VLTokens(),
    "qwen2.5-vl-release": Qwen2VLTokens(max_pixels=12845056),
    "small-budget": Qwen2VLTokens(min_pixels=256 * 28 * 28, max_pixels=1280 * 28 * 28),
    "merge-1-patch-16": Qwen2VLTokens(patch_size=16, merge_size=1, min_pixels=32 * 32, max_pixels=512 * 512),
}


@pytest.mark.parametrize("setting", list(QWEN_SETTINGS))
def test_qwen2_vl_tokens_match_smart_resize(transformers, setting: str) -> None:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    config = QWEN_SETTINGS[setting]
    factor = config.patch_size * config.merge_size
    mismatches = []
    for width, height in _sizes(5000, seed=len(setting), limit=9000):
        if max(width, height) / min(width, height) > 200:
            with pytest.raises(SampleLengthError, match="aspect ratio .* exceeds 200"):
                config.image_tokens(width, height)
            continue
        h_bar, w_bar = smart_resize(height, width, factor, config.min_pixels, config.max_pixels)
        expected = (h_bar // config.patch_size) * (w_bar // config.patch_size) // config.merge_size ** 2
        assert qwen2_vl_resize(width, height, factor, config.min_pixels, config.max_pixels) == (w_bar, h_bar)
        if config.image_tokens(width, height) != expected:
            mismatches.append(((width, height), config.image_tokens(width, height), expected))
    assert mismatches == []


def test_qwen2_vl_tokens_through_the_real_image_processor(transformers) -> None:
    """``Qwen2VLImageProcessor()`` (offline, default config) on real images: the product of
    ``image_grid_thw`` over merge_size**2 is the number of ``<|image_pad|>`` tokens."""
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor()
    config = Qwen2VLTokens()
    assert (config.patch_size, config.merge_size, config.min_pixels, config.max_pixels) == (
        processor.patch_size, processor.merge_size, processor.min_pixels, processor.max_pixels)
    sizes = [(1, 1), (28, 28), (27, 29), (56, 57), (200, 3), (640, 480), (1280, 720), (1001, 1999)]
    sizes += _sizes(12, seed=3, limit=1200, extreme=False)[:12]
    for i, (width, height) in enumerate(sizes):
        grid = processor(images=_random_image(width, height, i), return_tensors="np", input_data_format="channels_last")["image_grid_thw"][0]
        assert config.image_tokens(width, height) == int(np.prod(grid)) // processor.merge_size ** 2, (width, height)


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FixedImageTokens(0), r"FixedImageTokens.tokens_per_image = 0: must be an integer >= 1"),
        (lambda: LlavaNextTokens(grid_pinpoints=((336, 500),)), r"LlavaNextTokens.grid_pinpoints = .*multiple of tile_size=336"),
        (lambda: LlavaNextTokens(grid_pinpoints=()), r"LlavaNextTokens.grid_pinpoints = \(\): must be a non-empty"),
        (lambda: LlavaNextTokens(patch_size=-14), r"LlavaNextTokens.patch_size = -14"),
        (lambda: InternVLTokens(min_tiles=7, max_tiles=6), r"InternVLTokens.min_tiles = 7 exceeds max_tiles = 6"),
        (lambda: InternVLTokens(wrap_tokens=-1), r"InternVLTokens.wrap_tokens = -1: must be an integer >= 0"),
        (lambda: Qwen2VLTokens(min_pixels=10, max_pixels=5), r"Qwen2VLTokens.min_pixels = 10 exceeds max_pixels = 5"),
        (lambda: Qwen2VLTokens(merge_size=2.0), r"Qwen2VLTokens.merge_size = 2.0"),
    ],
)
def test_bad_settings_are_refused_at_construction(build, match: str) -> None:
    with pytest.raises(OrderingConfigError, match=match):
        build()


@pytest.mark.parametrize("config", [FixedImageTokens(), LlavaNextTokens(), InternVLTokens(), Qwen2VLTokens()])
@pytest.mark.parametrize("size", [(0, 5), (5, -1), (2.5, 4), (True, 3)])
def test_bad_image_sizes_are_refused(config, size) -> None:
    with pytest.raises(SampleLengthError, match=r"image (width|height) = .*: must be a positive integer"):
        config.image_tokens(*size)
