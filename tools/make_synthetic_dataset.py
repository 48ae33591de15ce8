#!/usr/bin/env python
"""Write a synthetic multimodal WebDataset and prepare it with `energon prepare`.

Example:
    python tools/make_synthetic_dataset.py out/data --source web=20000:trimodal \
        --source code=5000:long --source captions=5000:short

Each source becomes a prepared dataset folder `OUT/<name>`; `OUT/metadataset.yaml` blends them.
Profiles: trimodal (50% ~300, 35% ~1,200, 15% ~4,000 tokens), short, medium, long, uniform.

Qwen-VL-like data (photo-like JPEGs of mixed sizes, each side drawn from MIN..MAX px):

    python tools/make_synthetic_dataset.py out/data --source qwen=2000:short --mixed-sizes 64:2048

:func:`write_photo_shards` writes such shards into a folder (also more shards into a prepared
dataset, for incremental index builds); :func:`prepare` runs ``energon prepare`` on it again.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np

from energon_ordering.inspect.synthetic import (
    IMAGE_FORMATS,
    LENGTH_PROFILES,
    SourceSpec,
    make_synthetic_dataset,
)


def _photo_jpeg(width: int, height: int, rng: np.random.Generator) -> bytes:
    """Gradients plus mild noise, JPEG: photo-like compressed size (tens of kB at 448 px)."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1),
                     np.full_like(x, int(rng.integers(0, 256)))], axis=-1)
    pixels = ((base + rng.integers(0, 24, size=base.shape)) % 256).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "JPEG", quality=85)
    return out.getvalue()


def write_photo_shards(folder: str | Path, *, samples: int, shard_size: int,
                       size: Callable[[np.random.Generator], tuple[int, int]],
                       caption_words: tuple[int, int] = (8, 120), seed: int = 0,
                       prefix: str = "shard") -> None:
    """Writes ``samples`` captioned JPEGs (``jpg`` + ``txt`` + ``json``) into ``folder`` as
    ``<prefix>-NNNNNN.tar`` shards of ``shard_size``; keys ``<prefix>-<index>`` (a new prefix
    adds shards beside existing ones). ``size(rng)`` draws each image's (width, height)."""
    import webdataset as wds

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = ("a", "photo", "of", "the", "cat", "on", "red", "mat", "near", "window", "light")
    with wds.ShardWriter(str(folder / f"{prefix}-%06d.tar"), maxcount=shard_size,
                         verbose=0) as sink:
        for i in range(samples):
            width, height = size(rng)
            n = int(rng.integers(caption_words[0], caption_words[1] + 1))
            caption = " ".join(words[j] for j in rng.integers(0, len(words), size=n))
            sink.write({"__key__": f"{prefix}-{i:08d}", "jpg": _photo_jpeg(width, height, rng),
                        "txt": caption,
                        "json": json.dumps({"width": width, "height": height})})


def mixed_sizes(low: int, high: int) -> Callable[[np.random.Generator], tuple[int, int]]:
    """Each side uniform in ``low..high`` px (Qwen-VL-like data: dynamic resolution)."""
    return lambda rng: (int(rng.integers(low, high + 1)), int(rng.integers(low, high + 1)))


def prepare(folder: str | Path) -> None:
    """``energon prepare`` of a folder of captioned JPEG shards (a new ``index.uuid``)."""
    from energon_ordering.inspect.synthetic import _energon_prepare

    _energon_prepare(Path(folder), "jpg")


def _parse_source(value: str) -> SourceSpec:
    try:
        name, rest = value.split("=", 1)
        count, _, profile = rest.partition(":")
        return SourceSpec(name.strip(), int(count), profile.strip() or "trimodal")
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: expected NAME=COUNT[:PROFILE], e.g. web=20000:trimodal "
            f"(profiles: {', '.join(sorted(LENGTH_PROFILES))})",
            param_hint="--source",
        ) from None


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--source", "sources", multiple=True, default=("web=2000:trimodal",),
              help="NAME=COUNT[:PROFILE]; repeat for several sources.")
@click.option("--seed", default=0, help="Data seed (lengths and captions).")
@click.option("--shard-size", default=256, help="Samples per tar shard.")
@click.option("--image-size", default=16, help="Side of the images, in pixels (448: LLaVA-like).")
@click.option("--image-format", type=click.Choice(IMAGE_FORMATS), default="png",
              help="png, or jpg for photo-like compressed sizes.")
@click.option("--mixed-sizes", "mixed", default=None, metavar="MIN:MAX",
              help="Photo-like JPEGs whose sides are drawn from MIN..MAX px (Qwen-VL-like), "
                   "short captions; the profile and --image-* are not used.")
def main(out: str, sources: tuple[str, ...], seed: int, shard_size: int, image_size: int,
         image_format: str, mixed: str | None) -> None:
    """Write a synthetic multimodal dataset to OUT and run `energon prepare` on it."""
    specs = [_parse_source(s) for s in sources]
    if mixed is not None:
        low, _, high = mixed.partition(":")
        if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
            raise click.BadParameter(f"{mixed!r}: expected MIN:MAX with 1 <= MIN <= MAX, "
                                     "e.g. 64:2048", param_hint="--mixed-sizes")
        for i, spec in enumerate(specs):
            write_photo_shards(Path(out) / spec.name, samples=spec.num_samples,
                               shard_size=shard_size, size=mixed_sizes(int(low), int(high)),
                               seed=seed + i)
            prepare(Path(out) / spec.name)
            click.echo(f"{spec.name}: {spec.num_samples} samples (JPEG {mixed} px) -> "
                       f"{out}/{spec.name}")
        return
    try:
        meta = make_synthetic_dataset(out, specs, seed=seed, shard_size=shard_size,
                                      image_size=image_size, image_format=image_format)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    for spec in specs:
        click.echo(f"{spec.name}: {spec.num_samples} samples ({spec.profile}) -> {out}/{spec.name}")
    click.echo(f"metadataset: {meta}")


if __name__ == "__main__":
    main()
