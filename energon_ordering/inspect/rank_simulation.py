"""Simulated data-parallel ranks: one real Energon pipeline per rank, stepped together.

Each rank gets its own ``WorkerConfig(rank=r, world_size=R, num_workers=W)`` and its own
``get_train_dataset`` + ``get_savable_loader`` over the same prepared dataset, exactly as R
training processes would build them. Used by the tests, the benchmarks and the demo.
"""

from __future__ import annotations

import gc
import itertools
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
from megatron.energon.wrappers.gc_dataset import GC_DEFAULT_EVERY_N_ITER

from energon_ordering.config import OrderingConfig
from energon_ordering.errors import OrderingConfigError, OrderingTypeError, show
from energon_ordering.state_stamp import PipelineStampDataset, restore_state_rank

__all__ = [
    "BatchRecord",
    "SIMULATION_GC",
    "TRAINING_GC",
    "build_train_loader",
    "close_loader",
    "lengths_by_step",
    "planned_window_steps",
    "record_batch",
    "resume",
    "run_ranks",
    "run_with_cuts",
]


@dataclass(frozen=True)
class BatchRecord:
    """What one rank saw in one micro-batch: sample keys, lengths (tokens) and sources.

    With packing, ``keys``, ``lengths`` and ``sources`` are per document, flattened over the
    packs in order, and ``pack_lengths`` holds each pack's document lengths (empty: not packed).
    """

    keys: tuple[str, ...]
    lengths: tuple[int, ...]
    sources: tuple[str, ...]
    pack_lengths: tuple[tuple[int, ...], ...] = ()


def _batch_field(batch: Any, name: str) -> Any:
    if isinstance(batch, Mapping):
        return batch.get(name)
    return getattr(batch, name, None)


def record_batch(batch: Any) -> BatchRecord:
    """Reads keys, lengths and sources of a batch (an object, or a dict from ``encode_batch``).

    Keys: ``keys``, else Energon's ``__keys__`` or ``__key__`` (Megatron-LM's multimodal
    ``encode_batch`` returns a dict with ``__key__``). Lengths: ``lengths``, else a per-sample
    ``total_len`` list (Energon's default batching of a ``total_len`` field), else none (empty).
    Sources: ``sources``, else the ``source`` subflavor of each sample, else none. Packs:
    ``pack_lengths`` (one list of document lengths per pack), else none.
    """
    keys = _batch_field(batch, "keys")
    if keys is None or callable(keys):
        keys = _batch_field(batch, "__keys__")
    if keys is None:
        keys = _batch_field(batch, "__key__")
    if keys is None:
        raise OrderingTypeError(
            f"record_batch: a {type(batch).__name__} batch has no keys (`keys`, `__keys__` or "
            "`__key__`); keep Energon's `__key__` in what encode_batch returns."
        )
    lengths = _batch_field(batch, "lengths")
    if lengths is None:
        lengths = _batch_field(batch, "total_len")
    lengths = lengths.tolist() if hasattr(lengths, "tolist") else lengths
    sources = _batch_field(batch, "sources")
    if sources is None:
        subflavors = _batch_field(batch, "__subflavors__") or []
        sources = [(s or {}).get("source", "-") for s in subflavors] if isinstance(subflavors, list) else []
    packs = _batch_field(batch, "pack_lengths")
    return BatchRecord(
        tuple(keys),
        tuple(int(x) for x in (lengths or ())),
        tuple(sources),
        tuple(tuple(int(x) for x in p) for p in (packs or ())),
    )


