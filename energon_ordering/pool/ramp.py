"""Pool ramp: a loader worker's first pools are smaller, so its first batch leaves sooner.

A pool emits nothing until it is full, so the first micro-batch of a worker waits for a whole
pool: with a 100,000-sample key pool that is the time to walk 100,000 samples (about 2 s). With
the ramp the worker's pools have the sizes ``pool_size_at(0), pool_size_at(1), ...``:

    RAMP_FIRST * RAMP_FACTOR**k, capped at ``pool_size``   (1,000 -> 10,000 -> 100,000 -> ...)

rounded up to a multiple of the micro-batch, so a micro-batch never straddles two pools (batch
and stratified orders are built from whole micro-batches).

Trade-off: a small pool sorts less well, so the first ``sum(sizes before pool_size)`` samples of
each worker (11,000 for a pool of 100,000) sync the ranks as a 1,000- and a 10,000-sample pool
do, instead of as a 100,000 one. That costs straggler idle over those samples only, which
``tools/bench_scale.py`` prints side by side with the time to first batch.

Cross-rank alignment (DESIGN contract 4): the size of pool k is a pure function of (k,
pool_size, micro-batch), never of the rank, the time or the data, so worker w's k-th pool holds
the same number of samples on every rank and the i-th micro-batch of every rank still comes from
the same pool position. A resume is exact because the pool index is saved state.
"""

from __future__ import annotations

__all__ = ["RAMP_FACTOR", "RAMP_FIRST", "RAMP_MIN_POOL", "RAMP_RULE", "pool_size_at", "ramp_sizes"]

#: Samples in a worker's first pool when the ramp is on.
RAMP_FIRST = 1_000
#: Each ramped pool is this many times larger than the one before, up to ``pool_size``.
RAMP_FACTOR = 10
#: With ``OrderingConfig.length_sort_pool_ramp = None`` (auto), pools of at least this many
#: samples ramp; smaller ones fill in well under a second and do not.
RAMP_MIN_POOL = 10_000
#: What the ramp does, as stamped into saved state (changing the rule changes the order).
RAMP_RULE = f"{RAMP_FIRST} * {RAMP_FACTOR}**k, micro-batch multiple, capped"


def pool_size_at(pool_index: int, pool_size: int, *, ramp: bool, batch_size: int | None = None) -> int:
    """Samples in a loader worker's pool number ``pool_index`` (0 = its first pool).

    Args:
        pool_index: How many pools this worker has sealed before this one (>= 0).
        pool_size: The configured pool size (``length_sort_pool_size``), the size the ramp
            grows to (>= 1).
        ramp: False: every pool holds ``pool_size`` (the ramp is off).
        batch_size: Micro-batch size in samples, or None. Ramped sizes are rounded up to a
            multiple of it; ``pool_size`` itself must already be one where the order needs it
            (see :class:`~energon_ordering.pool.settings.PoolSettings`).

    Returns:
        The pool's size in samples: ``min(pool_size, ceil(RAMP_FIRST * RAMP_FACTOR**pool_index
        / batch_size) * batch_size)`` with the ramp on, else ``pool_size``. A pure function of
        its arguments, the same on every rank.
    """
    if not ramp or pool_index < 0:
        return pool_size
    size = RAMP_FIRST
    for _ in range(pool_index):
        if size >= pool_size:
            return pool_size
        size *= RAMP_FACTOR
    if batch_size is not None and batch_size > 1:
        size = -(-size // batch_size) * batch_size
    return min(pool_size, size)


def ramp_sizes(pool_size: int, *, ramp: bool, batch_size: int | None = None) -> list[int]:
    """The sizes of a worker's pools up to and including its first full-size pool.

    For example ``ramp_sizes(100_000, ramp=True) == [1_000, 10_000, 100_000]``.
    """
    sizes = [pool_size_at(0, pool_size, ramp=ramp, batch_size=batch_size)]
    while sizes[-1] < pool_size:
        sizes.append(pool_size_at(len(sizes), pool_size, ramp=ramp, batch_size=batch_size))
    return sizes
