"""Balancing a window: its drawn samples -> steps x micro-batches x ranks, exact per-step mix.

Input: the costs and sources of the ``K G`` samples drawn for a window of K optimizer steps
(G = R M B: data-parallel size R, micro-batches per step M, micro-batch size B) and the exact
source counts each step must hold. Output: for every step, micro-batch and rank, the B samples
of that rank's micro-batch.

The algorithm (:func:`balance_window`), all deterministic given the inputs:

1. **Sort** the window's samples by cost ``L + L^2/4096`` (ties by their order in the window).
2. **Bands and slots.** Cut the sorted window into M bands of ``K R B`` samples and each band
   into K slots of ``R B`` neighbouring samples. A slot is one micro-batch index of one step on
   all R ranks; each step gets one slot of every band, so a step spans all lengths and every
   slot is narrow (1/(K M) of the window's cost range).
3. **Slots to steps.** Band by band, each slot goes to the step it brings closest (L1 over
   sources, greedy on the closest pairs) to the step's share of the bands so far: step t
   should hold ``counts[t, s] x (samples of s in bands 0..m) / (samples of s in the window)``
   of source s after band m (error diffusion across bands).
   Then two steps exchange their slots of one band while that lowers the total absolute
   excess (best exchange first): slots stay whole, so this costs no balance at all.
4. **Exact counts.** A step still off its counts trades samples with another step: a sample of
   a source it has too many of for one of a source it lacks, nearest costs first, over all
   steps with opposite excesses (:func:`_trade`, vectorised: in the merged cost order of the
   candidates, runs of the two kinds are paired outwards from each run boundary, pairs within
   a relative cost gap of 0.1% first, the gap doubled when none is left; each step trades at
   most its excess). An excess in a cycle over three or more sources is traded in bulk the
   same way, from any step with too many of the second source. Each trade lowers the total
   absolute excess by at least 2, so the repair ends, with every step exactly at its counts.
   Then each step's samples are sorted again and cut into its M slots: a traded sample joins
   the slot of its length, not the slot it was traded into.
5. **Ranks, per step.** Within a slot, the ``R B`` samples (descending) are cut into B tuples
   of R neighbours; the step's M B tuples are dealt widest first, each sample of a tuple to a
   rank, the largest to the rank with the smallest running cost *of the step*
   (longest-processing-time dealing with one sample per tuple and rank). Every micro-batch
   holds one sample per tuple of its slot, so it is as narrow as the slot; the ranks' costs are
   balanced over the step's M micro-batches, where they wait for each other (the gradient
   reduction), to within the narrowest tuples' spread.
6. **Evening out.** A sample far above the rest of its slot (the top of a heavy tail) leaves
   its rank costlier than the narrow tuples can offset. Swaps between the costliest and the
   cheapest ranks of a step lower it (:func:`_even_out`), each the one that saves the most
   compute: the idle it removes less the padding it adds. This brings idle per optimizer step
   to the free-dealing bound (each step's samples dealt longest first with no micro-batch
   structure, :func:`~energon_ordering.inspect.lost_compute.free_dealing_bound`) while every
   micro-batch index stays balanced too (ranks wait at every micro-batch under expert
   parallelism); ``micro_batch_weight=0`` gives up the latter for the former in the steps
   that hold a heavy tail's outlier.

Why a window and not a step: sorting one step's G samples gives slots spanning 1/M of the cost
range, which either unbalances the ranks (a rank gets B neighbours) or pads (a rank gets one
sample per tuple across the slot); K steps narrow every slot K times for the same exact
per-step mix (padding by tokens falls about as 1 / (K M): at M = 2, K = 32 pads 3.3% of a
trimodal mix's tokens, K = 64 1.7%). ``tools/bench_planned.py`` measures the plans against the
free-dealing bound, the pools and the global sort (``--window-steps`` for K).
"""

from __future__ import annotations

import numpy as np

from energon_ordering.pool.pack_order import ATTENTION_CROSSOVER_TOKENS

from .lpt import falling_order
from .sort_order import stable_argsort_rows, stable_ascending, stable_by_int

__all__ = ["balance_window", "deal_step", "radix_keys", "sample_cost"]


#: Relative cost gap up to which the repair's first rounds trade; doubled whenever a round finds
#: no pair that near (so trades are taken nearest first).
TRADE_TOLERANCE = 0.001

