"""PoolSettings: the validated settings that decide a length pool's order, shared by both pools.

The encoded pool (:class:`~energon_ordering.pool.length_pool_sort.LengthPoolSortDataset`) and the
lean key pool (:class:`~energon_ordering.pool.key_pool_sort.KeyPoolSortDataset`) emit the same order
for the same lengths: both seal a pool with :meth:`PoolSettings.order` and stamp their saved
state with :meth:`PoolSettings.stamp`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.energon.wrappers.base import get_sample_restore_key

from energon_ordering.errors import (
    NotRestorableError,
    OrderingConfigError,
    OrderingTypeError,
    SampleLengthError,
)
from energon_ordering.pool.order import BATCHED_MODES, ORDER_VERSION, POOL_ORDERS, pool_seed
from energon_ordering.pool.ramp import RAMP_RULE, pool_size_at
from energon_ordering.pool.restorability import explain_not_restorable
from energon_ordering.sample_fields import sample_key
from energon_ordering.state_stamp import check_stamp, check_writer
from energon_ordering.errors import show

__all__ = ["PoolSettings", "check_int", "check_pool_input", "check_pool_state", "checked_length"]


def check_int(owner: str, name: str, value: Any, *, minimum: int | None = None) -> None:
    """Raises unless ``value`` is an int (not a bool) and ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OrderingTypeError(
            f"{owner}: {name} = {show(value)} ({type(value).__name__}) must be an int."
        )
    if minimum is not None and value < minimum:
        raise OrderingConfigError(f"{owner}: {name} = {show(value)} must be >= {minimum}.")


@dataclass(frozen=True)
class PoolSettings:
    """Pool size, ramp, mode, micro-batch size and seed of a length pool, validated.

    Args:
        owner: The wrapper's name, for error messages.
        pool_size: Samples per pool, per loader worker (>= 1).
        mode: ``"sample"`` or ``"batch"`` (see :mod:`energon_ordering.pool.order`).
        batch_size: Micro-batch size; required for ``mode="batch"``, where ``pool_size`` must be
            a multiple of it.
        seed: Ordering seed; the same on every data-parallel rank.
        ramp: A loader worker's first pools are smaller, growing to ``pool_size``
            (:func:`~energon_ordering.pool.ramp.pool_size_at`); False: every pool holds
            ``pool_size``.
    """

    owner: str
    pool_size: int
    mode: str
    batch_size: int | None
    seed: int
    ramp: bool = False

    def __post_init__(self) -> None:
        owner = self.owner
        check_int(owner, "pool_size", self.pool_size, minimum=1)
        if self.mode not in POOL_ORDERS:
            raise OrderingConfigError(
                f"{owner}: mode = {show(self.mode)} is unknown; use one of {sorted(POOL_ORDERS)}."
            )
        if self.batch_size is not None:
            check_int(owner, "batch_size", self.batch_size, minimum=1)
        if self.mode in BATCHED_MODES:
            if self.batch_size is None:
                raise OrderingConfigError(
                    f"{owner}: mode = {show(self.mode)} needs batch_size (the micro-batch size, in "
                    "samples); pass batch_size=<micro-batch size>."
                )
            if self.pool_size % self.batch_size != 0:
                raise OrderingConfigError(
                    f"{owner}: pool_size = {self.pool_size} is not a multiple of batch_size = "
                    f"{self.batch_size} (mode={show(self.mode)}); use pool_size = "
                    f"{max(1, self.pool_size // self.batch_size) * self.batch_size}."
                )
        check_int(owner, "seed", self.seed)
        if not isinstance(self.ramp, bool):
            raise OrderingTypeError(
                f"{owner}: ramp = {show(self.ramp)} ({type(self.ramp).__name__}) must be True or "
                "False."
            )

    def size_at(self, pool_index: int) -> int:
        """Samples in this worker's pool number ``pool_index`` (the ramp, if on; never depends
        on the rank)."""
        return pool_size_at(pool_index, self.pool_size, ramp=self.ramp, batch_size=self.batch_size)

    def pool_seed(self, pool_index: int, worker_slot: int) -> int:
        """The permutation seed of one pool (see :func:`~energon_ordering.pool.order.pool_seed`)."""
        return pool_seed(self.seed, pool_index, worker_slot)

    def order(self, lengths: Sequence[float], pool_index: int, worker_slot: int) -> list[int]:
        """Emission order (arrival indices) of one pool; never depends on the rank."""
        return POOL_ORDERS[self.mode](lengths, self.pool_seed(pool_index, worker_slot), self.batch_size)

    def config(self, key_fn_config: Any) -> dict[str, Any]:
        """The pool's part of an Energon ``config()`` dict."""
        return {
            "pool_size": self.pool_size,
            "ramp": self.ramp,
            "mode": self.mode,
            "batch_size": self.batch_size,
            "key_fn": key_fn_config,
            "seed": self.seed,
        }

    def stamp(self, state_version: int, **extra: Any) -> dict[str, Any]:
        """What wrote a pool's saved state: versions and every setting that decides order."""
        return {
            "state_version": state_version,
            "order_version": ORDER_VERSION,
            "pool_size": self.pool_size,
            "ramp": RAMP_RULE if self.ramp else None,
            "mode": self.mode,
            # the ramp rounds its sizes to the micro-batch, so it decides order there too
            "batch_size": self.batch_size if self.mode in BATCHED_MODES or self.ramp else None,
            "seed": self.seed,
            **extra,
        }


