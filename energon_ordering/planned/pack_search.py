"""How many samples a packed step (or window) takes, packing its draws once where it can.

A packed step of ``G`` packs (a window of the window mix: ``K G`` packs, packed as ``K R``
ranks) takes as many samples as fill its packs, each source within one sample of its share of
the count n (``counts_of(n)``: the carry's rounding). Each try packs the n draws from scratch
(:func:`~.pack_fill.pack_fill`), the plan's largest CPU cost, so the search tries few counts
(:func:`packed_count`, which both mixes call, runs steps 1 to 5):

1. **Tokens** (:func:`most_that_fit`). The largest n whose draws' tokens (each cut to the cap)
   fit ``packs x cap`` and a finite epoch's limits: doubling, then bisection, each probe adding
   (or taking away) only the draws between it and the largest count that fit so far.
2. **First count** (:func:`search_packed`): :data:`START_MARGIN` below that bound (packs are
   never quite full: the counts that packed whole sat 0.3-0.7% below it on the benchmark's
   mixes). If every draw fits and the ranks' idle is within the tolerance (the step mix's
   :data:`IDLE_TOLERANCE`; the window mix balances its steps afterwards and has none), that is
   the count: one packing, the usual case.
3. **Lowered** while draws are left unplaced, by their tokens in samples of the mean length
   (:data:`LOWER_SLACK`; they are the shortest draws, so their number overshoots).
4. **Balance first.** A count that packs whole with the ranks over the tolerance (nearly full
   packs leave the dealing little choice: a step of 1,024 ranks x 2 packs went from 8% to 13%
   idle over the last 0.3% of its count) is compared with one :data:`START_MARGIN` emptier,
   else :data:`BALANCE_MARGIN` emptier; the fuller one is kept if it balances as well. Where
   none of them balances (the idle is the packs' own: at one or two packs per rank, a few
   costly packs on a heavy tail), the one that loses the least compute, idle per step + padding
   by tokens (:attr:`~.pack_fill.Packing.lost`), is kept: lowering the count there bought
   little idle for much padding. An emptier count is not packed where it is known to lose: the
   rank that holds its costliest sample idles the others by at least ``1 - mean rank cost /
   that sample's cost``, over the tolerance, and with its padding that is no less than the full
   count loses (one pack per rank on a heavy tail: 3.4-3.5 packings a step -> 1.3-1.7).
5. **Up again.** Bisection between the largest count that packed whole and the smallest that
   did not (or the unbalanced one), to within :data:`FILL_RESOLUTION` of the latter (a count
   lowered by that share from one that left draws out is taken as it is), taking a count whose
   draws all fit with the ranks as balanced (idle within the tolerance or the count's below).

``PACKED_PLAN_VERSION`` 2 started at the token bound (always short of room), lowered by the
number of samples left out and bisected back up: 5-6 packings a step. Version 3 measured the
resolution against the lower count, so a count lowered by exactly the resolution was bisected
once more (a third packing of most windows of the trimodal and demo mixes, for at most 0.25% of
their samples, in packs fuller but less balanced). Version 4 kept the most balanced count where
none balanced, and bisected up from it: on the heavy-tailed mix at 1,024 ranks x 2 packs, 5.9%
idle per step and 2.3% padding in 6.7 packings a step, where version 5 takes the full count,
6.6% and 0.6% in 3.5 (``tools/bench_planned.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from energon_ordering.mixture.step_counts import step_source_counts

from .balance import sample_cost
from .pack_fill import Packing, pack_fill
from .source_draws import SourceDraws, cut_lengths

__all__ = ["BALANCE_MARGIN", "FILL_RESOLUTION", "IDLE_TOLERANCE", "LOWER_SLACK", "START_MARGIN",
           "Found", "most_that_fit", "packed_count", "search_packed"]

#: A step's sample count is searched to within this share of the smallest count found too many.
FILL_RESOLUTION = 1 / 400
#: A fuller step is taken only if its ranks' straggler idle stays within this (or within the
#: idle of the first count that packed whole): balance first, then fill.
IDLE_TOLERANCE = 0.002
#: The first packing is tried this share below the token bound.
START_MARGIN = 0.004
#: Where the first count packs whole but leaves the ranks unbalanced, the ranks' idle a fuller
#: count may reach is that of a count this share emptier (nearly full packs leave the dealing
#: little choice: at 1,024 ranks x 2 packs the idle rose from 8% to 13% over the last 0.3% of
#: the count).
BALANCE_MARGIN = 0.02
#: A count that left samples unplaced is lowered by their tokens in samples of the mean length
#: times this (at most by their number, at least by FILL_RESOLUTION of the count).
LOWER_SLACK = 1.25

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


def packed_count(streams: Sequence[SourceDraws], weights: np.ndarray, carry: np.ndarray, *,
                 cap: int, world_size: int, packs_per_rank: int, limits: np.ndarray | None,
                 idle_tolerance: float | None) -> Found | None:
    """The count of the next draws that fills R ranks' P packs of ``cap`` tokens, each source
    within one sample of ``weights[s]`` x the count (:func:`step_source_counts` with the
    carry), and its packing (:func:`most_that_fit`, then :func:`search_packed`); None where
    one sample per pack already needs more of a source than ``limits`` allows (a finite
    epoch's end)."""
    w = np.asarray(weights, dtype=np.float64)[None, :]

    def counts_of(n: int) -> tuple[np.ndarray, np.ndarray]:
        c, e = step_source_counts(w, n, carry)
        return c[0].astype(np.int64), e

    least = int(world_size) * int(packs_per_rank)  # one sample per pack always fits
    if limits is not None and bool((counts_of(least)[0] > limits).any()):
        return None
    most = most_that_fit(streams, counts_of, least=least, budget=float(least) * float(cap),
                         cap=cap, limits=limits)
    return search_packed(streams, counts_of, most=most, least=least, cap=cap,
                         world_size=world_size, packs_per_rank=packs_per_rank,
                         idle_tolerance=idle_tolerance)


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
    for st, k in zip(streams, at_lo.tolist()):  # no count above lo is packed
        st.keep(k)
    return lo


def search_packed(streams: Sequence[SourceDraws], counts_of: CountsOf, *, most: int,
                  least: int, cap: int, world_size: int, packs_per_rank: int,
                  idle_tolerance: float | None) -> Found:
    """The count to take and its packing (the module's steps 2 to 5).

    Args:
        streams: Per source, its upcoming draws. counts_of: n -> (counts, carry).
        most: The token bound (:func:`most_that_fit`). least: A count that always packs whole
            (one sample per pack).
        cap: Tokens per pack. world_size: Ranks R. packs_per_rank: P.
        idle_tolerance: The ranks' idle a count may leave and still be taken (else the search
            balances first), or None: fill only.
    """
    R, P = int(world_size), int(packs_per_rank)

    def fill(n: int) -> tuple[Found, int]:
        """n's packing and how many samples fewer would fit (0: all fit)."""
        c, e = counts_of(n)
        L = cut_lengths(streams, c, cap)
        pack, packing = pack_fill(L, R, P, cap)
        missing = pack < 0
        unplaced = int(missing.sum())
        if unplaced:  # the unplaced samples' tokens in samples of the mean length, with slack
            drop = math.ceil(LOWER_SLACK * float(L[missing].sum()) / float(L.mean()))
            unplaced = max(1, int(n * FILL_RESOLUTION), min(unplaced, drop))
        return Found(c, e, pack, packing), unplaced

    def whole(n: int) -> tuple[int, Found, int | None]:
        """n lowered by what could not be placed until every drawn sample fits (by the unplaced
        samples' tokens: they are the shortest, so their number overshoots): the count, its
        packing and the last count that did not fit (None: n itself fit)."""
        got, unplaced = fill(n)
        short = None
        while unplaced:
            short, n = n, max(least, n - unplaced)
            got, unplaced = fill(n)
        return n, got, short

    tolerance = 1.0 if idle_tolerance is None else idle_tolerance

    def cannot_win(n: int, full: Found) -> bool:
        """Whether count n, packed whole, could neither balance nor lose less compute than
        ``full``, known without packing it: the rank that holds its costliest sample costs at
        least that, so its idle is at least ``1 - mean rank cost / that sample's cost``, and its
        padding is its tokens' (one pack per rank on a heavy tail: the usual case)."""
        L = cut_lengths(streams, counts_of(n)[0], cap)
        cost = sample_cost(L)
        top = float(cost.max())
        idle = max(0.0, 1.0 - float(cost.sum()) / R / top) if top > 0 else 0.0
        padding = 1.0 - float(L.sum()) / (R * P * cap)
        return idle > tolerance and idle + padding >= full.packing.lost

    n, best, fail = whole(max(least, most - int(most * START_MARGIN)))
    if best.packing.idle > tolerance:
        # packed whole but unbalanced (nearly full packs leave the dealing little choice):
        # balance first, from a count START_MARGIN emptier (or, if that is not within the
        # tolerance either, BALANCE_MARGIN emptier), up to this one
        full, fail = best, n
        tried = []
        for margin in (START_MARGIN, BALANCE_MARGIN):
            m = max(least, fail - int(fail * margin))
            if m >= fail or cannot_win(m, full):
                continue  # the same count (a small step), or one known to lose
            n, best, _ = whole(m)
            tried.append((n, best))
            if best.packing.idle <= tolerance:
                break
        if not tried:
            return full
        if best.packing.idle > tolerance:
            # no count balances (the idle is the packs' own: a few costly ones): the count
            # that loses the least compute, idle + padding, and the full one where that is it
            n, best = min(tried, key=lambda t: t[1].packing.lost)
            if full.packing.lost <= best.packing.lost:
                return full
        elif full.packing.idle <= best.packing.idle:
            return full  # the fuller count balances as well
    elif fail is None:
        return best  # the usual case: the first count packs whole and balanced
    # then bisected back up, to within FILL_RESOLUTION, to the largest count that packs
    # whole with the ranks balanced as well (or within IDLE_TOLERANCE)
    limit = max(best.packing.idle, tolerance)
    while fail - n > max(1, int(fail * FILL_RESOLUTION)):
        mid = (n + fail) // 2
        got, unplaced = fill(mid)
        if not unplaced and got.packing.idle <= limit:
            n, best = mid, got
        else:
            fail = mid
    return best
