"""Which shards each process of a distributed length index build measures (pure).

A shard is measured whole by one process (an incremental build reuses a shard's lengths whole,
keyed by the shard file's digest), so the work is split by shard, balanced by samples, into
contiguous runs: shard ``p`` goes to the rank whose equal share of the split's samples holds the
shard's middle sample. Each rank's samples then differ from the ideal ``total / world_size`` by
less than the largest shard, and the ranks' parts, read in rank order, are the split in its
order: rank 0 merges them one part at a time (memory: one part, not the split). Every process
computes the same split from the same counts, with no communication.
"""

from __future__ import annotations

from collections.abc import Sequence

from energon_ordering.errors import LengthIndexError

__all__ = ["split_shards"]


def split_shards(counts: Sequence[int], world_size: int) -> list[range]:
    """The shard positions of each rank: ``world_size`` contiguous ranges, in rank order, that
    together hold every position of ``counts`` exactly once (a rank gets an empty range when
    there are fewer shards than processes).

    Args:
        counts: Samples of each shard (>= 0), in the split's order.
        world_size: Processes of the build (>= 1).
    """
    if world_size < 1:
        raise LengthIndexError(f"split_shards: world_size = {world_size} must be >= 1.")
    total = sum(counts)
    bounds = [0] * (world_size + 1)  # bounds[r]: the first position of rank r or a later one
    start = 0
    rank = 0
    for pos, count in enumerate(counts):
        # the rank of twice the middle sample against twice each share's bounds (integers)
        mine = min(world_size - 1, (2 * start + count) * world_size // (2 * total)) if total else 0
        while rank < mine:
            rank += 1
            bounds[rank] = pos
        start += count
    for r in range(rank + 1, world_size + 1):
        bounds[r] = len(counts)
    return [range(bounds[r], bounds[r + 1]) for r in range(world_size)]
