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

A prepared dataset whose samples Energon's index locates (every dataset of Energon >= 7.4) is
measured shard by shard (:mod:`.shard_build`): by every process of a distributed build when
``torch.distributed`` is initialised (``energon-ordering index`` under torchrun or srun, or a
training script calling this), each writing its part beside the index and rank 0 merging them
into the bytes a one-process build writes; and after ``energon prepare`` ran again, shards whose
content is unchanged keep the previous index's lengths (:mod:`.reuse`).

With ``workers > 1`` the samples are read in this process and measured in a fork-started
process pool, :data:`CHUNK` samples per task, in order. A measuring process that dies (killed by
the OOM killer, a crash in native code) breaks the pool; the build then warns, starts a new pool
and measures the lost chunks again, once: a chunk lost twice fails the build with a
:class:`~energon_ordering.errors.LengthIndexError` naming its samples. Never a hang
(``multiprocessing.Pool.imap`` waits forever for a chunk whose process died).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import multiprocessing
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from megatron.energon import DefaultTaskEncoder, WorkerConfig
from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError
from megatron.energon.metadataset.loader import load_dataset

from energon_ordering.pool.deferred_load import split_loader
from energon_ordering.errors import LengthIndexError, show
from energon_ordering.length_index.distributed import Coordinator
from energon_ordering.length_index.index import (
    IndexSummary,
    LengthIndex,
    check_index_name,
    dataset_uuid,
    index_name,
    index_path,
    local_dataset_path,
    task_encoder_label,
    write_length_index,
)
from energon_ordering.length_index.parts import PartOwner
from energon_ordering.length_index.reuse import previous_index
from energon_ordering.length_index.shard_build import DatasetJob, build_dataset
from energon_ordering.pool.index_fill import index_fill_problem, loader_byte_reader
from energon_ordering.pool.sample_length import default_sample_length

__all__ = ["BuiltIndex", "build_length_index", "check_index_name", "sample_length_of"]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class BuiltIndex:
    """One written index and how long it took."""

    dataset: str
    summary: IndexSummary
    seconds: float
    #: Samples that failed to decode or measure, indexed with length 0 (``skip_bad_samples``).
    skipped: list[str] = dataclasses.field(default_factory=list)
    #: Samples measured by this build (by every process); the others were reused from the
    #: index of the data before ``energon prepare`` ran again (shards with unchanged content).
    measured: int = 0


class SampleMeasure:
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
        self._measured = 0

    def __call__(self, raw: Any) -> tuple[str, float | None]:
        files = raw.data[0]
        key = files["__key__"]
        try:
            if self.raw_length_fn is not None:
                return key, self.raw_length_fn(files)
            sample = raw
            for fn in self.load_fns:
                sample = fn(sample)
            with _active_worker(self._measured):
                self._measured += 1
                return key, sample_length_of(self.task_encoder, sample)
        except Exception as e:  # noqa: BLE001 - any failure of user code on one sample
            if self.skip_bad_samples:
                return key, None
            what = "--raw-length-fn" if self.raw_length_fn is not None else "decoding/encoding"
            raise LengthIndexError(
                f"length index: sample {show(key)} (shard {files.get('__shard__', '?')}) failed in "
                f"{what}: {type(e).__name__}: {e}. Fix the sample or the function, or skip and "
                "count such samples with --skip-bad-samples (build_length_index("
                "skip_bad_samples=True)); they are indexed with length 0."
            ) from None


@contextlib.contextmanager
def _active_worker(sample_index: int) -> Iterator[None]:
    """Energon's worker context around one measurement, as a loader worker has it: an encoder
    whose ``encode_sample`` is ``@stateless(restore_seeds=True)`` (Megatron-LM's examples) seeds
    its random choices from the active worker config and sample index. Inside a loader (one is
    active already) nothing changes."""
    if WorkerConfig.active_worker_config is not None:
        yield
        return
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    wc.worker_activate(sample_index)
    try:
        yield
    finally:
        wc.worker_deactivate()


def sample_length_of(task_encoder: Any, sample: Any) -> float:
    """``ordering_sample_length(encode_sample(sample))``: the key the post-encode pool sorts by.

    An ``encode_sample`` written as a generator (Megatron-LM's ``examples/multimodal`` encoder
    is one) is run to its end, as Energon's map stage does, and the raw sample's length is the
    sum of what it yields (its tokens, whatever it is split into)."""
    encoded = task_encoder.encode_sample(sample)
    length_fn = getattr(task_encoder, "ordering_sample_length", default_sample_length)
    if inspect.isgenerator(encoded):
        return sum(length_fn(x) for x in encoded)
    return length_fn(encoded)


