"""Longest-processing-time dealing in tuples: the last step of every planned layout.

``R B`` items (samples, packs, micro-batches) of one slot go to R ranks, B each: sorted by cost
(descending, ties in slot order), cut into B tuples of R neighbours, and tuple by tuple the
costliest item goes to the rank with the smallest running cost (ties by rank). Every rank takes
one item per tuple, so the ranks' costs agree to within a tuple's spread. Used by the packed
plan (:mod:`.packs`: packs to ranks, a pack's seed samples) and the window mix
(:mod:`.window_mix`: micro-batches or samples to ranks); vectorised over many slots at once.
"""

from __future__ import annotations

import numpy as np

from .sort_order import stable_argsort_rows

__all__ = ["deal_sorted", "deal_tuples", "falling_order"]


def deal_tuples(slots: np.ndarray, costs: np.ndarray, world_size: int, per_rank: int,
                chunk_items: int = 1 << 16) -> np.ndarray:
    """``[..., R P]`` slots of item indices -> ``[..., R, P]``: each slot's items dealt to R
    ranks of P items (column j of a rank: its item of tuple j, the j-th costliest tuple).

    Args:
        slots: Item indices into ``costs``, the last axis ``R P`` long.
        costs: Cost of every item.
        world_size: R. per_rank: P.
        chunk_items: Items dealt at once (bounds the temporaries).
    """
    R, P = int(world_size), int(per_rank)
    shape = slots.shape[:-1]
    every = np.asarray(slots).reshape(-1, R * P)
    out = np.empty((every.shape[0], R, P), dtype=np.int64)
    step = max(1, chunk_items // (R * P))
    for lo in range(0, every.shape[0], step):
        flat = every[lo: lo + step]
        n = flat.shape[0]
        desc = np.take_along_axis(flat, np.argsort(-costs[flat], axis=1, kind="stable"), axis=1)
        tuples = desc.reshape(n, P, R)
        out[lo: lo + step] = _deal(tuples, costs[tuples])[0]
    return out.reshape(*shape, R, P)


def deal_sorted(costs: np.ndarray, world_size: int, per_rank: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`deal_tuples` of slots whose items are already in ascending cost order, without
    sorting them: each row of ``costs`` ``[n, R P]`` (ascending) is one slot, its items taken
    from the costliest (ties: the later column first). Also returns each rank's total.

    Returns:
        ``(column [n, R, P], totals [n, R])``: the column (into the row) of each rank's item of
        each tuple, and each rank's summed cost.
    """
    c = np.asarray(costs, dtype=np.float64)
    n = c.shape[0]
    R, P = int(world_size), int(per_rank)
    column = (R * P - 1) - np.arange(R * P, dtype=np.int64).reshape(P, R)  # tuple j, item k
    return _deal(np.broadcast_to(column, (n, P, R)), c[:, ::-1].reshape(n, P, R))


def _deal(items: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The dealing of both: ``items`` and their ``values`` ``[n, P, R]`` (slot, tuple j, its R
    items costliest first), tuple by tuple the costliest item to the rank with the smallest
    running cost (ties by rank). Returns ``(item [n, R, P], totals [n, R])``."""
    n, P, R = values.shape
    out = np.empty((n, R, P), dtype=np.int64)
    totals = np.zeros((n, R))
    out[:, :, 0] = items[:, 0]  # the first tuple: every total is 0, item k to rank k
    totals += values[:, 0]
    # flat indices into the outputs: 1-D fancy indexing is faster than 2-D (rows, ranks)
    flat_out, flat_totals = out.reshape(-1), totals.reshape(-1)
    row_start = np.arange(0, n * R, R, dtype=np.int64)[:, None]
    for j in range(1, P):
        # cheapest rank first (ties by rank); after the first tuple the totals are its values,
        # costliest first where the items came sorted: their order is known without a sort
        falling = j == 1 and not (totals[:, 1:] > totals[:, :-1]).any()
        at = falling_order(totals) if falling else stable_argsort_rows(totals)
        at += row_start
        flat_totals[at] += values[:, j]  # a row's ranks are distinct: no index repeats
        at *= P
        at += j
        flat_out[at] = items[:, j]
    return out, totals


def falling_order(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, axis=1, kind="stable")`` of rows that do not rise (``[n, R]``),
    without a sort: an item's place is the count of smaller items (those after its run of
    equal items) plus its place in its run."""
    v = np.asarray(values)
    n, R = v.shape
    if n == 0 or R == 0:
        return np.zeros((n, R), dtype=np.int64)
    index = np.arange(R, dtype=np.int64)
    starts = np.ones((n, R), dtype=bool)
    np.not_equal(v[:, 1:], v[:, :-1], out=starts[:, 1:])
    first = np.where(starts, index, 0)
    np.maximum.accumulate(first, axis=1, out=first)
    ends = np.ones((n, R), dtype=bool)
    ends[:, :-1] = starts[:, 1:]
    past = np.where(ends, index + 1, R)[:, ::-1]  # one past each run's last item, from the right
    past = np.minimum.accumulate(past, axis=1)[:, ::-1]
    place = R - past
    place += index
    place -= first
    out = np.empty((n, R), dtype=np.int64)
    np.put_along_axis(out, place, np.broadcast_to(index, (n, R)), axis=1)
    return out
