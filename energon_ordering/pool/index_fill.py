"""Filling a key pool from the indexes: Energon's visiting order, no payload read.

A key pool (:class:`~energon_ordering.pool.key_pool_sort.KeyPoolSortDataset`, ``holds = "keys"``)
keeps only each sample's restore key and length, and fetches the sample again when it is
emitted. When the lengths come from a length index, the fill needs nothing but the sample keys,
and the keys are in Energon's ``.nv-meta/index.sqlite``; the payload read during the fill is
wasted (4.9 s for a pool of 10,000 before this module).

Which samples arrive, in which order, is decided by Energon's
:class:`~megatron.energon.flavors.webdataset.sample_loader.WebdatasetSampleLoaderDataset`: a pure
function of its slice plan (``workers_slice_offsets``) and its worker RNG (slice shuffle, then a
size-weighted random choice among ``parallel_slice_iters`` open slices per sample).
:class:`IndexFilledLoader` is that loader with the same slice plan, RNG, saved state and restore
keys; it changes what a visit reads:

- while iterating, a visit reads the sample's key from the index (fetched in blocks of
  neighbouring samples, cached): a key-only ``FilteredSample`` with ``__key__``, ``__shard__`` and
  ``__restore_key__``, and the sample's length when the source's length index is given (joined
  into the same block read);
- ``restore_sample`` (how the pool fetches a sample when it emits it, and how every buffer is
  refilled after a restore) reads the full sample with one ``pread`` of its byte range
  (:class:`~energon_ordering.pool.byte_range_reader.ByteRangeReader`), equal to what Energon's
  reader returns.

The RNG draws, the saved state and the restore keys are Energon's, so the pool sees the identical
sequence of (restore key, length) and emits the identical sequence; resume is Energon's. Samples
that ``sample_filter`` (split excludes) drops are dropped during the walk exactly as Energon does.

For a pool of 100,000 to start in about two seconds, the walk itself is made cheaper without
changing a draw (Energon's per-sample walk cost 16 of the 27 microseconds a sample took to reach
the pool):

- :class:`FastChoiceRng` replaces the worker RNG: the same uniform numbers from the same
  generator (drawn in blocks, the generator set back whenever anything else uses it) and the
  same float32 arithmetic as ``WorkerRng.choice_idx``, with ``bisect`` on cached cumulative
  weights instead of three tensor operations per sample;
- :meth:`IndexFilledLoader._slices_iter` re-states Energon 7.4's walk step for step, keeping the
  number of open slices as a count instead of a tensor reduction per sample.

``tests/test_index_fill.py`` holds both to Energon: the walk against Energon's own loader (every
shuffle mode, 1 to 16 parallel slices, several epochs, the saved state at every save point and a
resume from it), the RNG against ``WorkerRng``, and the pool's emitted sequence against the
payload-reading fill, so a change in Energon's walk is caught.

Only valid where nothing between the loader and the pool looks at the payload: the task
encoder uses it for sources whose lengths come from a length index, with ``holds = "keys"``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader
from megatron.energon.flavors.webdataset.sample_loader import (
    RawSampleData,
    SliceState,
    WebdatasetSampleLoaderDataset,
)

from megatron.energon.rng import WorkerRng
from megatron.energon.state import FlexState

from energon_ordering.errors import OrderingConfigError, show
from energon_ordering.sqlite_file import connect_readonly
from energon_ordering.pool.byte_range_reader import ByteRangeReader, energon_index_path
from energon_ordering.pool.deferred_load import INDEXED_LENGTH_FIELD

__all__ = [
    "FastChoiceRng", "IndexFilledLoader", "index_fill_problem", "index_filled", "loader_byte_reader",
]

_ENERGON_LOADER = WebdatasetSampleLoaderDataset.__name__


def index_fill_problem(loader: WebdatasetSampleLoaderDataset) -> str | None:
    """Why ``loader`` cannot be filled from the indexes, or None if it can."""
    if len(loader.join_readers) != 1:
        return f"it joins {len(loader.join_readers)} datasets"
    reader = loader.join_readers[0]
    if not isinstance(reader, ShardInfosITarReader):
        return f"its reader is a {type(reader).__name__}, not a ShardInfosITarReader"
    if not reader.base_path.is_local():
        return f"{reader.base_path} is not on a local file system"
    index = energon_index_path(reader.base_path.local_path())
    if not index.is_file():
        return f"{reader.base_path} has no .nv-meta/index.sqlite"
    con = connect_readonly(index)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        con.close()
    if not {"samples", "sample_parts"} <= tables:
        return f"{index} has no byte ranges per part (prepared by an older Energon)"
    return None


#: Uniform numbers :class:`FastChoiceRng` draws from the worker generator at a time.
DRAW_BLOCK = 512


class FastChoiceRng(WorkerRng):
    """Energon's worker RNG with a faster, identical ``choice_idx``.

    Energon's ``choice_idx(probs)`` computes ``cdf = cumsum(probs)`` (float32), draws
    ``u = torch.rand(1)`` from the worker generator and returns
    ``searchsorted(cdf, u * cdf[-1], right=True)``. This makes the same draws and the same
    float32 arithmetic, but

    - recomputes ``cdf`` only when ``probs`` was changed in place (its tensor version counter
      moved) and searches it with :func:`bisect.bisect_right`;
    - draws the uniform numbers :data:`DRAW_BLOCK` at a time (``torch.rand(n)`` yields the
      same numbers as ``n`` calls of ``torch.rand(1)`` on CPU, and leaves the generator in the
      same state). Whenever anything else uses the generator (``randbelow``, ``shuffle``,
      ``save_state``, ...: all go through :attr:`rng`), it is first set back to just after the
      numbers used so far.

    Same draws, same generator state, same saved state as Energon's ``WorkerRng``
    (``tests/test_index_fill.py`` checks all three against it).
    """

    _probs: torch.Tensor | None = None
    _probs_version: int = -1
    _cdf: list[float]
    _total: np.float32
    _block: list[float] | None = None
    _block_pos: int = 0
    _block_start: torch.Tensor | None = None

    @property
    def rng(self) -> torch.Generator:
        generator = WorkerRng.rng.fget(self)
        if self._block is not None:
            self._settle(generator)
        return generator

    def _settle(self, generator: torch.Generator) -> None:
        """Sets ``generator`` to just after the block numbers used so far; drops the block."""
        block, used = self._block, self._block_pos
        self._block = None
        if block is not None and used < len(block):
            generator.set_state(self._block_start)
            if used:
                torch.rand(used, generator=generator)

    def _uniform(self) -> float:
        block = self._block
        if block is None or self._block_pos >= len(block):
            self._block = None  # used up: the generator is exactly past it
            generator = WorkerRng.rng.fget(self)
            self._block_start = generator.get_state()
            block = self._block = torch.rand(DRAW_BLOCK, generator=generator).tolist()
            self._block_pos = 0
        u = block[self._block_pos]
        self._block_pos += 1
        return u

    def choice_idx(self, probs: torch.Tensor) -> int:
        if probs is not self._probs or probs._version != self._probs_version:
            cdf = torch.cumsum(probs, dim=0)
            self._cdf = cdf.tolist()
            self._total = np.float32(self._cdf[-1])
            self._probs, self._probs_version = probs, probs._version
        if len(self._cdf) == 1:
            return 0  # as Energon: one slice iterator, no draw
        return bisect_right(self._cdf, float(np.float32(self._uniform()) * self._total))

    def restore_state(self, state: FlexState) -> None:
        self._block = None  # the generator is replaced, not continued
        super().restore_state(state)


class IndexFilledLoader(WebdatasetSampleLoaderDataset):
    """Energon's sample loader whose iteration yields key-only samples (no payload read) and
    whose ``restore_sample`` reads a sample from its byte range.

    Same slice plan, RNG, state and restore keys as the loader it is built from; see the
    module docstring. Build it with :func:`index_filled`.
    """

    def __init__(self, loader: WebdatasetSampleLoaderDataset, reader: ByteRangeReader):
        """Construct an IndexFilledLoader.

        Args:
            loader: Energon's loader of one prepared dataset (see :func:`index_fill_problem`).
            reader: Byte-range access to the same shards, in the same order.
        """
        super().__init__(
            loader.join_readers,
            loader.workers_slice_offsets,
            worker_config=loader.worker_config,
            shuffle_over_epochs=loader.shuffle_over_epochs,
            parallel_slice_iters=loader.parallel_slice_iters,
        )
        self.byte_reader = reader

    def reset_state_own(self) -> None:
        super().reset_state_own()
        self._worker_rng = FastChoiceRng(self.worker_config)

    def _slices_iter(self) -> Generator[RawSampleData, None, None]:
        """Energon 7.4's walk (``WebdatasetSampleLoaderDataset._slices_iter``), step for step:
        the same slice plan, draws, state fields and counters. It differs in bookkeeping only:
        the number of slices left is a Python count kept as slices end, where Energon counts the
        non-zero weights of a tensor per sample, and the per-sample debug-log checks are made
        once. With Energon's debug logging on, Energon's own walk runs."""
        wc = self.worker_config
        if wc.should_log(level=1) or wc.should_log(level=2):
            yield from super()._slices_iter()
            return
        offsets = self.slice_offsets
        assert offsets is not None
        probs = torch.zeros(self.parallel_slice_iters, dtype=torch.float32)
        active = self._active_slice_state
        pending = self._pending_slice_indexes
        if any(s is not None for s in active) or self._pending_slices_offset is not None:
            # Resuming an epoch.
            if pending is None:
                pending = self._slices_once()
            assert len(active) == self.parallel_slice_iters
            for idx, state in enumerate(active):
                if state is not None:
                    probs[idx] = offsets[state.index + 1] - offsets[state.index]
        else:
            # A new epoch.
            assert pending is None
            pending = self._slices_once()
            assert self._pending_slices_offset is not None
            active.clear()
            while len(pending) > 0 and len(active) < self.parallel_slice_iters:
                index = pending.pop()
                self._pending_slices_offset += 1
                probs[len(active)] = offsets[index + 1] - offsets[index]
                active.append(SliceState(index=index, current=offsets[index]))
            active.extend([None] * (self.parallel_slice_iters - len(active)))
        left = int(torch.count_nonzero(probs).item())
        shuffle = self.shuffle_over_epochs
        if shuffle is None:
            assert self.parallel_slice_iters == 1
        rng = self._worker_rng
        get_sample = self._get_sample
        while left > 0:
            slice_idx = 0 if shuffle is None else rng.choice_idx(probs)
            state = active[slice_idx]
            assert state is not None
            sample = get_sample(state.current)
            state.current += 1
            self._sample_count += 1
            self._epoch_sample_count += 1
            if state.current >= offsets[state.index + 1]:
                # The slice ended: the next one (without replacement), a random one (with
                # replacement), or none.
                if len(pending) > 0 or shuffle == -1:
                    if len(pending) > 0:
                        index = pending.pop()
                        self._pending_slices_offset += 1
                    else:
                        index = rng.randbelow(len(offsets) - 1)
                    size = offsets[index + 1] - offsets[index]
                    probs[slice_idx] = size
                    active[slice_idx] = SliceState(index=index, current=offsets[index])
                    if size == 0:
                        left -= 1
                else:
                    probs[slice_idx] = 0
                    active[slice_idx] = None
                    left -= 1
            if sample.data[0] is not None:
                yield sample
                del sample
        # The epoch has ended: reset as Energon does.
        self._epoch_count += 1
        self._epoch_sample_count = 0
        self._pending_slice_indexes = None
        self._pending_slices_offset = None

    def _get_sample(self, index: int) -> RawSampleData:
        # Called by Energon's walk for every visited sample: the key, no payload.
        reader = self.byte_reader
        shard, key, length = reader.visit(index)
        keep = reader.sample_filter is None or reader.sample_filter(f"{shard}/{key}")
        sample = (
            {"__key__": key, "__shard__": shard, "__restore_key__": ("Webdataset", index),
             "__sources__": (), INDEXED_LENGTH_FIELD: length}
            if keep
            else None
        )
        return RawSampleData(__restore_key__=("Webdataset", index), data=(sample,))

    def restore_sample(self, restore_key: tuple[Any, ...]) -> RawSampleData:
        kind, index = restore_key
        if kind != "Webdataset" or not isinstance(index, int):
            raise OrderingConfigError(
                f"IndexFilledLoader: restore key {show(restore_key)} is not ('Webdataset', index)."
            )
        return RawSampleData(
            __restore_key__=("Webdataset", index), data=(self.byte_reader.read(index),)
        )

    def save_state(self) -> FlexState:
        # The state is Energon's loader state, field for field: written under Energon's class
        # name, so a checkpoint restores into either loader (e.g. after switching what the pool
        # holds, which switches the index fill on or off).
        state = super().save_state()
        state["__class__"] = _ENERGON_LOADER
        return state

    def restore_state(self, state: FlexState) -> None:
        if state is not None and state.get("__class__") == _ENERGON_LOADER:
            state = FlexState(**{**state, "__class__": type(self).__name__})
        super().restore_state(state)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "fill": "index", "reader": "byte-range"}

    def __str__(self) -> str:
        return f"IndexFilledLoader({self.byte_reader}, parallel_slice_iters={self.parallel_slice_iters})"


def index_filled(
    loader: WebdatasetSampleLoaderDataset,
    lengths: Path | None = None,
    lengths_digest: str | None = None,
) -> IndexFilledLoader:
    """``loader`` filled from the indexes.

    Args:
        loader: Energon's loader of one prepared dataset.
        lengths: The source's length index file: its lengths ride along with the keys (in the
            key-only sample's :data:`~energon_ordering.pool.deferred_load.INDEXED_LENGTH_FIELD`),
            so the pool looks nothing up per sample.
        lengths_digest: That index's content digest when the job opened it.

    Raises:
        OrderingConfigError: :func:`index_fill_problem` names a reason it cannot be.
    """
    problem = index_fill_problem(loader)
    if problem is not None:
        raise OrderingConfigError(
            f"index fill: cannot fill from the indexes of {loader}: {problem}."
        )
    return IndexFilledLoader(loader, loader_byte_reader(loader, lengths, lengths_digest))


def raw_sample_at(reader: ByteRangeReader, index: int) -> RawSampleData | None:
    """Sample ``index`` read by byte range, as Energon's loader yields it (its restore key
    ``("Webdataset", index)``), or None if the reader's sample filter excludes it."""
    sample = reader.read(index)
    if sample is None:
        return None
    return RawSampleData(__restore_key__=("Webdataset", index), data=(sample,))


def loader_byte_reader(
    loader: WebdatasetSampleLoaderDataset,
    lengths: Path | None = None,
    lengths_digest: str | None = None,
    cache_shards: int | None = None,
) -> ByteRangeReader:
    """Byte-range access to the samples of ``loader``'s shards, in its reader's order, with its
    part and sample filters (``loader`` must pass :func:`index_fill_problem`)."""
    reader = loader.join_readers[0]
    return ByteRangeReader(
        reader.base_path.local_path(),
        [(shard.name, shard.count) for shard in reader.shard_infos],
        part_filter=reader.part_filter,
        sample_filter=reader.sample_filter,
        cache_shards=cache_shards or max(4, 2 * loader.parallel_slice_iters),
        lengths=lengths,
        lengths_digest=lengths_digest,
    )