#: Samples per task of a measuring process.
CHUNK = 64

_WORKER_MEASURE: SampleMeasure | None = None


def _measure_chunk(raws: list[Any]) -> list[tuple[str, float | None]]:
    assert _WORKER_MEASURE is not None  # set before the pool forks
    return [_WORKER_MEASURE(raw) for raw in raws]


@dataclass
class _Chunk:
    """Raw samples sent to the pool as one task, and how often a broken pool lost them."""

    raws: list[Any]
    future: Future | None = None
    lost: int = 0

    def unfinished(self) -> bool:
        f = self.future
        return f is None or not f.done() or f.cancelled() or f.exception() is not None



def _span(chunks: list[_Chunk]) -> str:
    """The samples of ``chunks`` for a message: first key .. last key (count)."""
    first, last = chunks[0].raws[0].data[0]["__key__"], chunks[-1].raws[-1].data[0]["__key__"]
    count = sum(len(c.raws) for c in chunks)
    return f"{show(first)} .. {show(last)} ({count} samples in {len(chunks)} chunks)"


def _in_processes(raws: Iterator[Any], workers: int) -> Iterator[tuple[str, float | None]]:
    """``_WORKER_MEASURE`` of every raw sample, in order, measured by ``workers`` processes.

    At most ``2 * workers`` chunks are in flight. When a process dies, the pool is replaced and
    every chunk it had not finished is submitted again; a chunk lost a second time raises.
    """
    ctx = multiprocessing.get_context("fork")
    pool = ProcessPoolExecutor(workers, mp_context=ctx)
    chunks = iter(lambda: list(islice(raws, CHUNK)), [])
    pending: deque[_Chunk] = deque()
    try:
        while True:
            try:
                while len(pending) < 2 * workers and (raw_chunk := next(chunks, None)) is not None:
                    pending.append(chunk := _Chunk(raw_chunk))
                    chunk.future = pool.submit(_measure_chunk, raw_chunk)
                if not pending:
                    return
                results = pending[0].future.result()  # type: ignore[union-attr]
            except BrokenProcessPool:
                pool.shutdown(wait=True, cancel_futures=True)
                pool = _replacement_pool(pending, workers, ctx)
                continue
            pending.popleft()
            yield from results
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _replacement_pool(pending: deque[_Chunk], workers: int, ctx: Any) -> ProcessPoolExecutor:
    """After a measuring process died: a new pool measuring the unfinished chunks again, with
    a warning; raises if one of them was lost before."""
    lost = [c for c in pending if c.unfinished()]
    twice = [c for c in lost if c.lost]
    if twice:
        raise LengthIndexError(
            "length index: a measuring process died again while measuring samples "
            f"{_span(twice)}, which a process was measuring when one died before (killed by a "
            "signal, e.g. the OOM killer, or crashed in native code); nothing was written. "
            "Build with fewer processes (--workers) or more memory, or find the sample that "
            "kills it with --workers 1."
        )
    warnings.warn(
        "length index: a measuring process died (killed by a signal, e.g. the OOM killer, or "
        f"crashed); measuring the samples it and the others had not finished, {_span(lost)}, "
        f"again in a new pool of {workers} processes (once).",
        RuntimeWarning,
        stacklevel=3,
    )
    pool = ProcessPoolExecutor(workers, mp_context=ctx)
    for chunk in lost:
        chunk.lost += 1
    try:
        for chunk in lost:
            chunk.future = pool.submit(_measure_chunk, chunk.raws)
    except BrokenProcessPool:
        pass  # broken again already: the next result() finds out, with these chunks unfinished
    return pool


def _results(raws: Iterator[Any], measure: SampleMeasure,
             workers: int) -> Iterator[tuple[str, float | None]]:
    """``measure`` of every raw sample, in order: in this process, or by ``workers``
    processes (the pool ends with the generator)."""
    global _WORKER_MEASURE
    if workers <= 1:
        yield from map(measure, raws)
        return
    _WORKER_MEASURE = measure
    results = _in_processes(raws, workers)
    try:
        yield from results
    finally:
        results.close()  # ends the pool now
        _WORKER_MEASURE = None


