"""KeyPoolSortDataset: the lean length pool, sorting (restore key, length) pairs.

The encoded pool (:class:`~energon_ordering.pool.length_pool_sort.LengthPoolSortDataset`) keeps every
pooled sample in memory: with decoded images that is megabytes per sample, which caps the pool
at ~1,000 samples per loader worker. This pool is placed before decoding
(``length_sort_placement = "pre-encode"``, see :mod:`energon_ordering.pool.deferred_load`), where
samples are still-compressed raw files, and keeps per sample its restore key and length plus,
with ``keep_samples=True``, the raw sample packed into one ``bytes`` object
(:class:`~energon_ordering.pool.packed_sample.SamplePacker`: no object for the garbage collector to
walk). Without it (keys only, ~130 bytes per sample) the sample is re-fetched through Energon's
``restore_sample`` random access when it is emitted. Decoding and encoding happen once, after the
pool, in emission order.

Same contracts as the encoded pool: the order comes from the same
:class:`~energon_ordering.pool.settings.PoolSettings` (rank-independent seed), so for the same
lengths both pools emit the identical sequence; the saved state holds restore keys and lengths
only, stamped with the settings and versions; exact resume for any cut point.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset

from energon_ordering.errors import OrderingTypeError
from energon_ordering.pool.packed_sample import SamplePacker
from energon_ordering.saved_counters import (
    check_saved_bool,
    check_saved_float,
    check_saved_int,
    check_saved_list,
)
from energon_ordering.pool.settings import (
    PoolSettings,
    check_pool_input,
    check_pool_state,
    checked_length,
    checked_restore_key,
)
from energon_ordering.errors import show

__all__ = ["KeyPoolSortDataset"]

T_sample = TypeVar("T_sample")

#: Version of the key pool's saved-state layout and logic; bumped on any change that alters order.
#: 3: pools may ramp (``ramp``; the size of pool k is ``settings.size_at(k)``).
STATE_VERSION = 3


class KeyPoolSortDataset(BaseWrapperDataset[T_sample, T_sample], Generic[T_sample]):
    """Pools ``pool_size`` (restore key, length) pairs, sorts them by length and re-fetches the
    samples in an order that is the same on every data-parallel rank.

    Memory per pooled sample: one restore key and one float, plus the packed sample with
    ``keep_samples``. Without it every sample is read twice (once to learn its key and length,
    once when emitted), so the stage below should be cheap to read: raw samples, before decoding.

    Checkpointing: the keys and lengths being collected, the keys not yet emitted (in emission
    order), the pool counter and a stamp of (state version, order version, pool settings); never
    the packed samples. After a restore the pooled samples are re-fetched by key as they are
    emitted, so ``keep_samples`` may differ between the run that saved and the one that restores.
    """

    settings: PoolSettings
    key_fn: Callable[[Any], float]

    _pool_index: int
    _collect_keys: list[Any]
    _collect_lengths: list[float]
    _emit_keys: list[Any]
    _emit_pos: int
    _collect_packed: list[bytes | None]
    _emit_packed: list[bytes | None]
    _inner_done: bool
    _stamp: dict[str, Any]
    #: Size of the pool being collected, ``settings.size_at(_pool_index)``; derived, not state.
    _filling_size: int

    _savable_fields = (
        "_stamp", "_pool_index", "_collect_keys", "_collect_lengths", "_emit_keys", "_inner_done"
    )

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
        keep_samples: bool = False,
        ramp: bool = False,
    ):
        """Construct a KeyPoolSortDataset.

        Args:
            dataset: The samples to pool; must restore samples by key (it is asked to for
                every emitted sample).
            pool_size: Samples per pool, per loader worker (>= 1).
            worker_config: Energon's worker configuration.
            key_fn: Length of an incoming sample, in tokens (e.g. a length-index lookup).
            mode: ``"sample"`` or ``"batch"`` (see :mod:`energon_ordering.pool.order`).
            batch_size: Micro-batch size; required for ``mode="batch"``.
            seed: Ordering seed; must be the same on every data-parallel rank.
            keep_samples: Also keep each pooled sample, packed (no second read on emission).
            ramp: The worker's first pools are smaller (1,000, 10,000, ... up to
                ``pool_size``; see :mod:`energon_ordering.pool.ramp`), so the first batch
                leaves after a small pool's fill.
        """
        settings = PoolSettings(type(self).__name__, pool_size, mode, batch_size, seed, ramp)
        if key_fn is None:
            raise OrderingTypeError(
                "KeyPoolSortDataset: key_fn = None; pass a function sample -> length in tokens "
                "(the pool cannot look at encoded samples)."
            )
        check_pool_input(type(self).__name__, dataset, key_fn)
        super().__init__(dataset, worker_config=worker_config)
        self.settings = settings
        self.key_fn = key_fn
        self.keep_samples = bool(keep_samples)
        self._packer = SamplePacker()
        self.reset_state_own()

    def _expected_stamp(self) -> dict[str, Any]:
        return self.settings.stamp(STATE_VERSION, holds="restore keys")

    def reset_state_own(self) -> None:
        self._stamp = self._expected_stamp()
        self._pool_index = 0
        self._filling_size = self.settings.size_at(0)
        self._inner_done = False
        self._collect_keys = []
        self._collect_lengths = []
        self._emit_keys = []
        self._emit_pos = 0
        self._collect_packed = []
        self._emit_packed = []

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def _seal_pool(self) -> None:
        order = self.settings.order(
            self._collect_lengths, self._pool_index, self.worker_config.rank_worker_id()
        )
        self._emit_keys = [self._collect_keys[i] for i in order]
        self._emit_packed = [self._collect_packed[i] for i in order]
        self._emit_pos = 0
        self._collect_keys = []
        self._collect_lengths = []
        self._collect_packed = []
        self._pool_index += 1
        self._filling_size = self.settings.size_at(self._pool_index)

    def _drain(self) -> Iterator[T_sample]:
        while self._emit_pos < len(self._emit_keys):
            pos = self._emit_pos
            self._emit_pos += 1
            packed, self._emit_packed[pos] = self._emit_packed[pos], None
            if packed is not None:
                yield self._packer.unpack(packed)
            else:
                yield self.dataset.restore_sample(self._emit_keys[pos])
        self._emit_keys = []
        self._emit_packed = []
        self._emit_pos = 0

    def __iter__(self) -> Iterator[T_sample]:
        # A restored (or interrupted) pool finishes first, exactly where it stopped.
        yield from self._drain()
        if not self._inner_done:
            yield from self._collect_and_emit()
        self._inner_done = False

    def _collect_and_emit(self) -> Iterator[T_sample]:
        for sample in self.dataset:
            key = checked_restore_key(type(self).__name__, sample)
            self._collect_lengths.append(checked_length(type(self).__name__, self.key_fn, sample))
            self._collect_keys.append(key)
            self._collect_packed.append(self._packer.pack(sample) if self.keep_samples else None)
            del sample
            if len(self._collect_keys) >= self._filling_size:
                self._seal_pool()
                yield from self._drain()
        # Saved: a state taken while the last pool drains must not iterate the inner dataset
        # again (a finished webdataset reader restores as a fresh epoch).
        self._inner_done = True
        if self._collect_keys:
            self._seal_pool()
            yield from self._drain()

    def save_state(self) -> FlexState:
        state = super().save_state()
        # Only the keys not yet emitted are state; the emitted prefix is dropped.
        state["_emit_keys"] = state["_emit_keys"][self._emit_pos :]
        return state

    def restore_state(self, state: FlexState) -> None:
        owner = type(self).__name__
        check_pool_state(owner, state, self._expected_stamp())
        check_saved_int(owner, "_pool_index", state.get("_pool_index"))
        check_saved_bool(owner, "_inner_done", state.get("_inner_done"))
        keys = check_saved_list(owner, "_collect_keys", state.get("_collect_keys"))
        lengths = check_saved_list(owner, "_collect_lengths", state.get("_collect_lengths"),
                                   length=len(keys))
        for i, length in enumerate(lengths):
            check_saved_float(owner, f"_collect_lengths[{i}]", length)
        check_saved_list(owner, "_emit_keys", state.get("_emit_keys"))
        super().restore_state(state)
        self._collect_keys = list(self._collect_keys)
        self._collect_lengths = list(self._collect_lengths)
        self._emit_keys = list(self._emit_keys)
        self._emit_pos = 0
        self._filling_size = self.settings.size_at(self._pool_index)
        # Packed samples are not state: the restored pool re-fetches its samples by key.
        self._collect_packed = [None] * len(self._collect_keys)
        self._emit_packed = [None] * len(self._emit_keys)

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "dataset": self.dataset.config(),
            **self.settings.config(self._function_config(self.key_fn)),
            "keep_samples": self.keep_samples,
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        s = self.settings
        return (
            f"KeyPoolSortDataset(pool_size={s.pool_size}, ramp={s.ramp}, mode={show(s.mode)}, "
            f"batch_size={s.batch_size}, seed={s.seed}, keep_samples={self.keep_samples}, "
            f"dataset={self.dataset})"
        )
