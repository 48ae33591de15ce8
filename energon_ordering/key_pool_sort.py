"""KeyPoolSortDataset: the lean length pool that holds (restore key, length), never samples.

The encoded pool (:class:`~energon_ordering.length_pool_sort.LengthPoolSortDataset`) keeps every
pooled sample in memory: with decoded images that is megabytes per sample, which caps the pool
at ~1,000 samples per loader worker. This pool keeps only each sample's restore key and length
(~100 bytes) and re-fetches the sample through Energon's ``restore_sample`` random access when
it is emitted. Placed before decoding (``length_sort_placement = "pre-encode"``, see
:mod:`energon_ordering.deferred_load`), the incoming samples are still-compressed raw samples
and the re-fetch is one random read; decoding and encoding happen once, after the pool, in
emission order.

Same contracts as the encoded pool: the order comes from the same
:class:`~energon_ordering.pool_settings.PoolSettings` (rank-independent seed), so for the same
lengths both pools emit the identical sequence; the saved state holds restore keys and lengths
only, stamped with the settings and versions; exact resume for any cut point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset, get_sample_restore_key

from energon_ordering.errors import NotRestorableError, OrderingTypeError
from energon_ordering.pool_settings import PoolSettings, checked_length
from energon_ordering.restorability import explain_not_restorable
from energon_ordering.sample_length import sample_key
from energon_ordering.state_stamp import check_stamp, check_writer

__all__ = ["KeyPoolSortDataset"]

T_sample = TypeVar("T_sample")

#: Version of the key pool's saved-state layout and logic; bumped on any change that alters order.
STATE_VERSION = 1


class KeyPoolSortDataset(BaseWrapperDataset[T_sample, T_sample], Generic[T_sample]):
    """Pools ``pool_size`` (restore key, length) pairs, sorts them by length and re-fetches the
    samples in an order that is the same on every data-parallel rank.

    Memory per pooled sample is one restore key and one float, whatever the sample holds.
    Every sample is read twice (once to learn its key and length, once when emitted), so the
    stage below should be cheap to read: raw samples, before decoding.

    Checkpointing: the keys and lengths being collected, the keys not yet emitted (in emission
    order), the pool counter and a stamp of (state version, order version, pool settings). On
    restore nothing is re-fetched until it is emitted.
    """

    settings: PoolSettings
    key_fn: Callable[[Any], float]

    _pool_index: int
    _collect_keys: list[Any]
    _collect_lengths: list[float]
    _emit_keys: list[Any]
    _emit_pos: int
    _stamp: dict[str, Any]

    _savable_fields = ("_stamp", "_pool_index", "_collect_keys", "_collect_lengths", "_emit_keys")

    def __init__(
        self,
        dataset: SavableDataset[T_sample],
        *,
        pool_size: int,
        worker_config: WorkerConfig,
        key_fn: Callable[[Any], float],
        mode: str = "sample",
        batch_size: int | None = None,
        seed: int = 0,
    ):
        """Construct a KeyPoolSortDataset.

        Args:
            dataset: The samples to pool; must restore samples by key (it is asked to for
                every emitted sample).
            pool_size: Samples per pool, per loader worker (>= 1).
            worker_config: Energon's worker configuration.
            key_fn: Length of an incoming sample, in tokens (e.g. a length-index lookup).
            mode: ``"sample"`` or ``"batch"`` (see :mod:`energon_ordering.pool_order`).
            batch_size: Micro-batch size; required for ``mode="batch"``.
            seed: Ordering seed; must be the same on every data-parallel rank.
        """
        settings = PoolSettings(type(self).__name__, pool_size, mode, batch_size, seed)
        if not callable(key_fn):
            raise OrderingTypeError(
                f"KeyPoolSortDataset: key_fn = {key_fn!r} is not callable; pass a function "
                "sample -> length in tokens."
            )
        problem = explain_not_restorable(dataset)
        if problem is not None:
            raise problem
        super().__init__(dataset, worker_config=worker_config)
        self.settings = settings
        self.key_fn = key_fn
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self._stamp = self.settings.stamp(STATE_VERSION, holds="restore keys")
        self._pool_index = 0
        self._collect_keys = []
        self._collect_lengths = []
        self._emit_keys = []
        self._emit_pos = 0

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def _seal_pool(self) -> None:
        order = self.settings.order(
            self._collect_lengths, self._pool_index, self.worker_config.rank_worker_id()
        )
        self._emit_keys = [self._collect_keys[i] for i in order]
        self._emit_pos = 0
        self._collect_keys = []
        self._collect_lengths = []
        self._pool_index += 1

    def _drain(self) -> Iterator[T_sample]:
        while self._emit_pos < len(self._emit_keys):
            key = self._emit_keys[self._emit_pos]
            self._emit_pos += 1
            yield self.dataset.restore_sample(key)
        self._emit_keys = []
        self._emit_pos = 0

    def __iter__(self) -> Iterator[T_sample]:
        # A restored (or interrupted) pool finishes first, exactly where it stopped.
        yield from self._drain()
        for sample in self.dataset:
            key = get_sample_restore_key(sample)
            if key is None:
                raise NotRestorableError(
                    f"KeyPoolSortDataset: sample {sample_key(sample)!r} "
                    f"({type(sample).__name__}) has no __restore_key__, so it cannot be "
                    "re-fetched; pool Energon samples (dataclasses or dicts with a restore key)."
                )
            self._collect_lengths.append(checked_length(type(self).__name__, self.key_fn, sample))
            self._collect_keys.append(key)
            del sample
            if len(self._collect_keys) >= self.settings.pool_size:
                self._seal_pool()
                yield from self._drain()
        if self._collect_keys:
            self._seal_pool()
            yield from self._drain()

    def save_state(self) -> FlexState:
        state = super().save_state()
        # Only the keys not yet emitted are state; the emitted prefix is dropped.
        state["_emit_keys"] = state["_emit_keys"][self._emit_pos :]
        return state

    def restore_state(self, state: FlexState) -> None:
        check_writer(
            type(self).__name__,
            state,
            "Was it written with another OrderingConfig.length_sort_placement? Restore with the "
            "placement it was written with, or start the data stream fresh.",
        )
        check_stamp(
            type(self).__name__,
            state,
            self.settings.stamp(STATE_VERSION, holds="restore keys"),
            "Restore with the pool configuration the checkpoint was written with, or start the "
            "data stream fresh.",
        )
        super().restore_state(state)
        self._collect_keys = list(self._collect_keys)
        self._collect_lengths = list(self._collect_lengths)
        self._emit_keys = list(self._emit_keys)
        self._emit_pos = 0

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "dataset": self.dataset.config(),
            "pool_size": self.settings.pool_size,
            "mode": self.settings.mode,
            "batch_size": self.settings.batch_size,
            "key_fn": self._function_config(self.key_fn),
            "seed": self.settings.seed,
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        s = self.settings
        return (
            f"KeyPoolSortDataset(pool_size={s.pool_size}, mode={s.mode!r}, "
            f"batch_size={s.batch_size}, seed={s.seed}, dataset={self.dataset})"
        )
