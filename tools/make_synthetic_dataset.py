#!/usr/bin/env python
"""Write a synthetic multimodal WebDataset and prepare it with `energon prepare`.

Example:
    python tools/make_synthetic_dataset.py out/data --source web=20000:trimodal \
        --source code=5000:long --source captions=5000:short

Each source becomes a prepared dataset folder `OUT/<name>`; `OUT/metadataset.yaml` blends them.
Profiles: trimodal (50% ~300, 35% ~1,200, 15% ~4,000 tokens), short, medium, long, uniform.
"""

from __future__ import annotations

import click

from energon_ordering.inspect.synthetic import (
    IMAGE_FORMATS,
    LENGTH_PROFILES,
    SourceSpec,
    make_synthetic_dataset,
)


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
def main(out: str, sources: tuple[str, ...], seed: int, shard_size: int, image_size: int,
         image_format: str) -> None:
    """Write a synthetic multimodal dataset to OUT and run `energon prepare` on it."""
    specs = [_parse_source(s) for s in sources]
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