#: Energon's garbage collection as a simulated loader sets it: off. Energon's default runs a full
#: ``gc.collect()`` at every iteration start (in each loader worker, before ``gc.freeze()``) and
#: one every 10 batches, to bound memory in a long training loop; in a process holding torch,
#: Energon and many short-lived loaders each full collection took 0.1-0.4 s in process (half the
#: time of a resume test) and 0.8 s more per 2-worker loader. Neither changes the order or the
#: samples; the saved state then lacks Energon's ``GcDataset`` level, so it restores into loaders
#: built the same way (every simulated loader is; a timed one with :data:`TRAINING_GC` keeps its
#: own states). A process that forks loader workers must not leave fork-unsafe objects (a destroyed
#: torch.distributed process group) as uncollected garbage, with or without it: the worker's first
#: collection (Energon's at its start, or Python's own later) would finalise them there
#: (tests/gloo_group.py).
SIMULATION_GC: dict[str, Any] = {"gc_collect_every_n_steps": 0}
#: Energon's default garbage collection, as a training loader has it: for loaders whose time is
#: measured (first batch, samples/s), pass ``**TRAINING_GC`` to :func:`build_train_loader`.
TRAINING_GC: dict[str, Any] = {"gc_collect_every_n_steps": GC_DEFAULT_EVERY_N_ITER}


def build_train_loader(
    path: str | Path,
    *,
    ordering: OrderingConfig,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    batch_size: int = 4,
    shuffle_buffer_size: int | None = 32,
    max_samples_per_sequence: int | None = 16,
    repeat: bool = True,
    task_encoder_factory: Callable[[], Any] | None = None,
    packing_buffer_size: int | None = None,
    **loader_kwargs: Any,
):
    """Builds rank ``rank``'s training loader the way a training process would.

    Args:
        path: Prepared dataset or metadataset.
        ordering: The ordering configuration set on the task encoder.
        rank: Data-parallel rank.
        world_size: Data-parallel size.
        num_workers: Loader worker processes per rank (0 = in-process).
        batch_size: Micro-batch size, in samples.
        shuffle_buffer_size: Energon's per-rank sample shuffle buffer (None = off).
        max_samples_per_sequence: Energon's shard-slice length.
        repeat: Repeat the data (False = one finite epoch).
        task_encoder_factory: Returns a fresh task encoder with the OrderingTaskEncoder mixin;
            default :class:`energon_ordering.inspect.synthetic_task.SyntheticTaskEncoder`.
        packing_buffer_size: ``get_train_dataset``'s (sequence packing; None: as the ordering
            configuration says).
        **loader_kwargs: Passed to ``get_savable_loader`` (over :data:`SIMULATION_GC`).
    """
    ds = _train_dataset(path, ordering, rank, world_size, num_workers, batch_size,
                        shuffle_buffer_size, max_samples_per_sequence, repeat,
                        task_encoder_factory, packing_buffer_size)
    loader = get_savable_loader(ds, **{**SIMULATION_GC, **loader_kwargs})
    if not _has_accelerator():
        # Energon always asks torch to pin batches; without a GPU there is nothing to pin to
        # and torch warns at every iterator it creates.
        loader.pin_memory = False
    return loader


def _train_dataset(path: str | Path, ordering: OrderingConfig, rank: int, world_size: int,
                   num_workers: int, batch_size: int, shuffle_buffer_size: int | None,
                   max_samples_per_sequence: int | None, repeat: bool,
                   task_encoder_factory: Callable[[], Any] | None,
                   packing_buffer_size: int | None) -> Any:
    """Energon's ``get_train_dataset`` as :func:`build_train_loader` calls it."""
    if task_encoder_factory is None:
        from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder

        task_encoder_factory = SyntheticTaskEncoder
    te = task_encoder_factory()
    te.ordering = ordering
    wc = WorkerConfig(rank=rank, world_size=world_size, num_workers=num_workers)
    return get_train_dataset(
        path,
        batch_size=batch_size,
        worker_config=wc,
        task_encoder=te,
        shuffle_buffer_size=shuffle_buffer_size,
        max_samples_per_sequence=max_samples_per_sequence,
        repeat=repeat,
        **({} if packing_buffer_size is None else {"packing_buffer_size": packing_buffer_size}),
    )


