"""Checking a raw length function against the task encoder on random samples of a dataset.

A raw (header-only) length function is only worth its speed if it gives the very lengths the
task encoder gives. :func:`verify_raw_length` draws ``samples`` random samples (seeded) of every
prepared dataset under a path, measures each both ways, exactly as
:func:`~energon_ordering.length_index.build.build_length_index` measures it (``raw_length_fn``
on the raw files; load + ``encode_sample`` + ``ordering_sample_length``), and lists every
sample whose lengths differ. The drawn samples are read by byte range from Energon's index
(one ``pread`` each, :class:`~energon_ordering.pool.byte_range_reader.ByteRangeReader`), so a
check of a few hundred samples costs the same on 10^3 samples as on 10^8; a dataset that
cannot be read so (joined datasets, a remote one) is read in order up to the last drawn sample.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.energon import DefaultTaskEncoder, WorkerConfig
from megatron.energon.metadataset.loader import load_dataset

from energon_ordering.errors import LengthIndexError, show
from energon_ordering.length_index.build import check_split_part, SampleMeasure
from energon_ordering.pool.deferred_load import split_loader
from energon_ordering.pool.index_fill import (
    index_fill_problem,
    loader_byte_reader,
    raw_sample_at,
)

__all__ = ["LengthMismatch", "VerifyReport", "verify_raw_length"]


@dataclass(frozen=True)
class LengthMismatch:
    """A sample whose raw length differs from its encoded length (tokens)."""

    dataset: str
    key: str
    raw_length: float
    encoded_length: float

    def __str__(self) -> str:
        return (f"{self.dataset}: sample {self.key}: raw length {self.raw_length:g}, task "
                f"encoder {self.encoded_length:g} ({self.raw_length - self.encoded_length:+g})")


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_raw_length` compared: samples checked, and every mismatch."""

    checked: int
    mismatches: tuple[LengthMismatch, ...]

    def check(self, raw_length_fn: object) -> None:
        """Raises :class:`LengthIndexError` listing the mismatches, if any."""
        if self.mismatches:
            listed = "; ".join(str(m) for m in self.mismatches[:20])
            more = f"; and {len(self.mismatches) - 20} more" if len(self.mismatches) > 20 else ""
            raise LengthIndexError(
                f"length index: raw_length_fn {getattr(raw_length_fn, '__qualname__', raw_length_fn)} "
                f"differs from the task encoder on {len(self.mismatches)} of {self.checked} "
                f"verified samples: {listed}{more}. Fix the length function (its media token "
                "rule and tokenizer must be the encoder's), or accept the differences "
                "(--allow-mismatch)."
            )


def verify_raw_length(
    path: str | Path,
    *,
    raw_length_fn: Callable[[dict[str, Any]], float],
    task_encoder: Any,
    samples: int,
    seed: int = 0,
    split_part: str = "train",
) -> VerifyReport:
    """Compares ``raw_length_fn`` with ``task_encoder`` on ``samples`` random samples of every
    prepared dataset under ``path`` (all of a dataset's samples if it has fewer).

    Args:
        path: A prepared dataset folder or a metadataset YAML.
        raw_length_fn: Length of a sample from its raw files (as ``--raw-length-fn``).
        task_encoder: The training task encoder (``encode_sample``, ``ordering_sample_length``
            and its ``decoder``).
        samples: Samples drawn per prepared dataset (>= 1).
        seed: Seed of the draw: the same seed checks the same samples.
        split_part: The split the samples are drawn from.

    Returns:
        The number of samples checked and every mismatch; :meth:`VerifyReport.check` raises.
    """
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise LengthIndexError(f"verify: samples = {show(samples)} must be an integer >= 1 (--verify N).")
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    dataset = load_dataset(path)
    check_split_part(dataset, path, split_part)
    loaded = dataset.get_datasets(training=False, split_part=split_part, worker_config=wc,
                                  decoder=getattr(task_encoder, "decoder", None))
    checked, mismatches, seen = 0, [], set()
    rng = random.Random(seed)
    for entry in loaded.datasets:
        label = str(getattr(entry.dataset, "path", entry.dataset))
        if label in seen:
            continue
        seen.add(label)
        raw_ds, load_fns = split_loader(DefaultTaskEncoder._load_dataset(task_encoder, entry, 0, wc))
        by_raw = SampleMeasure(task_encoder, load_fns, raw_length_fn)
        by_encoder = SampleMeasure(task_encoder, load_fns, None)
        for raw in _drawn_raws(raw_ds, len(entry.dataset), samples, rng):
            key, raw_length = by_raw(raw)
            _, encoded_length = by_encoder(raw)
            checked += 1
            if raw_length != encoded_length:
                mismatches.append(LengthMismatch(label, key, raw_length, encoded_length))
    return VerifyReport(checked, tuple(mismatches))


def _drawn_raws(raw_ds: Any, size: int, samples: int, rng: random.Random) -> Iterator[Any]:
    """``samples`` seeded random raw samples of ``raw_ds`` (of ``size`` samples; all if fewer),
    as Energon's loader yields them: by byte range where the dataset allows it."""
    if index_fill_problem(raw_ds) is None:
        reader = loader_byte_reader(raw_ds)
        try:
            # the reader's indexes count the samples a sample filter excludes (read: None)
            for index in sorted(rng.sample(range(len(reader)), min(samples, len(reader)))):
                raw = raw_sample_at(reader, index)
                if raw is not None:
                    yield raw
        finally:
            reader.close()
        return
    drawn = set(rng.sample(range(size), min(samples, size)))
    for index, raw in enumerate(raw_ds):
        if index in drawn:
            yield raw
            drawn.discard(index)
            if not drawn:
                return