#: Rounds of swaps that lower a step's costliest ranks after the dealing (:func:`_even_out`), the
#: pairs of ranks swapping per round, and the idle (``1 - mean / max`` of the ranks' costs) below
#: which a step is even (further swaps would cost its micro-batches their alignment for little).
EVEN_OUT_ROUNDS = 64
EVEN_OUT_PAIRS = 8
EVEN_TOLERANCE = 2e-4
CROSS_TOLERANCE = 1e-3


def sample_cost(lengths: np.ndarray) -> np.ndarray:
    """Compute cost per sample, ``L + L^2 / 4096`` (tokens; float64), in one array (the same
    operations in place: a million samples' costs take 8 MB, not three times that)."""
    L = np.asarray(lengths, dtype=np.float64)
    cost = L * L
    cost /= ATTENTION_CROSSOVER_TOKENS
    cost += L
    return cost


def radix_keys(lengths: np.ndarray) -> np.ndarray | None:
    """uint16 sort keys that order samples exactly as their costs do, or None.

    Cost is strictly increasing in the length for lengths >= 0, so whole lengths in
    ``[0, 65535]`` sort (stably) exactly as their costs, ties included, and numpy sorts uint16
    keys by radix sort: 6-10x faster than the float64 costs on a window of 10^6 samples.
    Other lengths (fractions, longer, negative) return None: the costs are sorted instead, to
    the same order."""
    L = np.asarray(lengths)
    if L.size == 0:
        return None
    lo, hi = L.min(), L.max()
    if not (0 <= lo and hi <= 65535):
        return None
    keys = L.astype(np.uint16)
    return keys if np.array_equal(keys, L) else None


#: Whole lengths below this have exact, strictly increasing costs in float64 (L^2 < 2^52), so
#: they sort as their costs do.
_EXACT_COST_LENGTH = 1 << 26


def _ascending(costs: np.ndarray, keys: np.ndarray | None,
               lengths: np.ndarray | None = None) -> np.ndarray:
    """Stable ascending order of costs (by ``keys`` when given, or by whole ``lengths`` below
    :data:`_EXACT_COST_LENGTH`: the same order, faster)."""
    if keys is not None:
        return np.argsort(keys, kind="stable")
    if lengths is not None and len(lengths) and np.max(lengths) < _EXACT_COST_LENGTH:
        return stable_ascending(lengths)
    return np.argsort(costs, kind="stable")


def _match(dist: np.ndarray) -> np.ndarray:
    """Greedy assignment on a square distance matrix ``[item, target]``: repeatedly the closest
    free pair (ties by item, then target). Returns ``target_of_item``."""
    k = dist.shape[0]
    out = np.full(k, -1, dtype=np.int64)
    used = np.zeros(k, dtype=bool)
    done = 0
    for flat in np.argsort(dist.ravel(), kind="stable"):
        i, t = divmod(int(flat), k)
        if out[i] < 0 and not used[t]:
            out[i], used[t] = t, True
            done += 1
            if done == k:
                break
    return out