def _measured(
    raws: Iterator[Any],
    measure: SampleMeasure,
    workers: int,
    progress: Callable[[int], None] | None,
    skipped: list[str],
) -> Iterator[tuple[str, float]]:
    results = _results(raws, measure, workers)
    try:
        for key, length in results:
            if progress is not None:
                progress(1)
            if length is None:
                skipped.append(key)
                length = 0.0
            yield key, length
    finally:
        results.close()


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
    reuse: bool = True,
    log: Callable[[str], None] | None = None,
    coordinator: Coordinator | None = None,
) -> list[BuiltIndex]:
    """Writes the length index of every prepared dataset under ``path``.

    Distributed when ``torch.distributed`` is initialised with more than one process (every
    rank calls it with the same arguments; gloo is used for the build, whatever the default
    group's backend): each process measures its share of the shards, rank 0 merges, and every
    rank returns the same summaries. So an encoder defined in a training script needs no
    importable module.

    Args:
        path: A prepared dataset folder or a metadataset YAML.
        task_encoder: Computes lengths (``encode_sample`` + ``ordering_sample_length``);
            Its ``decoder`` is used for loading. One of ``task_encoder`` and ``raw_length_fn``
            is required.
        raw_length_fn: Computes lengths from the raw files instead (no decoding).
        split_part: The split whose samples are indexed (the training split).
        workers: Processes that measure samples (1 = in this process), per build process.
        progress: ``progress(label, num_samples)`` returns a callback ``advance(n)`` (a
            distributed build asks for this process's bar, and on rank 0 the combined one).
        name: The index's name; None names it after what computed the lengths
            (:func:`~energon_ordering.length_index.index.index_name`), so indexes of different
            length functions sit side by side.
        index_dir: Write to ``<index_dir>/<index.uuid>/`` instead of ``<dataset>/.nv-meta/``.
        skip_bad_samples: Index a sample that fails to decode or measure with length 0 and
            report it (``BuiltIndex.skipped``) instead of raising.
        reuse: After ``energon prepare`` ran again, keep the previous index's lengths of the
            shards whose content is unchanged (:mod:`~energon_ordering.length_index.reuse`);
            False measures every sample.
        log: Receives the build's notes (parts reused or recomputed); None: logged (INFO).
        coordinator: The build's processes (the command line's, after its rendezvous); None:
            :meth:`Coordinator.current`.

    Returns:
        One :class:`BuiltIndex` per prepared dataset.
    """
    check_index_name(name)
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
    coord = coordinator if coordinator is not None else Coordinator.current()
    try:
        wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
        dataset = load_dataset(path)
        check_split_part(dataset, path, split_part)
        try:
            loaded = dataset.get_datasets(
                training=False,
                split_part=split_part,
                worker_config=wc,
                decoder=getattr(task_encoder, "decoder", None),
            )
        except EmptyDatasetError as e:
            raise LengthIndexError(
                f"length index of {path}: its split {show(split_part)} has no samples ({e}); "
                "index the split you train on (--split-part train)."
            ) from None
        computed_by = _describe(task_encoder, raw_length_fn)
        name = index_name(computed_by) if name is None else name
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
                    f"length index of {label}: its split {show(split_part)} has no samples; "
                    "index the split you train on (--split-part train)."
                )
            raw_ds, load_fns = split_loader(
                DefaultTaskEncoder._load_dataset(task_encoder, entry, 0, wc))
            measure = SampleMeasure(task_encoder, load_fns, raw_length_fn, skip_bad_samples)

            def write_index(pairs: Iterator[tuple[str, float]],
                            shards: list[tuple[str, str, int]] | None = None) -> IndexSummary:
                summary = write_length_index(factory.path, pairs, computed_by=computed_by,
                                             name=name, index_dir=index_dir, shards=shards)
                if summary.samples != len(factory):
                    raise LengthIndexError(
                        f"length index of {label}: read {summary.samples} samples, but the "
                        f"dataset's split {show(split_part)} has {len(factory)}; is the dataset "
                        "being prepared again?"
                    )
                _write_lengths_file(factory, name, index_dir)
                return summary

            problem = index_fill_problem(raw_ds)
            if problem is None:
                job = _job(factory, label, raw_ds, write_index, split_part=split_part,
                           computed_by=computed_by, name=name, index_dir=index_dir, coord=coord,
                           tag=str(len(seen)))
                previous = (previous_index(_previous_candidates(job.target, index_dir),
                                           uuid=job.owner.dataset_uuid, computed_by=computed_by)
                            if reuse else None)
                try:
                    outcome = build_dataset(
                        job, coord, lambda raws: _results(raws, measure, workers),
                        previous=previous, progress=progress,
                        log=log if log is not None else logger.info)
                finally:
                    if previous is not None:
                        previous.close()
                built.append(BuiltIndex(label, outcome.summary, time.perf_counter() - t0,
                                        outcome.skipped, outcome.measured))
                continue
            if coord.distributed:  # the parts need shards read by byte range
                raise LengthIndexError(
                    f"length index of {label}: a distributed build reads each process's shards by "
                    f"byte range, but {problem}; build its index with one process."
                )
            advance = progress(label, len(factory)) if progress is not None else None
            skipped: list[str] = []
            summary = write_index(_measured(iter(raw_ds), measure, workers, advance, skipped))
            built.append(BuiltIndex(label, summary, time.perf_counter() - t0, skipped,
                                    summary.samples))
        return built
    except BaseException as e:
        coord.failed(str(e) or type(e).__name__)  # the other processes stop waiting
        raise


