#!/usr/bin/env python
"""Benchmark of header-only image sizes against decoding, every figure measured in this run.

For each image set (encoded in memory with PIL, seeded), times per image, on one core:

- ``image_size(data)`` (energon_ordering.length_index.image_header: header only);
- ``PIL.Image.open(data).size`` (PIL's lazy open: also header only, for reference);
- ``PIL.Image.open(data).convert("RGB")`` (the full decode an encoder does);
- the header-only Qwen2-VL length (``image_size`` + ``Qwen2VLTokens.image_tokens``) against
  the encoder path's size step (decode + ``Qwen2VLImageProcessor``), when transformers imports.

and checks that ``image_size`` equals PIL's size on every image. Sets: photo-like 448 x 448
JPEGs (LLaVA-like data), mixed-size JPEGs 64..2048 px (Qwen-VL-like data), mixed PNG, WebP
(lossy and lossless) and GIF.

Usage:
    python tools/bench_image_header.py            # 200 images per set
    python tools/bench_image_header.py --quick    # 30 images per set
"""

from __future__ import annotations

import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np
from PIL import Image

from _bench_common import begin, check, finish

from energon_ordering.length_index.image_header import image_size
from energon_ordering.length_index.media_tokens import Qwen2VLTokens


def _photo(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """Gradients plus mild noise: compresses to a photo-like size (tens of kB at 448 px)."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1),
                     np.full_like(x, int(rng.integers(0, 256)))], axis=-1)
    noise = rng.integers(0, 24, size=base.shape)
    return Image.fromarray(((base + noise) % 256).astype(np.uint8), "RGB")


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _image_sets(count: int) -> dict[str, list[bytes]]:
    rng = np.random.default_rng(0)

    def mixed(fmt: str, lo: int = 64, hi: int = 2048, **options) -> list[bytes]:
        return [_encode(_photo(int(rng.integers(lo, hi)), int(rng.integers(lo, hi)), rng), fmt, **options)
                for _ in range(count)]

    return {
        "jpeg 448x448 (LLaVA-like)": [_encode(_photo(448, 448, rng), "JPEG", quality=90) for _ in range(count)],
        "jpeg mixed 64..2048 (Qwen-VL-like)": mixed("JPEG", quality=90),
        "jpeg progressive mixed": mixed("JPEG", quality=90, progressive=True),
        "png mixed 64..1024": mixed("PNG", hi=1024),
        "webp lossy mixed 64..1024": mixed("WEBP", hi=1024),
        "webp lossless mixed 64..512": mixed("WEBP", hi=512, lossless=True),
        "gif mixed 64..512": mixed("GIF", hi=512),
    }


def _per_image_us(fn: Callable[[bytes], object], images: list[bytes],
                  repeat: int) -> tuple[float, float]:
    """Median over ``repeat`` passes of the mean microseconds per image: ``(wall, CPU)`` (CPU:
    this process's, which other processes on a shared machine cannot inflate)."""
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        for data in images:
            fn(data)
        wall.append((time.perf_counter() - t0) / len(images) * 1e6)
        cpu.append((time.process_time() - c0) / len(images) * 1e6)
    return statistics.median(wall), statistics.median(cpu)


def _qwen_encoder_path() -> Callable[[bytes], int] | None:
    """Decode + the real Qwen2-VL image processor's token count, if transformers imports."""
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        import torchvision_cpu_shim

        torchvision_cpu_shim.install()
        from transformers import Qwen2VLImageProcessor
    except Exception:  # noqa: BLE001 - optional comparison
        return None
    processor = Qwen2VLImageProcessor()

    def tokens(data: bytes) -> int:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        grid = processor(images=image, return_tensors="np", input_data_format="channels_last")["image_grid_thw"][0]
        return int(np.prod(grid)) // processor.merge_size ** 2

    return tokens


@click.command()
@click.option("--quick", is_flag=True, help="30 images per set instead of 200.")
def main(quick: bool) -> None:
    """Header-only image sizes against PIL's open and full decode, wall and CPU time."""
    start = begin()
    count = 30 if quick else 200
    sets = _image_sets(count)
    header, pil_open = image_size, lambda d: Image.open(io.BytesIO(d)).size
    decode = lambda d: Image.open(io.BytesIO(d)).convert("RGB")  # noqa: E731
    click.echo(f"{count} images per set; us per image, wall (CPU); decode/header as the ratio of "
               "CPU times (wall in brackets)\n")
    click.echo(f"{'image set':36} {'KiB/img':>8} {'header us':>16} {'PIL open us':>16} "
               f"{'decode us':>16} {'decode/header':>20}")
    for name, images in sets.items():
        mismatches = sum(image_size(d) != pil_open(d) for d in images)
        check(f"{name}: image_size equals PIL's size", mismatches == 0,
              f"{mismatches} of {len(images)} images differ")
        t_header = _per_image_us(header, images, 5)
        t_open = _per_image_us(pil_open, images, 5)
        t_decode = _per_image_us(decode, images, 1)
        kib = statistics.mean(len(d) for d in images) / 1024
        cells = [f"{w:7.1f} ({c:6.1f})" for w, c in (t_header, t_open, t_decode)]
        click.echo(f"{name:36} {kib:8.1f} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} "
                   f"{t_decode[1] / t_header[1]:9.0f}x ({t_decode[0] / t_header[0]:5.0f}x)")
    encoder = _qwen_encoder_path()
    if encoder is None:
        click.echo("\n(transformers not importable: Qwen2-VL encoder-path comparison skipped)")
        finish(start)
        return
    qwen = Qwen2VLTokens()
    images = sets["jpeg mixed 64..2048 (Qwen-VL-like)"]
    header_tokens = lambda d: qwen.image_tokens(*image_size(d))  # noqa: E731
    mismatches = sum(header_tokens(d) != encoder(d) for d in images)
    (fast_wall, fast_cpu), (slow_wall, slow_cpu) = (_per_image_us(header_tokens, images, 5),
                                                    _per_image_us(encoder, images, 1))
    click.echo(f"\nQwen2-VL image tokens, mixed JPEGs: header-only {fast_cpu:.1f} us/img CPU "
               f"({fast_wall:.1f} wall), decode + Qwen2VLImageProcessor {slow_cpu:.0f} us/img CPU "
               f"({slow_wall:.0f} wall): {slow_cpu / fast_cpu:.0f}x in CPU time "
               f"({slow_wall / fast_wall:.0f}x wall)")
    check("Qwen2-VL header-only tokens equal the processor's", mismatches == 0,
          f"{mismatches} mismatches in {len(images)} images")
    finish(start)


if __name__ == "__main__":
    main()