def _trade(flat: np.ndarray, costs: np.ndarray, src: np.ndarray, excess: np.ndarray,
           s: int, s2: int, loose: bool = False, keys: np.ndarray | None = None) -> int:
    """Trades samples of source ``s`` from steps that have too many of s and too few of
    ``s2`` for samples of s2 from steps with the opposite excess, nearest costs first, as many
    as the steps' excesses allow. ``loose``: the steps giving s2 need only have too many of s2
    (an excess over three or more sources, in a cycle: each trade still lowers the total
    absolute excess by at least 2, the giving step's by 2). Returns the number of trades (0:
    no such steps). ``src``: the source of each sample of ``flat``, swapped along with it.
    ``keys``: :func:`radix_keys` of the samples (the candidates sorted by them, a radix sort:
    the same order as by their costs), or None."""
    qa = np.minimum(excess[:, s], -excess[:, s2]).clip(min=0)  # steps giving s, taking s2
    qb = (excess[:, s2] if loose else np.minimum(excess[:, s2], -excess[:, s])).clip(min=0)
    left = int(min(qa.sum(), qb.sum()))
    if left == 0:
        return 0
    # candidates as int32 cells of ``flat`` (a window of them costs 17 bytes each, not 57: a
    # loader worker pays the peak)
    width = flat.shape[1]
    ca = _cells(src, s, qa)
    cb = _cells(src, s2, qb)
    cell = np.concatenate((ca, cb))
    kind = np.concatenate((np.zeros(len(ca), dtype=bool), np.ones(len(cb), dtype=bool)))
    del ca, cb
    at = flat.ravel()[cell]
    value = costs[at]
    # ties by candidate order; uint16 keys sort by radix, the same order as the costs
    order = np.argsort(value if keys is None else keys[at], kind="stable")
    del at
    cell = cell[order]  # one at a time: each old array freed before the next copy
    kind = kind[order]
    value = value[order]
    del order
    # each candidate's step and kind in one int32, ``2 step + kind``: a used-up quota closes its
    # candidates with one gather (``open_[slot]``)
    slot = (cell // width * 2 + kind).astype(np.int32)
    open_ = np.empty(2 * len(qa), dtype=bool)
    quota_a, quota_b = qa.copy(), qb.copy()
    alive = np.ones(len(value), dtype=bool)
    pairs: list[np.ndarray] = []  # rows (cell a, cell b)
    tolerance = TRADE_TOLERANCE
    parity = 0
    stale = True  # alive changed since the runs were found
    near: list = [None, None]  # per parity: the boundary pairs (lo, hi, gap) of the runs
    while left > 0:
        if stale:
            if alive.sum() * 2 < len(alive):  # compact: rounds cost O(candidates left)
                keep = alive  # one array at a time (the peak is what a loader worker pays)
                slot = slot[keep]
                cell = cell[keep]
                kind = kind[keep]
                value = value[keep]
                alive = np.ones(len(value), dtype=bool)
                del keep
            live = np.arange(len(alive), dtype=np.int32)[alive]  # int32 positions: the peak
            if len(live) < 2:
                break
            # runs of one kind in the merged order; at a boundary between a run of a's and a
            # run of b's, pair them from the boundary outwards (nearest first), every other
            # boundary per round so that no run is claimed from both sides
            kd = kind[live]
            starts = np.flatnonzero(np.concatenate(([True], kd[1:] != kd[:-1])))
            del kd
            ends = np.concatenate((starts[1:], [len(live)]))
            if len(starts) < 2:
                break
            stale = False
        if near[parity] is None:  # a round that trades nothing leaves the runs as they were
            bounds = np.arange(parity, len(starts) - 1, 2)
            span = np.minimum(ends[bounds] - starts[bounds],
                              ends[bounds + 1] - starts[bounds + 1])
            j = np.arange(int(span.sum()), dtype=np.int32)
            j -= np.repeat((np.cumsum(span) - span).astype(np.int32), span)
            lo = live[np.repeat(ends[bounds].astype(np.int32), span) - 1 - j]
            hi = live[np.repeat(starts[bounds + 1].astype(np.int32), span) + j]
            del j
            near[parity] = (lo, hi, value[hi] - value[lo])
        lo, hi, gap = near[parity]
        parity ^= 1
        ok = gap <= tolerance * np.maximum(value[hi], 1.0)
        lo, hi, gap = lo[ok], hi[ok], gap[ok]
        if len(lo) == 0:
            if parity == 0:
                tolerance *= 2  # no pair that near at either parity: accept pairs twice as far
            continue
        o = np.argsort(gap, kind="stable")
        lo, hi = lo[o], hi[o]
        del o, gap
        ia = np.where(kind[lo], hi, lo)
        ib = np.where(kind[lo], lo, hi)
        del lo, hi
        # each step gives at most its quota: the pair's rank among its step's pairs, nearest first
        sa, sb = slot[ia] >> 1, slot[ib] >> 1  # their steps
        accept = _rank_within(sa) < quota_a[sa]
        accept &= _rank_within(sb) < quota_b[sb]
        ia, ib = ia[accept][:left], ib[accept][:left]
        sa, sb = sa[accept][:left], sb[accept][:left]
        del accept
        np.subtract.at(quota_a, sa, 1)
        np.subtract.at(quota_b, sb, 1)
        alive[ia] = alive[ib] = False
        pairs.append(np.stack((cell[ia], cell[ib]), axis=1))
        left -= len(ia)
        stale = True
        near = [None, None]  # the runs change: their pairs (a window's worth) are found again
        # candidates of steps whose quota is used up leave the pool (gathers of bools: the
        # candidates are a window's worth)
        if (quota_a[sa] == 0).any() or (quota_b[sb] == 0).any():
            open_[0::2] = quota_a > 0
            open_[1::2] = quota_b > 0
            alive &= open_[slot]
        del ia, ib, sa, sb
    if not pairs:
        return 0
    cells_a, cells_b = np.concatenate(pairs).T.astype(np.int64)
    for a in (flat.reshape(-1), src.reshape(-1)):  # views: flat and src are contiguous
        a[cells_a], a[cells_b] = a[cells_b], a[cells_a]
    sa, sb = cells_a // width, cells_b // width
    moved_a = np.bincount(sa, minlength=len(qa))
    moved_b = np.bincount(sb, minlength=len(qa))
    excess[:, s] += moved_b - moved_a
    excess[:, s2] += moved_a - moved_b
    return len(sa)


def _cells(src: np.ndarray, source: int, quota: np.ndarray) -> np.ndarray:
    """int32 cells (``step x width + column``, ascending) of ``source``'s samples in the steps
    with ``quota > 0``: only those steps are scanned."""
    rows = np.flatnonzero(quota > 0)
    r, c = np.nonzero(src[rows] == source)
    return (rows[r] * src.shape[1] + c).astype(np.int32)


def _rank_within(groups: np.ndarray) -> np.ndarray:
    """For each element, how many earlier elements have the same group (0, 1, 2, ...): groups
    are non-negative ints (steps); int32 results and temporaries below 2^31 elements (a round
    of trades holds a window's worth: the peak a loader worker pays)."""
    g = np.asarray(groups)
    n = len(g)
    index = np.int32 if n < 2**31 else np.int64
    if not n:
        return np.zeros(0, dtype=index)
    order = stable_by_int(g)
    sg = g[order]
    start = np.flatnonzero(np.concatenate(([True], sg[1:] != sg[:-1]))).astype(index)
    del sg
    within = np.arange(n, dtype=index)
    within -= np.repeat(start, np.diff(np.append(start, n)))
    rank = np.empty(n, dtype=index)
    rank[order] = within
    return rank


def _swap_slots(slots: np.ndarray, bands: np.ndarray, comp: np.ndarray,
                slot_of_step: np.ndarray, excess: np.ndarray) -> None:
    """Step 3b: exchanges two steps' slots of one band while that lowers the total absolute
    excess (best exchange first). Slots stay whole, so no micro-batch changes: only which step
    it belongs to, and every step keeps one slot per band."""
    M, K, _ = comp.shape
    c = comp[np.arange(M)[:, None], slot_of_step]  # [M, K, S]: each band's slot of each step

    def gains(rows: np.ndarray | slice, cols: np.ndarray | slice) -> np.ndarray:
        """gain[m, t, t2] of step t taking t2's slot of band m (excess[t] += delta,
        excess[t2] -= delta), for ``rows`` x ``cols`` (exact: integers)."""
        now = np.abs(excess).sum(axis=1)
        delta = c[:, None, cols, :] - c[:, rows, None, :]
        after = (np.abs(excess[rows][None, :, None, :] + delta).sum(axis=3)
                 + np.abs(excess[cols][None, None, :, :] - delta).sum(axis=3))
        return now[rows][None, :, None] + now[cols][None, None, :] - after

    gain = gains(slice(None), slice(None))  # [M, K, K]; after an exchange only its steps' rows
    while True:                              # and columns change
        # the first best (band, then step pair), as band by band with a strict improvement
        flat = int(np.argmax(gain))
        if gain.flat[flat] <= 0:
            return
        m, t, t2 = (int(i) for i in np.unravel_index(flat, gain.shape))
        d = comp[m][slot_of_step[m, t2]] - comp[m][slot_of_step[m, t]]
        excess[t] += d
        excess[t2] -= d
        slot_of_step[m, [t, t2]] = slot_of_step[m, [t2, t]]
        slots[t, m], slots[t2, m] = bands[m, slot_of_step[m, t]], bands[m, slot_of_step[m, t2]]
        c[m, [t, t2]] = c[m, [t2, t]]
        both = np.array([t, t2])
        gain[:, both, :] = gains(both, slice(None))
        gain[:, :, both] = gains(slice(None), both)


def _repair(slots: np.ndarray, costs: np.ndarray, sources: np.ndarray, counts: np.ndarray,
            keys: np.ndarray | None = None) -> None:
    """Step 4: trades samples between steps (in place on ``slots`` ``[K, M, RB]``) until every
    step holds exactly ``counts[t, s]`` samples of source s.

    Pairs of sources whose excesses mirror each other are traded in bulk (:func:`_trade`);
    what is left (excess in a cycle over three or more sources) is traded in bulk too, loosely:
    a sample of a source a step has too many of, for one of a source it lacks, from a step
    with too many of that second source. Every trade lowers the total absolute excess by at
    least 2, so the repair ends."""
    K, S = counts.shape
    flat = slots.reshape(K, -1)
    # the slots' sources, small ints kept in step with the trades (not a window of int64 per
    # trade: a loader worker pays the peak)
    src = sources.astype(np.int16 if S < 2**15 else np.int32)[flat]  # gathers from 2 MiB
    have = np.stack([np.bincount(src[t], minlength=S) for t in range(K)])
    excess = have - counts
    pairs = [(s, s2) for s in range(S) for s2 in range(S) if s != s2]
    while excess.any():
        if sum(_trade(flat, costs, src, excess, s, s2, keys=keys) for s, s2 in pairs):
            continue
        done = sum(_trade(flat, costs, src, excess, s, s2, loose=True, keys=keys)
                   for s, s2 in pairs)
        if not done:  # pragma: no cover - each column of excess sums to 0: a loose trade exists
            raise AssertionError("balance_window: the repair made no progress.")


def _resort(slots: np.ndarray, costs: np.ndarray, keys: np.ndarray | None,
            chunk_samples: int = 1 << 18) -> None:
    """Step 4b: each step's samples sorted ascending and cut again into its M slots (in place on
    ``slots`` ``[K, M, RB]``): the repair's trades leave a sample in a slot of another band
    (a long sample traded into a short slot); sorted, every slot holds the step's RB
    neighbours. A step the repair left alone keeps its slots (one per band, ascending)."""
    K, M, RB = slots.shape
    flat = slots.reshape(K, M * RB)
    step = max(1, chunk_samples // (M * RB))
    for lo in range(0, K, step):  # in chunks of steps: the temporaries stay small
        part = flat[lo: lo + step]
        key = costs[part] if keys is None else keys[part]
        part[:] = np.take_along_axis(part, np.argsort(key, axis=1, kind="stable"), axis=1)


def _deal(slots: np.ndarray, costs: np.ndarray, world_size: int, micro_batch: int,
          keys: np.ndarray | None = None, micro_batch_weight: float = 1.0,
          chunk_samples: int = 1 << 18) -> np.ndarray:
    """Step 5: ``[K, M, R B]`` slots -> ``[K, M, R, B]`` micro-batches per rank, written over
    ``slots`` (steps dealt in chunks of about ``chunk_samples`` samples, to bound the
    temporaries). ``keys``:
    :func:`radix_keys` of the samples, or None. ``micro_batch_weight``: see :func:`_even_out`.

    Each slot must be ascending (:func:`_resort`). A step's M B tuples (R neighbours of a slot
    each) are dealt widest first, the largest sample of a tuple to the rank with the smallest
    running cost of the step; then :func:`_even_out`."""
    K, M, RB = slots.shape
    R, B = world_size, micro_batch
    step = max(1, chunk_samples // (M * RB))
    for lo in range(0, K, step):
        flat = slots[lo: lo + step].reshape(-1, RB)  # [n M, RB], each slot ascending
        n = flat.shape[0] // M
        tuples = flat[:, ::-1].reshape(n, M * B, R)  # descending
        value = costs[tuples]
        # widest tuple first: the later, narrower ones even out what it leaves
        order = np.argsort(value[:, :, -1] - value[:, :, 0], axis=1, kind="stable")
        part = np.empty((n, M, R, B), dtype=slots.dtype)
        pc = np.empty((n, M, R, B))  # the costs of ``part``, kept beside it (no gathers)
        totals = np.zeros((n, R))
        row = np.arange(n)
        # flat indices into part, pc and totals: 1-D fancy indexing is faster than 4-D
        flat_part, flat_pc, flat_totals = part.reshape(-1), pc.reshape(-1), totals.reshape(-1)
        at_row = (row * R)[:, None]
        for i in range(M * B):
            q = order[:, i]
            m, j = q // B, q % B
            if i == 0:  # every total is 0: rank k takes item k
                ranks = np.broadcast_to(np.arange(R), (n, R))
            elif i == 1 and not (totals[:, 1:] > totals[:, :-1]).any():
                ranks = falling_order(totals)  # the first tuple's values: no sort
            else:
                ranks = stable_argsort_rows(totals)  # cheapest rank first (ties by rank)
            v = value[row, q]
            at = ranks + ((row * M + m) * R)[:, None]
            at *= B
            at += j[:, None]
            flat_part[at] = tuples[row, q]
            flat_pc[at] = v
            flat_totals[ranks + at_row] += v  # a row's ranks are distinct: no index repeats
        # swaps within a micro-batch index first (they keep each index's lengths), then any
        _even_out(part, pc, totals, micro_batch_weight, same_index=True)
        _even_out(part, pc, totals, micro_batch_weight, tolerance=CROSS_TOLERANCE)
        del pc
        slots[lo: lo + step] = part.reshape(n, M, RB)  # in place: no second window of ids
    return slots.reshape(K, M, R, B)


def _top2(c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Along the last axis: the largest value, and for each element the largest of the others."""
    arg = c.argmax(axis=-1)
    top = np.take_along_axis(c, arg[..., None], axis=-1)
    rest = c.copy()
    np.put_along_axis(rest, arg[..., None], -np.inf, axis=-1)
    second = rest.max(axis=-1, keepdims=True)
    without = np.where(np.arange(c.shape[-1]) == arg[..., None], second, top)
    return top[..., 0], without


def _even_out(part: np.ndarray, part_costs: np.ndarray, totals: np.ndarray,
              micro_batch_weight: float = 1.0, rounds: int = EVEN_OUT_ROUNDS,
              pairs: int = EVEN_OUT_PAIRS, same_index: bool = False,
              tolerance: float = EVEN_TOLERANCE) -> None:
    """Step 6: lowers each step's costliest ranks by swaps (in place on ``part`` ``[n, M, R,
    B]``, its samples' costs ``part_costs`` (the same shape, swapped along with it: no gathers
    from the window's costs) and ``totals`` ``[n, R]``).

    The dealing leaves a step's excess on the ranks that took an outlier (a sample far above
    the rest of its slot, which the narrower tuples cannot offset). Each round, in every step
    not yet even, the i-th costliest rank swaps one sample with the i-th cheapest (i <
    ``pairs``): the swap that saves the most compute, the idle it removes (R x how much the
    costlier of the two drops) less the padding it adds (in cost units, to the two
    micro-batches: a sample moved into a micro-batch of shorter ones pads it), less
    ``micro_batch_weight`` x R x how far the cheaper rank's micro-batch rises above the
    costliest of its index (0: ranks wait once per step; 1: at every micro-batch, as under
    expert parallelism). Swaps within a micro-batch index add almost no padding; across
    indices they pay where an outlier costs more idle than its padding. A step stops when its
    idle is below :data:`EVEN_TOLERANCE` or no swap saves compute; at most ``rounds`` rounds,
    each O(steps x (R log R + pairs (M B)^2))."""
    n, M, R, B = part.shape
    P = max(1, min(pairs, R // 2))
    MB = M * B
    rep = np.repeat(np.arange(M), B)
    active = np.arange(n)
    # [n, M, R] micro-batch costs, kept in step with the swaps (not gathered every round)
    pc = part_costs
    mb = pc.sum(axis=3) if micro_batch_weight else None
    for _ in range(rounds):
        if not len(active):
            return
        t = totals[active]
        peak_t = t.max(axis=1)
        uneven = t.mean(axis=1) < (1.0 - tolerance) * peak_t
        active, t = active[uneven], t[uneven]
        if not len(active):
            return
        rows = np.arange(len(active))[:, None]
        if R > 2 * P:  # the P costliest and P cheapest ranks, in O(R)
            top = np.argpartition(t, R - P, axis=1)[:, R - P:]
            low = np.argpartition(t, P, axis=1)[:, :P]
            a = np.take_along_axis(top, np.argsort(-t[rows, top], axis=1, kind="stable"), axis=1)
            b = np.take_along_axis(low, np.argsort(t[rows, low], axis=1, kind="stable"), axis=1)
            # the rank below the P costliest: a pair's costlier rank cannot usefully drop below
            floor = np.partition(t, R - P - 1, axis=1)[:, R - P - 1]
        else:
            order = np.argsort(t, axis=1, kind="stable")
            a, b = order[:, ::-1][:, :P], order[:, :P]  # [n, P]: i-th costliest, i-th cheapest
            floor = np.full(len(active), -np.inf)
        la, lb = t[rows, a], t[rows, b]
        ca = pc[active[:, None], :, a, :]  # [n, P, M, B]
        cb = pc[active[:, None], :, b, :]
        top_a, wo_a = _top2(ca)
        top_b, wo_b = _top2(cb)
        sum_a, sum_b = ca.sum(axis=3), cb.sum(axis=3)
        pad_a, pad_b = B * top_a - sum_a, B * top_b - sum_b  # [n, P, M]
        if same_index:  # candidate: x = a's (m, i) for y = b's (m, j); axes [n, P, m, i, j]
            x, y = ca[..., :, None], cb[..., None, :]
            wa, wb = wo_a[..., :, None], wo_b[..., None, :]
            rep_a, rep_b = sum_a[..., None, None], sum_b[..., None, None]
            pa, pb = pad_a[..., None, None], pad_b[..., None, None]
        else:  # candidate: x = a's (m, i) for y = b's (m', j); axes [n, P, m i, m' j]
            x = ca.reshape(*ca.shape[:2], MB)[..., :, None]
            y = cb.reshape(*cb.shape[:2], MB)[..., None, :]
            wa, wb = wo_a.reshape(*x.shape[:3], 1), wo_b.reshape(*y.shape[:2], 1, MB)
            rep_a, rep_b = sum_a[..., rep][..., None], sum_b[..., rep][..., None, :]
            pa, pb = pad_a[..., rep][..., None], pad_b[..., rep][..., None, :]
        extra = (1,) * (x.ndim - 2)
        la_, lb_ = la.reshape(la.shape + extra), lb.reshape(lb.shape + extra)
        new_pad_a = B * np.maximum(wa, y) - (rep_a - x + y)
        new_pad_b = B * np.maximum(wb, x) - (rep_b + x - y)
        added = (new_pad_a - pa) + (new_pad_b - pb)
        del new_pad_a, new_pad_b
        peak = np.maximum(np.maximum(la_ - x + y, lb_ + x - y),
                          floor.reshape((-1,) + (1,) * (x.ndim - 1)))
        # never raise the pair's costlier rank: a swap may trade idle for less padding only
        # where it costs no idle
        gain = np.where(peak <= la_, R * (la_ - peak) - added, -np.inf)
        if micro_batch_weight:
            # how far the cheaper rank's micro-batch rises above the costliest of its index
            mb_peak = mb[active].max(axis=2)  # [n, M]
            mb_peak = (mb_peak[:, None, :, None, None] if same_index
                       else mb_peak[:, None, None, rep])
            over = (rep_b + x - y) - mb_peak
            gain -= micro_batch_weight * R * np.maximum(over, 0.0)
        # the first best swap in (m, i, m', j) order; within an index only those with m' = m
        gain = gain.reshape(*la.shape, -1)
        best = gain.argmax(axis=2)  # [n, P]
        ok = np.take_along_axis(gain, best[..., None], axis=2)[..., 0] > 1e-9 * la
        step_ok = ok.any(axis=1)
        st, pr = np.nonzero(ok)
        steps_ = active[st]
        ra, rb, bb = a[st, pr], b[st, pr], best[st, pr]
        if same_index:
            pm, (pi, qj) = bb // (B * B), np.divmod(bb % (B * B), B)
            qm = pm
        else:
            (pm, pi), (qm, qj) = np.divmod(bb // MB, B), np.divmod(bb % MB, B)
        sa, sb = part[steps_, pm, ra, pi], part[steps_, qm, rb, qj]
        part[steps_, pm, ra, pi], part[steps_, qm, rb, qj] = sb, sa
        va, vb = pc[steps_, pm, ra, pi], pc[steps_, qm, rb, qj]
        pc[steps_, pm, ra, pi], pc[steps_, qm, rb, qj] = vb, va
        delta = va - vb
        totals[steps_, ra] -= delta
        totals[steps_, rb] += delta
        if mb is not None:
            np.add.at(mb, (steps_, pm, ra), -delta)
            np.add.at(mb, (steps_, qm, rb), delta)
        active = active[step_ok]


def balance_window(
    costs: np.ndarray,
    sources: np.ndarray,
    counts: np.ndarray,
    *,
    world_size: int,
    micro_batch: int,
    micro_batches_per_step: int,
    lengths: np.ndarray | None = None,
    micro_batch_weight: float = 1.0,
) -> np.ndarray:
    """Splits a window's samples into steps, micro-batches and ranks (see the module docstring).

    Args:
        costs: Cost of each of the window's ``K G`` samples (:func:`sample_cost`).
        sources: Source index of each sample.
        counts: ``[K, S]`` exact samples per step and source (each row sums to G); the window
            holds ``counts.sum(axis=0)[s]`` samples of source s.
        world_size: R, data-parallel ranks.
        micro_batch: B, samples per micro-batch.
        micro_batches_per_step: M, micro-batches per rank per step.
        lengths: The samples' lengths (``costs`` is :func:`sample_cost` of them): whole lengths
            up to 65,535 are sorted by radix (:func:`radix_keys`), to the same result.
        micro_batch_weight: How much idle per micro-batch counts beside idle per optimizer
            step when a step is evened out (step 6): 1 (the plans of PLAN_VERSION 2) keeps
            every micro-batch index balanced as well, where expert-parallel ranks wait; 0
            balances the step alone, where data-parallel ranks wait, reaching the free-dealing
            bound on heavy tails too, at several times the idle per micro-batch.

    Returns:
        ``[K, M, R, B]`` positions into ``costs`` (int32 below 2^31 samples, else int64):
        step, micro-batch, rank, sample.
    """
    costs = np.asarray(costs, dtype=np.float64)
    sources = np.asarray(sources)  # small ints stay small: a loader worker pays the peak
    if sources.dtype.kind not in "iu":
        sources = sources.astype(np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    K, S = counts.shape
    R, B, M = int(world_size), int(micro_batch), int(micro_batches_per_step)
    RB = R * B
    if len(costs) != K * M * RB or len(sources) != len(costs):
        raise ValueError(f"balance_window: {len(costs)} samples for {K} steps of {M * RB}.")
    if not (counts.sum(axis=1) == M * RB).all():
        raise ValueError("balance_window: every step's counts must sum to G = R M B.")
    if not np.array_equal(np.bincount(sources, minlength=S)[:S], counts.sum(axis=0)):
        raise ValueError("balance_window: the window's sources do not add up to the counts.")
    keys = None if lengths is None else radix_keys(lengths)
    order = _ascending(costs, keys, lengths)  # ties by their order in the window
    bands = order.reshape(M, K, RB)  # band m, slot k
    comp = np.stack([
        np.stack([np.bincount(sources[bands[m, k]], minlength=S) for k in range(K)])
        for m in range(M)
    ])  # [M, K, S]
    # step t's share of the bands so far, per source: counts[t, s] x (band samples of s so far)
    # / (window samples of s); each band's slots go where they bring the steps closest to it
    total = np.maximum(counts.sum(axis=0), 1).astype(np.float64)
    seen = np.zeros(S)
    have = np.zeros((K, S))
    # int32 positions where they fit: the slots live through the repair, the peak
    slots = np.empty((K, M, RB), dtype=np.int32 if len(costs) < 2**31 else np.int64)
    slot_of_step = np.empty((M, K), dtype=np.int64)
    for m in range(M):
        seen += comp[m].sum(axis=0)
        target = counts * (seen / total)[None, :] - have  # [K, S]
        dist = np.abs(comp[m][:, None, :] - target[None, :, :]).sum(axis=2)
        step_of_slot = _match(dist)
        slots[step_of_slot, m] = bands[m]
        have[step_of_slot] += comp[m]
        slot_of_step[m, step_of_slot] = np.arange(K)
    _swap_slots(slots, bands, comp, slot_of_step, (have - counts).astype(np.int64))
    del order, bands  # a loader worker pays the peak: drop the sort before the repair
    _repair(slots, costs, sources, counts, keys)
    _resort(slots, costs, keys)
    return _deal(slots, costs, R, B, keys, float(micro_batch_weight))


def deal_step(lengths: np.ndarray, *, world_size: int, micro_batch: int,
              micro_batches_per_step: int) -> np.ndarray:
    """Deals one optimizer step's samples onto ranks and micro-batches, keeping the step's
    samples (an elastic resume: the step was planned for another shape).

    The window's balancing with one step (K = 1): the G samples sorted, cut into M bands of
    R B neighbours (one micro-batch index on every rank), dealt onto the ranks by
    longest-processing-time over the step and evened out (steps 5 and 6 of the module
    docstring).

    Args:
        lengths: The step's G = R M B sample lengths (tokens).
        world_size: R.
        micro_batch: B.
        micro_batches_per_step: M.

    Returns:
        ``[M, R, B]`` positions into ``lengths`` (int32).
    """
    lengths = np.asarray(lengths)
    n = len(lengths)
    return balance_window(sample_cost(lengths), np.zeros(n, dtype=np.int64), np.array([[n]]),
                          world_size=world_size, micro_batch=micro_batch,
                          micro_batches_per_step=micro_batches_per_step, lengths=lengths)[0]
