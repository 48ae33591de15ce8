"""LengthPoolSortDataset: pool encoded samples, sort by length, permute identically on all ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset
from megatron.energon.wrappers.buffer import SavableSampleBuffer

from energon_ordering.pool.settings import (
    PoolSettings,
    check_pool_input,
    check_pool_state,
    checked_length,
    checked_restore_key,
)
from energon_ordering.pool.sample_length import default_sample_length
from energon_ordering.saved_counters import check_saved_bool, check_saved_int
from energon_ordering.errors import show

__all__ = ["LengthPoolSortDataset"]

T_sample = TypeVar("T_sample")

#: Version of the pool's saved-state layout and logic; bumped on any change that alters order.
#: 3: pools may ramp (``ramp``; the size of pool k is ``settings.size_at(k)``).
STATE_VERSION = 3


class LengthPoolSortDataset(BaseWrapperDataset[T_sample, T_sample], Generic[T_sample]):
    """Pools ``pool_size`` samples, sorts them by length and emits them in an order that is the
    same on every data-parallel rank, so that all ranks process similar lengths at each step.

    Place it after ``encode_sample`` and before batching (``OrderingTaskEncoder`` does). The
    emission order of a pool comes from :mod:`energon_ordering.pool.order`: ``mode="sample"``
    permutes the sorted samples, ``mode="batch"`` permutes sorted chunks of ``batch_size``.

    Deterministic: the permutation seed is a pure function of (``seed``, pool index, loader worker
    slot) and never of the rank, so worker w's k-th pool is permuted identically on every rank,
    and Energon's loader (batch b from worker ``b % num_workers`` on every rank) keeps the ranks
    aligned for any number of workers. Ties in length keep their arrival order.

    Checkpointing: the samples being collected and those not yet emitted (in emission order) are
    saved as restore keys through Energon's :class:`SavableSampleBuffer`, plus the pool counter
    and a stamp of (state version, order version, pool_size, mode, batch_size, seed). On restore
    the samples are re-created with ``restore_sample``, which re-runs the pipeline below the pool;
    that is why everything below must be restorable (``encode_sample`` marked ``@stateless``),
    which is checked here at construction.

    Finite: yields exactly the samples of the inner dataset, each once; when the inner dataset
    ends, the last partial pool is sorted and permuted too, and the saved state records that the
    inner dataset has ended, so a state saved inside the last pool resumes with exactly the
    remainder. Repeating if the inner one repeats.
    """

    pool_size: int
    mode: str
    batch_size: int | None
    key_fn: Callable[[Any], float]
    seed: int

    _pool_index: int
    _collecting: SavableSampleBuffer[T_sample]
    _emitting: SavableSampleBuffer[T_sample]
    _inner_done: bool
    _stamp: dict[str, Any]

    _savable_fields = ("_stamp", "_pool_index", "_collecting", "_emitting", "_inner_done")

    def __init__(
        self,
        dataset: SavableDataset[T_sample],
        *,
        pool_size: int,
        worker_config: WorkerConfig,
        mode: str = "sample",
        batch_size: int | None = None,
        key_fn: Callable[[Any], float] | None = None,
        seed: int = 0,
        ramp: bool = False,
    ):
        """Construct a LengthPoolSortDataset.

        Args:
            dataset: The encoded samples to pool (must be able to restore samples by key).
            pool_size: Samples per pool, per loader worker (>= 1).
            worker_config: Energon's worker configuration.
            mode: ``"sample"`` or ``"batch"`` (see :mod:`energon_ordering.pool.order`).
            batch_size: Micro-batch size in samples; required for ``mode="batch"``, where
                ``pool_size`` must be a multiple of it.
            key_fn: Length of a sample, in tokens. ``None`` uses ``sample.total_len`` if present,
                else ``len(sample.tokens)``.
            seed: Ordering seed; must be the same on every data-parallel rank.
            ramp: The worker's first pools are smaller (1,000, 10,000, ... up to
                ``pool_size``; see :mod:`energon_ordering.pool.ramp`).
        """
        settings = PoolSettings("LengthPoolSortDataset", pool_size, mode, batch_size, seed, ramp)
        check_pool_input(type(self).__name__, dataset, key_fn)
        super().__init__(dataset, worker_config=worker_config)
        self.settings = settings
        self.pool_size = settings.pool_size
        self.mode = settings.mode
        self.batch_size = settings.batch_size
        self.key_fn = default_sample_length if key_fn is None else key_fn
        self.seed = settings.seed
        self.reset_state_own()

    def _expected_stamp(self) -> dict[str, Any]:
        return self.settings.stamp(STATE_VERSION)

    def reset_state_own(self) -> None:
        self._stamp = self._expected_stamp()
        self._pool_index = 0
        self._inner_done = False
        self._collecting = SavableSampleBuffer(self.dataset, worker_config=self.worker_config)
        self._emitting = SavableSampleBuffer(self.dataset, worker_config=self.worker_config)

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def _seal_pool(self) -> None:
        """Moves the collected samples into the emission buffer, in this pool's order."""
        lengths = [checked_length(type(self).__name__, self.key_fn, s)
                   for s in self._collecting.buffer]
        order = self._pool_order(lengths)
        samples, restore_keys = self._collecting.flush()
        self._emitting.extend([samples[i] for i in order], [restore_keys[i] for i in order])
        self._pool_index += 1

    def _pool_order(self, lengths: list[float]) -> list[int]:
        """Emission order (arrival indices) of the pool being sealed, from its keys."""
        return self.settings.order(lengths, self._pool_index, self.worker_config.rank_worker_id())

    def _drain(self) -> Iterator[T_sample]:
        while self._emitting.len_worker() > 0:
            yield self._emitting.pop(0)

    def __iter__(self) -> Iterator[T_sample]:
        self._collecting.worker_start()
        self._emitting.worker_start()
        # A restored (or interrupted) pool finishes first, exactly where it stopped.
        yield from self._drain()
        if not self._inner_done:
            for sample in self._collecting.append_iter():
                checked_restore_key(type(self).__name__, sample)
                if self._collecting.len_worker() >= self.settings.size_at(self._pool_index):
                    self._seal_pool()
                    yield from self._drain()
            # Saved: a state taken while the last pool drains must not iterate the inner dataset
            # again (a finished webdataset reader restores as a fresh epoch).
            self._inner_done = True
            if self._collecting.len_worker() > 0:
                self._seal_pool()
                yield from self._drain()
        self._inner_done = False

    def restore_state(self, state: FlexState) -> None:
        owner = type(self).__name__
        check_pool_state(owner, state, self._expected_stamp())
        check_saved_int(owner, "_pool_index", state.get("_pool_index"))
        check_saved_bool(owner, "_inner_done", state.get("_inner_done"))
        super().restore_state(state)

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "dataset": self.dataset.config(),
            **self.settings.config(self._function_config(self.key_fn)),
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        return (
            f"LengthPoolSortDataset(pool_size={self.pool_size}, ramp={self.settings.ramp}, "
            f"mode={show(self.mode)}, "
            f"batch_size={self.batch_size}, seed={self.seed}, dataset={self.dataset})"
        )