def _job(factory: Any, label: str, raw_ds: Any, write_index: Callable[..., IndexSummary], *,
         split_part: str, computed_by: str, name: str, index_dir: str | Path | None,
         coord: Coordinator, tag: str) -> DatasetJob:
    """What every process of the build knows of one dataset (its index folder created)."""
    folder = local_dataset_path(factory.path)
    target = index_path(folder, name, index_dir)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LengthIndexError(
            f"length index: cannot write {target} ({e}); write the index elsewhere with "
            "`energon-ordering index --index-dir DIR` and set OrderingConfig.length_index_dir = "
            "DIR."
        ) from e
    owner = PartOwner(package_version(), dataset_uuid(folder), split_part, computed_by,
                      coord.world_size, coord.rank)
    return DatasetJob(label, folder, target, loader_byte_reader(raw_ds), owner, tag, write_index)


def _previous_candidates(target: Path, index_dir: str | Path | None) -> list[Path]:
    """Where the index of the data before ``energon prepare`` ran again may be: the same file
    in ``.nv-meta``, or under ``--index-dir`` the same name in another ``index.uuid``'s folder."""
    if index_dir is None:
        return [target]
    return sorted(Path(index_dir).glob(f"*/{target.name}"))


def package_version() -> str:
    """This package's installed version (recorded in the parts of a distributed build)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("energon-ordering")
    except PackageNotFoundError:
        return "unknown"


def split_parts(dataset: Any) -> list[str] | None:
    """The split parts Energon knows for a loaded (meta)dataset: a metadataset's ``splits``, a
    prepared folder's ``split_parts`` in ``.nv-meta/split.yaml`` (or ``split.json``); None if
    they cannot be told."""
    splits = getattr(dataset, "splits", None)
    if isinstance(splits, Mapping):
        return [str(k) for k in splits]
    folder = getattr(dataset, "path", None)
    if folder is None or not hasattr(folder, "is_local") or not folder.is_local():
        return None
    meta = Path(folder.local_path()) / ".nv-meta"
    for name in (getattr(dataset, "split_config", None) or "split.yaml", "split.json"):
        try:
            parts = yaml.safe_load((meta / name).read_text()).get("split_parts")
        except (OSError, yaml.YAMLError, AttributeError):
            continue
        if isinstance(parts, Mapping):
            return [str(k) for k in parts]
    return None


def check_split_part(dataset: Any, path: str | Path, split_part: str) -> None:
    """Refuses a ``split_part`` the (meta)dataset does not have (Energon's own refusal is an
    ``assert`` or a ``KeyError`` deep in its loader: a 19-frame traceback)."""
    parts = split_parts(dataset)
    if parts is not None and split_part not in parts:
        raise LengthIndexError(
            f"length index of {path}: split_part = {show(split_part)} (--split-part) is not a "
            f"split of it; its splits are {show(parts)}. Index the split you train on "
            "(--split-part train)."
        )


def _write_lengths_file(factory: Any, name: str, index_dir: str | Path | None) -> None:
    """Writes the split's flat lengths file (:mod:`.lengths_file`) beside the new index, so
    that the first planned start maps it instead of joining (about 1 us per sample)."""
    from energon_ordering.length_index.lengths_file import indexed_lengths
    from energon_ordering.pool.byte_range_reader import ByteRangeReader

    folder = local_dataset_path(factory.path)
    index = LengthIndex.open(folder, name, index_dir=index_dir)
    reader = ByteRangeReader(folder, [(s.name, s.count) for s in factory.shards],
                             lengths=index.path, lengths_digest=index.digest)
    indexed_lengths(reader, factory.path)


def _describe(task_encoder: Any, raw_length_fn: Callable | None) -> str:
    if raw_length_fn is not None:
        return f"raw_length_fn {getattr(raw_length_fn, '__module__', '?')}." \
               f"{getattr(raw_length_fn, '__qualname__', repr(raw_length_fn))}"
    return task_encoder_label(task_encoder)