def planned_window_steps(path: str | Path, ordering: OrderingConfig, *, world_size: int,
                         batch_size: int, task_encoder_factory: Callable[[], Any] | None = None,
                         packing_buffer_size: int | None = None, repeat: bool = True) -> int:
    """K, the steps of a plan window, as the planned order's build settles it and stamps it
    (a default reads the length index: on repeating data no window draws a source beyond its
    size, and short samples make a packed window hold fewer packs), read off rank 0's
    pipeline; nothing is iterated."""
    node = _train_dataset(path, ordering, 0, world_size, 0, batch_size, None, None, repeat,
                          task_encoder_factory, packing_buffer_size)
    while not isinstance(node, PipelineStampDataset):
        node = getattr(node, "dataset", None)
        if node is None:
            raise OrderingConfigError(
                f"planned_window_steps: the pipeline of {show(str(path))} carries no state stamp "
                "(build it with an OrderingTaskEncoder in length_sort_mode = 'planned').")
    return int(node.stamp["plan_window_steps"])


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


@contextmanager
def _fast_worker_shutdown(seconds: float = 0.2) -> Iterator[None]:
    # torch joins each loader worker for MP_STATUS_CHECK_INTERVAL (5 s) before terminating it,
    # and Energon's workers do not exit on their own before that; a simulation that builds
    # dozens of short-lived loaders would spend most of its time there.
    import torch.utils.data._utils as torch_data_utils

    saved = torch_data_utils.MP_STATUS_CHECK_INTERVAL
    torch_data_utils.MP_STATUS_CHECK_INTERVAL = seconds
    try:
        yield
    finally:
        torch_data_utils.MP_STATUS_CHECK_INTERVAL = saved


def close_loader(loader: Any) -> None:
    """Stops a loader's worker processes now (instead of after torch's 5 s join timeout).

    Only for short-lived loaders of simulations and tests; the caller must drop every other
    reference to the loader and its iterators first.
    """
    with _fast_worker_shutdown():
        it = getattr(loader, "_epoch_iterator", None)
        if it is not None:
            it.close()
        loader._epoch_iterator = None
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        had_workers = iterator is not None and hasattr(iterator, "_shutdown_workers")
        del it, iterator
        if had_workers:
            # drop the workers' last references now; an in-process loader has none to drop
            gc.collect()
    close_readers(getattr(loader, "dataset", None))


# Classes whose ``close()`` releases a reader's open files and connections (Energon's tar and
# index readers keep their shards open, and something outside the loader keeps them alive: an
# in-process loader that is only dropped leaves about 20 descriptors per loader open).
def _reader_types() -> tuple[type, ...]:
    from megatron.energon.flavors.webdataset.itar_reader import ITarReader

    from energon_ordering.pipeline.planned_source import PlannedSourceDataset
    from energon_ordering.pool.byte_range_reader import ByteRangeReader

    return (ITarReader, ByteRangeReader, PlannedSourceDataset)


def close_readers(root: Any, limit: int = 100_000) -> int:
    """Closes the readers inside a dropped loader's dataset (what :func:`close_loader` does
    last): walks the objects the dataset holds (Energon's and this package's, and their lists,
    tuples and dicts) and calls ``close()`` on Energon's tar readers, byte-range readers and the
    planned source (its prefetch threads), and empties Energon's caches of ``.tar.idx`` readers.
    A closed reader reopens on its next read, so a reader shared with a live loader keeps
    working. Returns the number of readers closed."""
    if root is None:
        return 0
    types_ = _reader_types()
    seen: set[int] = set()
    stack = [root]
    closed = 0
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types_):
            try:
                obj.close()
                closed += 1
            except Exception:  # noqa: BLE001 - best effort: a reader already closed
                pass
        cache = getattr(obj, "tar_index_reader_cache", None)  # Energon's .tar.idx readers
        if isinstance(cache, dict):
            for entry in list(cache.values()):
                entry.tar_index_reader.close()
                closed += 1
            cache.clear()  # looked up again, they are opened again
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif type(obj).__module__.startswith(("megatron.energon", "energon_ordering")):
            try:
                stack.extend(vars(obj).values())
            except TypeError:
                pass
    return closed


