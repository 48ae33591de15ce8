"""How many samples a packed step (or window) takes, packing its draws about once.

A packed step of ``G`` packs (a window of the window mix: ``K G`` packs, packed as ``K R``
ranks) takes as many samples as fill its packs, each source within one sample of its share of
the count n (``counts_of(n)``: the carry's rounding). :func:`search_packed`:

1. **Tokens** (:func:`most_that_fit`). The largest n whose draws' tokens (each cut to the cap)
   fit ``packs x cap`` and a finite epoch's limits: doubling, then bisection, each probe adding
   (or taking away) only the draws between it and the largest count that fit so far.
2. **A first packing** at n less :data:`START_MARGIN` of it (packs are never quite full: the
   counts that packed whole sat 0.4-0.6% below the token bound on the benchmark's mixes),
   lowered by the samples it could not place until every drawn sample fits
   (:func:`~.pack_fill.pack_fill`; one sample per pack always fits).
3. **Up by adding.** Bisection between that count and the first that failed (or the token
   bound), to within :data:`FILL_RESOLUTION` of n: a larger count's extra draws are *added* to
   the first packing (:func:`~.pack_fill.add_items`) instead of packing all of them again. A
   count is taken if all its draws fit and the ranks' idle stays within
   :data:`IDLE_TOLERANCE` (or the first packing's, if higher; the step mix only). Where the
   carry's rounding gives a source fewer samples at the larger count (rare), that count is
   packed from scratch and becomes the base.

Version 2 of the packed plan packed every probe from scratch (5-6 packings a step, the step's
largest CPU cost); this packs once or twice (``PACKED_PLAN_VERSION`` 3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .pack_fill import Packing, pack_fill
from .source_draws import SourceDraws, cut_lengths

__all__ = ["FILL_RESOLUTION", "IDLE_TOLERANCE", "START_MARGIN", "Found", "most_that_fit",
           "search_packed"]

#: A step's sample count is searched to within this share of its samples.
FILL_RESOLUTION = 1 / 400
#: A fuller step is taken only if its ranks' straggler idle stays within this (or within the
#: idle of the first count that packed whole): balance first, then fill.
IDLE_TOLERANCE = 0.002
#: The first packing is tried this share below the token bound.
START_MARGIN = 0.008

CountsOf = Callable[[int], "tuple[np.ndarray, np.ndarray]"]


@dataclass(frozen=True)
class Found:
    """A count the search took.

    Attributes:
        counts: ``[S]`` samples per source (each source's next draws). carry: ``[S]`` after.
        pack: Flat pack ``rank x P + pack`` of every taken draw, in source order.
        packing: The packing's state (the ranks' costs).
    """

    counts: np.ndarray
    carry: np.ndarray
    pack: np.ndarray
    packing: Packing


def most_that_fit(streams: Sequence[SourceDraws], counts_of: CountsOf, *, least: int,
                  budget: float, cap: int, limits: np.ndarray | None) -> int:
    """The largest n >= ``least`` whose draws' tokens (each cut to ``cap``) fit ``budget`` and
    whose counts stay within ``limits`` (``least`` itself must)."""

    def over(c: np.ndarray) -> bool:
        return limits is not None and bool((c > limits).any())

    def between(a: np.ndarray, b: np.ndarray) -> float:
        """Tokens of the draws of counts ``b`` less those of counts ``a`` (per source, only
        the draws in between are read: no running sums of every draw held at once)."""
        total = 0.0
        for st, x, y in zip(streams, a.tolist(), b.tolist()):
            if x != y:
                st.ensure(max(x, y))
                part = float(np.minimum(st.length[min(x, y):max(x, y)], cap).sum())
                total += part if y > x else -part
        return total

    lo, hi = least, 2 * least
    at_lo = counts_of(lo)[0]
    spent = float(cut_lengths(streams, at_lo, cap).sum())
    while not over(c := counts_of(hi)[0]) and spent + (more := between(at_lo, c)) <= budget:
        lo, hi, at_lo, spent = hi, 2 * hi, c, spent + more
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = counts_of(mid)[0]
        more = None if over(c) else between(at_lo, c)
        if more is not None and spent + more <= budget:
            lo, at_lo, spent = mid, c, spent + more
        else:
            hi = mid
    for s, k in enumerate(counts_of(lo)[0].tolist()):  # no count above lo is packed
        streams[s].keep(k)
    return lo


def search_packed(streams: Sequence[SourceDraws], counts_of: CountsOf, *, most: int,
                  least: int, cap: int, world_size: int, packs_per_rank: int,
                  idle_tolerance: float | None) -> Found:
    """The count to take and its packing (the module's steps 2 and 3).

    Args:
        streams: Per source, its upcoming draws. counts_of: n -> (counts, carry).
        most: The token bound (:func:`most_that_fit`). least: A count that always packs whole
            (one sample per pack).
        cap: Tokens per pack. world_size: Ranks R. packs_per_rank: P.
        idle_tolerance: The ranks' idle a fuller count may reach after a count failed, or
            None: fill only.
    """
    R, P = int(world_size), int(packs_per_rank)

    def fill(n: int) -> tuple[Found, int]:
        c, e = counts_of(n)
        pack, packing = pack_fill(cut_lengths(streams, c, cap), R, P, cap)
        return Found(c, e, pack, packing), int((pack < 0).sum())

    n = max(least, most - int(most * START_MARGIN))
    best, unplaced = fill(n)
    tolerance = 1.0 if idle_tolerance is None else idle_tolerance
    if not unplaced and best.packing.idle <= tolerance:
        return best  # the usual case: one packing
    fail, full = n, (None if unplaced else best)
    if full is not None:  # packed whole but unbalanced (packs nearly full leave the ranks
        # little choice): balance first, from a count START_MARGIN emptier
        n = max(least, n - int(n * START_MARGIN))
        best, unplaced = fill(n)
    # lowered by what could not be placed until every drawn sample fits ...
    while unplaced:
        fail, n = n, max(least, n - unplaced)
        best, unplaced = fill(n)
    if full is not None and full.packing.idle <= best.packing.idle:
        return full  # the fuller count balances as well
    # ... then bisected back up, to within FILL_RESOLUTION, to the largest count that packs
    # whole with the ranks balanced as well (or within IDLE_TOLERANCE)
    limit = max(best.packing.idle, tolerance)
    while fail - n > max(1, int(n * FILL_RESOLUTION)):
        mid = (n + fail) // 2
        got, unplaced = fill(mid)
        if not unplaced and got.packing.idle <= limit:
            n, best = mid, got
        else:
            fail = mid
    return best
