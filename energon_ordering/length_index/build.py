"""Building length indexes: run a task encoder (or a raw length function) over every sample.

``build_length_index(path)`` reads every sample of a prepared dataset, or of every dataset a
metadataset references, with Energon's own loading (the same ``load_sample`` / cooker chain the
training pipeline uses, see :func:`energon_ordering.pool.deferred_load.split_loader`), computes its
length and writes one :mod:`energon_ordering.length_index.index` file per prepared dataset. Lengths
come from, in order of preference:

- ``raw_length_fn(raw_files)``: a function of the still-compressed files (nothing is decoded);
- the task encoder: ``encode_sample`` then ``ordering_sample_length`` (exact: the very key the
  post-encode pool sorts by). ``energon-ordering index`` passes
  :class:`~energon_ordering.inspect.length_estimate.LengthEstimateTaskEncoder` when given neither.

With ``workers > 1`` the samples are read in this process and measured in a fork-started
process pool.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.energon import DefaultTaskEncoder, WorkerConfig
from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError
from megatron.energon.metadataset.loader import load_dataset

from energon_ordering.pool.deferred_load import split_loader
from energon_ordering.errors import LengthIndexError
from energon_ordering.length_index.index import (
    IndexSummary,
    index_name,
    task_encoder_label,
    write_length_index,
)
from energon_ordering.pool.sample_length import default_sample_length

__all__ = ["BuiltIndex", "build_length_index", "sample_length_of"]


@dataclass(frozen=True)
class BuiltIndex:
    """One written index and how long it took."""

    dataset: str
    summary: IndexSummary
    seconds: float
    #: Samples that failed to decode or measure, indexed with length 0 (``skip_bad_samples``).
    skipped: list[str] = dataclasses.field(default_factory=list)


class _Measure:
    """Length of one raw sample: ``raw_length_fn`` on its files, or load + encode + length."""

    def __init__(
        self,
        task_encoder: Any,
        load_fns: list[Callable],
        raw_length_fn: Callable | None,
        skip_bad_samples: bool = False,
    ):
        self.task_encoder = task_encoder
        self.load_fns = load_fns
        self.raw_length_fn = raw_length_fn
        self.skip_bad_samples = skip_bad_samples

    def __call__(self, raw: Any) -> tuple[str, float | None]:
        files = raw.data[0]
        key = files["__key__"]
        try:
            if self.raw_length_fn is not None:
                return key, self.raw_length_fn(files)
            sample = raw
            for fn in self.load_fns:
                sample = fn(sample)
            return key, sample_length_of(self.task_encoder, sample)
        except Exception as e:  # noqa: BLE001 - any failure of user code on one sample
            if self.skip_bad_samples:
                return key, None
            what = "--raw-length-fn" if self.raw_length_fn is not None else "decoding/encoding"
            raise LengthIndexError(
                f"length index: sample {key!r} (shard {files.get('__shard__', '?')}) failed in "
                f"{what}: {type(e).__name__}: {e}. Fix the sample or the function, or skip and "
                "count such samples with --skip-bad-samples (build_length_index("
                "skip_bad_samples=True)); they are indexed with length 0."
            ) from None


def sample_length_of(task_encoder: Any, sample: Any) -> float:
    """``ordering_sample_length(encode_sample(sample))``: the key the post-encode pool sorts by."""
    encoded = task_encoder.encode_sample(sample)
    length_fn = getattr(task_encoder, "ordering_sample_length", default_sample_length)
    return length_fn(encoded)


_WORKER_MEASURE: _Measure | None = None


def _measure_in_worker(raw: Any) -> tuple[str, float]:
    assert _WORKER_MEASURE is not None
    return _WORKER_MEASURE(raw)


def _measured(
    raws: Iterator[Any],
    measure: _Measure,
    workers: int,
    progress: Callable[[int], None] | None,
    skipped: list[str],
) -> Iterator[tuple[str, float]]:
    global _WORKER_MEASURE
    if workers <= 1:
        results: Iterator[tuple[str, float]] = map(measure, raws)
        pool = None
    else:
        _WORKER_MEASURE = measure
        pool = multiprocessing.get_context("fork").Pool(workers)
        results = pool.imap(_measure_in_worker, raws, chunksize=64)
    try:
        for key, length in results:
            if progress is not None:
                progress(1)
            if length is None:
                skipped.append(key)
                length = 0.0
            yield key, length
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _WORKER_MEASURE = None


def build_length_index(
    path: str | Path,
    *,
    task_encoder: Any = None,
    raw_length_fn: Callable[[dict[str, Any]], float] | None = None,
    split_part: str = "train",
    workers: int = 1,
    progress: Callable[[str, int], Callable[[int], None] | None] | None = None,
    name: str | None = None,
    index_dir: str | Path | None = None,
    skip_bad_samples: bool = False,
) -> list[BuiltIndex]:
    """Writes the length index of every prepared dataset under ``path``.

    Args:
        path: A prepared dataset folder or a metadataset YAML.
        task_encoder: Computes lengths (``encode_sample`` + ``ordering_sample_length``);
            Its ``decoder`` is used for loading. One of ``task_encoder`` and ``raw_length_fn``
            is required.
        raw_length_fn: Computes lengths from the raw files instead (no decoding).
        split_part: The split whose samples are indexed (the training split).
        workers: Processes that measure samples (1 = in this process).
        progress: ``progress(dataset_name, num_samples)`` returns a callback ``advance(n)``.
        name: The index's name; None names it after what computed the lengths
            (:func:`~energon_ordering.length_index.index.index_name`), so indexes of different
            length functions sit side by side.
        index_dir: Write to ``<index_dir>/<index.uuid>/`` instead of ``<dataset>/.nv-meta/``.
        skip_bad_samples: Index a sample that fails to decode or measure with length 0 and
            report it (``BuiltIndex.skipped``) instead of raising.

    Returns:
        One :class:`BuiltIndex` per prepared dataset.
    """
    if task_encoder is None:
        if raw_length_fn is None:
            raise LengthIndexError(
                "build_length_index: give task_encoder=<your OrderingTaskEncoder> (exact lengths) "
                "or raw_length_fn=<function raw files -> length>; for the generic estimate pass "
                "task_encoder=energon_ordering.inspect.length_estimate.LengthEstimateTaskEncoder()."
            )
        task_encoder = DefaultTaskEncoder()
    if workers < 1:
        raise LengthIndexError(f"build_length_index: workers = {workers} must be >= 1.")
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    try:
        loaded = load_dataset(path).get_datasets(
            training=False,
            split_part=split_part,
            worker_config=wc,
            decoder=getattr(task_encoder, "decoder", None),
        )
    except EmptyDatasetError as e:
        raise LengthIndexError(
            f"length index of {path}: its split {split_part!r} has no samples ({e}); index the "
            "split you train on (--split-part train)."
        ) from None
    built: list[BuiltIndex] = []
    seen: set[str] = set()
    for entry in loaded.datasets:
        factory = entry.dataset
        label = str(getattr(factory, "path", factory))
        if label in seen:
            continue
        seen.add(label)
        t0 = time.perf_counter()
        if len(factory) == 0:
            raise LengthIndexError(
                f"length index of {label}: its split {split_part!r} has no samples; index the "
                "split you train on (--split-part train)."
            )
        raw_ds, load_fns = split_loader(DefaultTaskEncoder._load_dataset(task_encoder, entry, 0, wc))
        measure = _Measure(task_encoder, load_fns, raw_length_fn, skip_bad_samples)
        advance = progress(label, len(factory)) if progress is not None else None
        computed_by = _describe(task_encoder, raw_length_fn)
        skipped: list[str] = []
        summary = write_length_index(
            factory.path,
            _measured(iter(raw_ds), measure, workers, advance, skipped),
            computed_by=computed_by,
            name=index_name(computed_by) if name is None else name,
            index_dir=index_dir,
        )
        if summary.samples != len(factory):
            raise LengthIndexError(
                f"length index of {label}: read {summary.samples} samples, but the dataset's "
                f"split {split_part!r} has {len(factory)}; is the dataset being prepared again?"
            )
        built.append(BuiltIndex(label, summary, time.perf_counter() - t0, skipped))
    return built


def _describe(task_encoder: Any, raw_length_fn: Callable | None) -> str:
    if raw_length_fn is not None:
        return f"raw_length_fn {getattr(raw_length_fn, '__module__', '?')}." \
               f"{getattr(raw_length_fn, '__qualname__', repr(raw_length_fn))}"
    return task_encoder_label(task_encoder)
