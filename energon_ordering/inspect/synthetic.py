"""Synthetic multimodal WebDatasets, prepared with Energon's own ``energon prepare``.

Used by the tests, the benchmarks and the demo, so that everything runs on a real prepared
dataset without network access. Each sample is a real image (a small PNG by default, or a photo-sized JPEG) plus a caption whose
whitespace-token count follows a chosen length profile, and a JSON part naming its source and
token count. Sample keys are ``<source>-<index:08d>``: unique across sources and stable for a
given (source, index), independent of the seed.

A profile is a mixture of lognormal modes, each ``(weight, median_tokens, sigma)``. The
trimodal profile is the realistic mix the package is benchmarked on: 50% short (~300 tokens),
35% medium (~1,200) and 15% long (~4,000).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from energon_ordering.errors import show

__all__ = [
    "IMAGE_FORMATS",
    "LENGTH_PROFILES",
    "LengthProfile",
    "SourceSpec",
    "make_synthetic_dataset",
    "sample_lengths",
]


@dataclass(frozen=True)
class LengthProfile:
    """A mixture of lognormal modes over text token counts.

    Args:
        modes: ``(weight, median_tokens, sigma)`` per mode; weights need not sum to 1.
        min_tokens: Lengths are clipped below to this many tokens.
        max_tokens: Lengths are clipped above to this many tokens.
    """

    modes: tuple[tuple[float, float, float], ...]
    min_tokens: int = 8
    max_tokens: int = 8192

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError("LengthProfile.modes is empty: give at least one (weight, median, sigma).")
        for i, (w, median, sigma) in enumerate(self.modes):
            if not (w >= 0 and median > 0 and sigma >= 0) or not all(
                math.isfinite(v) for v in (w, median, sigma)
            ):
                raise ValueError(
                    f"LengthProfile.modes[{i}] = {show((w, median, sigma))}: weight must be >= 0, "
                    "median > 0 and sigma >= 0 (all finite)."
                )
        if sum(w for w, _, _ in self.modes) <= 0:
            raise ValueError("LengthProfile.modes: the weights sum to 0; give one positive weight.")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"LengthProfile: need 1 <= min_tokens <= max_tokens, got "
                f"min_tokens={self.min_tokens}, max_tokens={self.max_tokens}."
            )


#: Named profiles. ``trimodal`` is the benchmark mix of the package.
LENGTH_PROFILES: dict[str, LengthProfile] = {
    "trimodal": LengthProfile(((0.50, 300, 0.25), (0.35, 1200, 0.25), (0.15, 4000, 0.2))),
    "short": LengthProfile(((1.0, 200, 0.4),)),
    "medium": LengthProfile(((1.0, 900, 0.35),)),
    "long": LengthProfile(((0.6, 2500, 0.3), (0.4, 5000, 0.2))),
    "uniform": LengthProfile(((1.0, 500, 0.0),)),
}


@dataclass(frozen=True)
class SourceSpec:
    """One synthetic source: its name, number of samples and length profile.

    Args:
        name: Source name; becomes the dataset folder name and the key prefix.
        num_samples: Number of samples to write.
        profile: A :class:`LengthProfile` or the name of one in :data:`LENGTH_PROFILES`.
        weight: Blend weight written into the metadataset.
    """

    name: str
    num_samples: int
    profile: LengthProfile | str = "trimodal"
    weight: float = 1.0

    def resolved_profile(self) -> LengthProfile:
        if isinstance(self.profile, LengthProfile):
            return self.profile
        try:
            return LENGTH_PROFILES[self.profile]
        except KeyError:
            raise ValueError(
                f"SourceSpec(name={show(self.name)}).profile = {show(self.profile)} is unknown; "
                f"use one of {sorted(LENGTH_PROFILES)} or pass a LengthProfile."
            ) from None


def sample_lengths(profile: LengthProfile, n: int, seed: int) -> np.ndarray:
    """Draws ``n`` text token counts from ``profile``; a pure function of (profile, n, seed)."""
    rng = np.random.default_rng(seed)
    weights = np.array([w for w, _, _ in profile.modes], dtype=np.float64)
    mode = rng.choice(len(weights), size=n, p=weights / weights.sum())
    medians = np.array([m for _, m, _ in profile.modes])[mode]
    sigmas = np.array([s for _, _, s in profile.modes])[mode]
    lengths = np.exp(np.log(medians) + sigmas * rng.standard_normal(n))
    return np.clip(np.rint(lengths), profile.min_tokens, profile.max_tokens).astype(np.int64)


_VOCAB = tuple(a + b for a in "bdfgklmnprstvz" for b in "aeiou")


def _caption(n_tokens: int, rng: np.random.Generator) -> str:
    return " ".join(_VOCAB[i] for i in rng.integers(0, len(_VOCAB), size=n_tokens))


#: Image formats the synthetic datasets can write (the webdataset file extension).
IMAGE_FORMATS = ("png", "jpg")


def _image(index: int, size: int, fmt: str) -> bytes:
    """A deterministic RGB image: colour gradients, plus mild texture for JPEGs so that a
    448 x 448 JPEG compresses to a photo-like size (tens of kB) rather than to almost nothing."""
    from PIL import Image

    x = np.arange(size, dtype=np.int32) * 256 // max(1, size)
    img = np.stack(
        [
            np.add.outer(x, x * 0) + index % 251,
            np.add.outer(x * 0, x) + (index * 7) % 251,
            np.full((size, size), (index * 13) % 251, dtype=np.int32),
        ],
        axis=-1,
    )
    if fmt == "jpg":
        img = img + np.random.default_rng(index).integers(0, 20, size=img.shape)
    buf = io.BytesIO()
    Image.fromarray((img % 256).astype(np.uint8), "RGB").save(
        buf, format="PNG" if fmt == "png" else "JPEG", quality=90
    )
    return buf.getvalue()


def _write_source(
    out: Path, spec: SourceSpec, *, seed: int, shard_size: int, image_size: int, image_format: str
) -> None:
    import webdataset as wds

    out.mkdir(parents=True, exist_ok=True)
    source_seed = int.from_bytes(spec.name.encode(), "little") % (2**31) + seed
    lengths = sample_lengths(spec.resolved_profile(), spec.num_samples, source_seed)
    text_rng = np.random.default_rng(source_seed + 1)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=shard_size, verbose=0) as sink:
        for i, n_tokens in enumerate(lengths):
            sink.write(
                {
                    "__key__": f"{spec.name}-{i:08d}",
                    image_format: _image(i, image_size, image_format),
                    "txt": _caption(int(n_tokens), text_rng),
                    "json": json.dumps({"source": spec.name, "text_tokens": int(n_tokens)}),
                }
            )


def _energon_prepare(path: Path, image_format: str) -> None:
    """Runs Energon's own ``energon prepare`` command (its click command, in this process: a
    subprocess would spend seconds importing torch and Energon again for each dataset)."""
    from megatron.energon.cli.main import main as energon_cli

    args = [
        "prepare",
        str(path),
        "--non-interactive",
        "--no-progress",
        "--split-ratio",
        "1,0,0",
        "--sample-type",
        "CaptioningSample",
        "--field-map",
        json.dumps({"image": image_format, "caption": "txt"}),
        "--force-overwrite",
    ]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            energon_cli.main(args, prog_name="energon", standalone_mode=False)
    except (Exception, SystemExit) as e:
        raise RuntimeError(f"`energon {' '.join(args[:2])}` failed ({e!s}):\n{out.getvalue()}") from e


def make_synthetic_dataset(
    out_dir: str | Path,
    sources: Sequence[SourceSpec] | Mapping[str, int],
    *,
    seed: int = 0,
    shard_size: int = 256,
    image_size: int = 16,
    image_format: str = "png",
) -> Path:
    """Writes one prepared WebDataset per source and a metadataset blending them.

    Layout: ``out_dir/<source>/shard-*.tar`` (+ Energon's ``.nv-meta``) and
    ``out_dir/metadataset.yaml`` (v2, ``blend:`` with each source's weight and
    ``subflavors: {source: <name>}``).

    Args:
        out_dir: Folder to write to (created).
        sources: Source specs, or ``{name: num_samples}`` for trimodal sources.
        seed: Data seed; lengths and captions are pure functions of (seed, source, index).
        shard_size: Samples per tar shard.
        image_size: Side of the square image, in pixels (448 for LLaVA-like memory figures).
        image_format: ``"png"`` or ``"jpg"`` (photo-like compressed size).

    Returns:
        The path of ``metadataset.yaml``. A single source's prepared folder is
        ``out_dir/<name>`` and can be passed to ``get_train_dataset`` directly.
    """
    if isinstance(sources, Mapping):
        sources = [SourceSpec(name, n) for name, n in sources.items()]
    if not sources:
        raise ValueError("make_synthetic_dataset: `sources` is empty; give at least one source.")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"make_synthetic_dataset: duplicate source names in {names}.")
    for s in sources:
        if not s.name or not s.name.replace("_", "").isalnum():
            raise ValueError(f"SourceSpec.name = {show(s.name)}: use letters, digits and '_' only.")
        if s.num_samples < 1:
            raise ValueError(f"SourceSpec(name={show(s.name)}).num_samples = {s.num_samples}: must be >= 1.")
        s.resolved_profile()
    if shard_size < 1:
        raise ValueError(f"make_synthetic_dataset: shard_size = {shard_size}: must be >= 1.")
    if image_format not in IMAGE_FORMATS:
        raise ValueError(
            f"make_synthetic_dataset: image_format = {show(image_format)}; use one of {IMAGE_FORMATS}."
        )
    if image_size < 1:
        raise ValueError(f"make_synthetic_dataset: image_size = {image_size}: must be >= 1.")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for spec in sources:
        _write_source(out / spec.name, spec, seed=seed, shard_size=shard_size,
                      image_size=image_size, image_format=image_format)
        _energon_prepare(out / spec.name, image_format)

    blend = "\n".join(
        f"      - weight: {spec.weight}\n"
        f"        path: {spec.name}\n"
        f"        subflavors:\n"
        f"          source: {spec.name}"
        for spec in sources
    )
    meta = out / "metadataset.yaml"
    meta.write_text(
        "__module__: megatron.energon\n"
        "__class__: MetadatasetV2\n"
        "splits:\n"
        "  train:\n"
        "    blend:\n"
        f"{blend}\n"
    )
    return meta