def run_ranks(
    path: str | Path,
    *,
    ordering: OrderingConfig,
    world_size: int,
    steps: int | None,
    num_workers: int = 0,
    progress: Callable[[Iterable[int]], Iterable[int]] = lambda ranks: ranks,
    **kwargs: Any,
) -> list[list[BatchRecord]]:
    """Runs ``world_size`` rank pipelines for ``steps`` micro-batches each.

    Ranks are run one after the other (their pipelines are independent by construction, as in
    a real job), so memory stays that of one rank. ``steps=None`` runs one finite epoch
    (pass ``repeat=False``). ``progress`` wraps the iteration over ranks (e.g. a progress bar);
    ``kwargs`` go to :func:`build_train_loader`.

    Returns:
        ``records[rank][step]``.
    """
    records: list[list[BatchRecord]] = []
    for rank in progress(range(world_size)):
        loader = build_train_loader(
            path,
            ordering=ordering,
            rank=rank,
            world_size=world_size,
            num_workers=num_workers,
            **kwargs,
        )
        records.append([record_batch(b) for b in itertools.islice(loader, steps)])
        close_loader(loader)
    return records


def lengths_by_step(records: list[list[BatchRecord]]) -> list[list[tuple[int, ...]]]:
    """``records[rank][step]`` -> ``lengths[step][rank]`` over the steps every rank ran."""
    steps = min(len(r) for r in records)
    return [[rank[s].lengths for rank in records] for s in range(steps)]


def run_with_cuts(
    make_loader: Callable[[], Any],
    total: int,
    cuts: Iterable[int],
    record: Callable[[Any], Any] = record_batch,
) -> tuple[list[Any], dict[int, Any]]:
    """Uninterrupted run of ``total`` micro-batches; returns their records and, for every cut,
    the (pickled and reloaded) ``save_state_rank()`` taken before micro-batch ``cut``."""
    cuts = set(cuts)
    loader = make_loader()
    records, states, it = [], {}, None
    for step in range(total):
        if step in cuts:
            states[step] = pickle.loads(pickle.dumps(loader.save_state_rank()))
        if it is None:
            # Energon's save_state_rank() hangs if called between iter() and the first next()
            # with worker processes, so the iterator is created after the cut-0 save.
            it = iter(loader)
        records.append(record(next(it)))
    del it
    close_loader(loader)
    return records, states


def run_saving_every_step(
    make_loader: Callable[[], Any],
    steps: int | None = None,
    record: Callable[[Any], Any] = record_batch,
) -> tuple[list[Any], list[bytes]]:
    """``steps`` micro-batches (None: the whole finite epoch) with the pickled
    ``save_state_rank()`` taken before each one; a finite epoch also gets the state after its
    last micro-batch, so ``states[i]`` resumes with ``records[i:]`` for every i."""
    loader = make_loader()
    records: list[Any] = []
    states: list[bytes] = []
    it = None
    for _ in itertools.count() if steps is None else range(steps):
        states.append(pickle.dumps(loader.save_state_rank()))
        if it is None:
            it = iter(loader)  # after the first save: see run_with_cuts
        try:
            records.append(record(next(it)))
        except StopIteration:
            break
    del it
    close_loader(loader)
    return records, states


def resume(
    make_loader: Callable[[], Any],
    state: Any,
    steps: int,
    record: Callable[[Any], Any] = record_batch,
) -> list[Any]:
    """A fresh loader restored from ``state`` (checked first, see
    :func:`energon_ordering.state_stamp.check_loader_state`), run for ``steps`` micro-batches."""
    loader = make_loader()
    restore_state_rank(loader, state)
    it = iter(loader)
    records = [record(next(it)) for _ in range(steps)]
    del it
    close_loader(loader)
    return records