def check_pool_input(owner: str, dataset: Any, key_fn: Any) -> None:
    """Raises unless ``key_fn`` is callable (or None) and ``dataset`` can restore samples by key."""
    if key_fn is not None and not callable(key_fn):
        raise OrderingTypeError(
            f"{owner}: key_fn = {show(key_fn)} is not callable; pass a function sample -> length in "
            "tokens."
        )
    problem = explain_not_restorable(dataset)
    if problem is not None:
        raise problem


def check_pool_state(owner: str, state: Any, expected_stamp: dict[str, Any]) -> None:
    """Raises :class:`StateMismatchError` unless ``state`` was written by the same pool class
    (the same placement) with the same stamp."""
    check_writer(
        owner,
        state,
        "Was it written with another OrderingConfig.length_sort_placement? Restore with the "
        "placement it was written with, or start the data stream fresh.",
    )
    check_stamp(
        owner,
        state,
        expected_stamp,
        "Restore with the pool configuration the checkpoint was written with, or start the "
        "data stream fresh.",
    )


def checked_restore_key(owner: str, sample: Any) -> Any:
    """The restore key of a sample entering a pool, raising :class:`NotRestorableError` if it
    has none: a pool saves restore keys, never samples, and a sample without one would be
    saved as nothing and fail only at the restore."""
    key = get_sample_restore_key(sample)
    if key is None:
        raise NotRestorableError(
            f"{owner}: sample {show(sample_key(sample))} ({type(sample).__name__}) has no "
            "__restore_key__, so a saved state could not re-create it. Pool Energon samples: "
            "return a Sample dataclass from encode_sample (e.g. MySample.derive_from(sample, "
            "...)) or a dict that keeps the input's '__restore_key__'."
        )
    return key


def checked_length(owner: str, key_fn: Callable[[Any], float], sample: Any) -> float:
    """``key_fn(sample)``, raising :class:`SampleLengthError` unless it is a finite number."""
    length = key_fn(sample)
    if type(length) is float and math.isfinite(length):
        return length  # the common case, without the slower abstract-type check below
    if isinstance(length, bool) or not isinstance(length, numbers.Real) or not math.isfinite(length):
        raise SampleLengthError(
            f"{owner}: key_fn returned {show(length)} for sample {show(sample_key(sample))}; it must "
            "return a finite number (the length in tokens)."
        )
    return length
