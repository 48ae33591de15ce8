"""Pool orders: pure functions ``(lengths, seed, batch_size) -> emission order``.

A length pool collects ``pool_size`` samples, then emits them in an order computed here. The
order depends only on the samples' lengths and a seed, never on the data-parallel rank: every
rank that feeds the same ``seed`` permutes its pool the same way, so the i-th sample (or
micro-batch) that leaves rank r's pool has the same length quantile as the i-th one of every
other rank. That is the whole cross-rank effect; a per-rank seed would destroy it.

Modes (the registry :data:`POOL_ORDERS`):

``sample``
    The reference algorithm: stable sort by length, then apply one seeded permutation to the
    sorted pool. Every rank's i-th sample has a near-equal length, but a micro-batch still mixes
    lengths from all over the pool (padding stays high).

``batch``
    Stable sort by length, cut into consecutive chunks of ``batch_size``, permute the CHUNK
    order with the seed. Each micro-batch holds neighbouring lengths (near padding-free) and the
    i-th micro-batch of every rank comes from the same quantile. Trade-off: within a step all
    ranks process similar lengths *and* the micro-batch is homogeneous, at the cost of less
    within-batch length diversity. A short pool (the last, partial pool of a finite stream)
    emits its full chunks permuted, then the remainder chunk last, so batch boundaries stay
    aligned with chunk boundaries for as long as possible.

``stratified``
    Sorts, cuts the sorted pool into ``batch_size`` equal length bands (quantile strata) and
    builds every micro-batch from one sample of each band, at the same seeded position in every
    band. Each micro-batch spans the whole length range, so when sources differ in length
    (images vs text, code vs chat) every micro-batch, hence every optimizer step, mixes them;
    the i-th micro-batch of every rank holds the same quantiles, so ranks stay in sync. The cost
    is padding (like ``sample``: use it with packing or padding-free attention). ``batch`` mode
    instead makes a step of R ranks hold R copies of ONE length quantile: with length-separated
    sources, whole steps come from one source (per-step source dispersion of 28 at 8 ranks in
    ``advise`` on two sources, against ~1 without a pool).

Randomness is drawn from :class:`random.Random` ``.random()`` only, whose sequence Python
guarantees not to change for a given integer seed; the permutation is a hand-written
Fisher-Yates over it, so a checkpoint resumes to the same order on any Python/numpy version.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Literal

from energon_ordering.errors import show

__all__ = [
    "POOL_ORDERS",
    "PoolMode",
    "batch_mode_order",
    "permutation",
    "pool_seed",
    "sample_mode_order",
    "sorted_indices",
    "stratified_order",
]

#: The pool modes. See the module docstring.
PoolMode = Literal["sample", "batch", "stratified"]

#: Modes whose order is built from micro-batches, so they need the micro-batch size.
BATCHED_MODES = frozenset({"batch", "stratified"})

#: Bumped whenever any function here changes the order it returns; goes into saved state.
ORDER_VERSION = 1


def pool_seed(seed: int, pool_index: int, worker_slot: int) -> int:
    """The permutation seed of one pool: a pure function of its arguments, never of the rank.

    Args:
        seed: The ordering seed (the same on every data-parallel rank).
        pool_index: How many pools this loader worker has emitted before this one.
        worker_slot: The loader worker's id within its rank (``WorkerConfig.rank_worker_id()``).
            Energon's loader takes micro-batch b from worker ``b % num_workers`` on every rank,
            so worker w's k-th pool on rank r meets worker w's k-th pool on every other rank.

    Returns:
        A 64-bit integer seed.
    """
    digest = hashlib.sha256(
        f"energon_ordering.pool/v{ORDER_VERSION}:{seed}:{pool_index}:{worker_slot}".encode()
    ).digest()
    return int.from_bytes(digest[:8], "little")


def permutation(n: int, seed: int) -> list[int]:
    """A uniformly random permutation of ``range(n)``; a pure function of (n, seed)."""
    rng = random.Random(seed)
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        j = int(rng.random() * (i + 1))
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def sorted_indices(lengths: Sequence[float]) -> list[int]:
    """Indices of ``lengths`` in ascending order; ties keep their arrival order (stable)."""
    return sorted(range(len(lengths)), key=lengths.__getitem__)


def sample_mode_order(
    lengths: Sequence[float], seed: int, batch_size: int | None = None
) -> list[int]:
    """Sort by length, then permute the sorted pool sample by sample.

    Args:
        lengths: Length of each pooled sample, in arrival order.
        seed: The pool's permutation seed (see :func:`pool_seed`).
        batch_size: Unused; accepted so that all modes share one signature.

    Returns:
        Arrival indices in emission order.
    """
    ranked = sorted_indices(lengths)
    return [ranked[p] for p in permutation(len(ranked), seed)]


def batch_mode_order(lengths: Sequence[float], seed: int, batch_size: int | None) -> list[int]:
    """Sort by length, cut into chunks of ``batch_size``, permute the chunk order.

    Args:
        lengths: Length of each pooled sample, in arrival order.
        seed: The pool's permutation seed (see :func:`pool_seed`).
        batch_size: Micro-batch size, in samples.

    Returns:
        Arrival indices in emission order: full chunks in permuted order, then the remainder.
    """
    if batch_size is None or batch_size < 1:
        raise ValueError(f"batch_mode_order: batch_size = {show(batch_size)}; give an int >= 1.")
    ranked = sorted_indices(lengths)
    n_full = len(ranked) // batch_size
    order: list[int] = []
    for chunk in permutation(n_full, seed):
        order.extend(ranked[chunk * batch_size : (chunk + 1) * batch_size])
    order.extend(ranked[n_full * batch_size :])
    return order


def stratified_order(lengths: Sequence[float], seed: int, batch_size: int | None) -> list[int]:
    """Sort by length, cut into ``batch_size`` length bands, take one sample per band per
    micro-batch at a seeded position shared by all bands.

    Args:
        lengths: Length of each pooled sample, in arrival order.
        seed: The pool's permutation seed (see :func:`pool_seed`).
        batch_size: Micro-batch size, in samples (= the number of bands).

    Returns:
        Arrival indices in emission order: micro-batch j holds position ``perm[j]`` of every
        band, shortest band first; a short pool's remainder (fewer than ``batch_size`` samples
        past the last full band row) comes last, sorted.
    """
    if batch_size is None or batch_size < 1:
        raise ValueError(f"stratified_order: batch_size = {show(batch_size)}; give an int >= 1.")
    ranked = sorted_indices(lengths)
    per_band = len(ranked) // batch_size
    order: list[int] = []
    for j in permutation(per_band, seed):
        order.extend(ranked[band * per_band + j] for band in range(batch_size))
    order.extend(ranked[per_band * batch_size :])
    return order


#: Registry of pool modes.
POOL_ORDERS: dict[str, Callable[[Sequence[float], int, int | None], list[int]]] = {
    "sample": sample_mode_order,
    "batch": batch_mode_order,
    "stratified": stratified_order,
}
