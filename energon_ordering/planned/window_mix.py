"""``planned_mix="window"``: a window's samples banded by length over its steps.

The step mix (:func:`~.window.plan_window` with ``mix="step"``) gives every optimizer step each
source's exact share, so every step spans every source's lengths. Here the window of K steps
holds each source's share of the whole window, and its samples move between its steps:

1. **Counts.** Source s places ``T_s`` samples in the window: the carry rounding of
   :func:`~energon_ordering.mixture.step_counts.step_source_counts` applied to the window's
   total ``sum over steps of w_s x G`` (:func:`window_totals`): within one sample of it, and the
   cumulative counts within one sample of the integral across windows (the carry).
2. **Schedule groups.** Steps whose drawn sources have the same zero weights form a group (one
   group unless the schedule switches a source on or off inside the window). The window's counts
   are split into per-group counts near each group's share, zero where a source's weight is 0
   (a rounding with exact row and column sums, :func:`_split_counts`); a source's candidates go
   to its groups in draw order.
3. **Bands.** In each group, the steps are put in band order (by cap, ties in a seeded shuffle
   of the window's steps, so long bands are spread over the window), the group's samples sorted
   by length (ties in draw order: a source's deferred samples, then its draws, source by
   source), and sample i placed at slot ``u_i = i + max over j <= i of (a_j G - j)``, where
   ``a_j`` is the first band whose step's cap fits sample j: band p takes the samples ranked
   ``[p G, (p + 1) G)`` when nothing is capped, and under caps the earliest band each fits in
   ascending order (optimal: if a sample overflows, no placement of these samples fits them
   all).
4. **Deferral.** A sample that overflows (it fits no band with room left, the warmup's caps) is
   deferred: it leaves the window and the next draw of its source takes its place (swept again,
   up to :data:`DEFER_ROUNDS` rounds); it stays in the cursor (``PlanCursor.deferred``, oldest
   first) and a later window places it before new draws of its source. At most
   :data:`MAX_DEFERRED` samples wait at once; beyond that, or after the last round, an
   overflowing sample takes a free slot anyway (longest to the largest cap), and the warmup cuts
   it as it cuts the step mix's samples. Nothing is lost or drawn twice.
5. **Micro-batches** (:func:`deal_bands`). Each step's G samples, sorted, are dealt the cheapest
   of a few ways, scored by the step's share of the lost compute (idle per step + padding by
   tokens): ``R M`` micro-batches of B neighbours dealt whole to the ranks (longest-processing-
   time in tuples of R, M per rank: no padding, the ranks apart by the band's spread), or each
   micro-batch index's R B neighbours cut into h parts dealt sample by sample to R/h ranks
   (h = 1: ranks level, a micro-batch spans the slice). Narrow bands (most of them) come out
   both level and padding-free; the widest (a heavy tail's longest) trade one for the other.
   A step's samples are already sorted, so no dealing sorts them again, and a cut dealing's
   padding is known before it is dealt (a micro-batch's longest is its sample of the first
   tuple): h is dealt only on the steps where that padding alone would score below the best
   so far.

Trade-off against the step mix: each step is one band of lengths, so at one or two micro-batches
per step the ranks are balanced and micro-batches padding-free, but a single step's source mix
follows its band, not the weights (a window's mix is exact to one sample, a step's is not).
Everything is a pure function of (lengths, seed, cursor, weights, caps, shape): every rank plans
the same window. Memory and time O(K G log(K G)) per window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from energon_ordering.mixture.step_counts import step_source_counts

from .balance import sample_cost
from .lpt import deal_sorted
from .cursor import PlanCursor, draws
from .permutation import permutation_key, permute
from .sample_ids import SampleIds
from .sort_order import stable_ascending

__all__ = ["DEFER_ROUNDS", "MAX_DEFERRED", "band_order", "deal_bands", "mix_window",
           "window_counts", "window_totals"]

#: Most samples a cursor holds back for later windows (8 KiB of ids); beyond it an
#: overflowing sample is placed over its step's cap (the warmup cuts it, as in the step mix).
MAX_DEFERRED = 1024
#: Sweeps of a group per window: the replacements of deferred samples may overflow again.
DEFER_ROUNDS = 8
#: Weight of padding against idle when :func:`deal_bands` picks a step's dealing: padding by
#: tokens has its own target (<= 2%, issue 32) beside the lost compute, so it counts twice
#: (measured, 8 ranks, M = 1, K = 64, heavy-tailed mix: padding 2.14% -> 1.68% for a lost
#: compute of 4.55% -> 4.76%).
PADDING_WEIGHT = 2.0
#: Samples :func:`deal_bands` deals at once (its temporaries are a few times this, in int64).
CHUNK_SAMPLES = 1 << 17
#: Idle per step under which a step's micro-batches dealt whole are kept without trying the cut
#: dealings (they could save at most this idle, and would add padding).
LEVEL_ENOUGH = 0.001
#: Most parts a micro-batch index's slice is cut into when dealt (:func:`deal_bands`).
MAX_PARTS = 64
#: ``permutation_key`` source of the band order (no real source has a negative index).
_BAND_KEY_SOURCE = -1


def window_totals(weights: np.ndarray, draws_per_step: int,
                  carry: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(T [S], carry)``: each source's samples in a window of ``weights`` ``[K, S]`` steps of
    ``draws_per_step`` draws, rounded with the carry on the window's total (within one sample
    of ``sum_t w[t, s] x G``; cumulative counts within one sample of the integral)."""
    w = np.asarray(weights, dtype=np.float64)
    k = w.shape[0]
    counts, out = step_source_counts(w.sum(axis=0)[None, :] / k, k * int(draws_per_step), carry)
    return counts[0], out


def window_counts(weights: np.ndarray, draws_per_step: int, carry: Sequence[float]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(group of each step [K], samples per group and source [groups, S], carry)`` of a
    window of ``weights`` ``[K, S]`` (module docstring, steps 1-2): the window's totals with the
    carry, split over the groups of steps with the same zero weights among the drawn sources
    (the step mix's counts per group, and its carry, where no split within one sample exists).
    Every window-mix rule that needs the window's counts reads them here (the plan, its check,
    a finite epoch's end)."""
    w = np.asarray(weights, dtype=np.float64)
    G = int(draws_per_step)
    totals, out = window_totals(w, G, carry)
    mask = (w > 0) & (totals > 0)[None, :]
    patterns, group = np.unique(mask, axis=0, return_inverse=True)
    group = np.asarray(group).reshape(-1)
    n = len(patterns)
    if n == 1:
        return group, totals[None, :], out
    x = np.stack([(w[group == g] * G).sum(axis=0) for g in range(n)])
    split = _split_counts(x, np.bincount(group, minlength=n) * G, totals, patterns)
    if split is None:  # no split within one sample exists: the step mix's counts, per group
        step, out = step_source_counts(w, G, carry)
        split = np.stack([step[group == g].sum(axis=0) for g in range(n)])
    return group, split, out


def band_order(caps: np.ndarray | None, steps: np.ndarray, seed: int, window: int,
               window_steps: int) -> np.ndarray:
    """``steps`` (indices into the window) in band order, shortest band first: by cap, ties in a
    seeded shuffle of the window's steps (the same for every rank)."""
    key = permute(np.asarray(steps, dtype=np.int64), window_steps,
                  permutation_key(seed, _BAND_KEY_SOURCE, window))
    cap = np.zeros(len(steps)) if caps is None else np.asarray(caps)[steps]
    return np.asarray(steps)[np.lexsort((key, cap))]


def _split_counts(x: np.ndarray, rows: np.ndarray, cols: np.ndarray,
                  allowed: np.ndarray) -> np.ndarray | None:
    """An int matrix ``n`` near ``x`` ``[groups, S]`` with row sums ``rows``, column sums
    ``cols`` and zeros outside ``allowed``: the floors, then the largest fractional parts,
    then unit augmenting paths (a transportation problem of a few cells). None if none
    exists."""
    n = np.where(allowed, np.floor(x), 0).astype(np.int64)
    need_g = rows - n.sum(axis=1)
    need_s = cols - n.sum(axis=0)
    if (need_g < 0).any() or (need_s < 0).any():
        return None
    frac = np.where(allowed, x - np.floor(x), -1.0)
    for flat in np.argsort(-frac, axis=None, kind="stable"):
        g, s = divmod(int(flat), x.shape[1])
        if frac[g, s] > 0 and need_g[g] > 0 and need_s[s] > 0:
            n[g, s] += 1
            need_g[g] -= 1
            need_s[s] -= 1
    while need_s.sum() > 0:  # a unit path source -> group (-> source -> group ...)
        start = [s for s in range(len(cols)) if need_s[s] > 0]
        came: dict[tuple[str, int], tuple[str, int] | None] = {("s", s): None for s in start}
        todo = deque(("s", s) for s in start)
        end = None
        while todo and end is None:
            kind, i = todo.popleft()
            nxt = ([("g", g) for g in np.flatnonzero(allowed[:, i])] if kind == "s"
                   else [("s", s) for s in np.flatnonzero(n[i] > 0)])
            for node in nxt:
                node = (node[0], int(node[1]))
                if node not in came:
                    came[node] = (kind, i)
                    if node[0] == "g" and need_g[node[1]] > 0:
                        end = node
                        break
                    todo.append(node)
        if end is None:
            return None
        need_g[end[1]] -= 1
        node = end
        while came[node] is not None:
            prev = came[node]
            if node[0] == "g":
                n[node[1], prev[1]] += 1  # prev is a source
            else:
                n[prev[1], node[1]] -= 1  # prev is a group giving up a sample of node's source
            node = prev
        need_s[node[1]] -= 1
    return n


class _Candidates:
    """A source's samples for the window, in order: its deferred samples (oldest first), then
    its next draws. Each has an age (deferred: place in the old queue; draws after them)."""

    def __init__(self, seed: int, source: int, size: int, offset: int, first: int,
                 deferred: list[tuple[int, int]]):
        self.seed, self.source, self.size, self.offset = seed, source, size, offset
        self.first = int(first)
        self.pulled = 0
        self.old = deferred  # (age, gid)
        self.used_old = 0

    def take(self, count: int, age_base: int, gid: np.ndarray, age: np.ndarray | None) -> None:
        """The next ``count`` samples, written into ``gid`` and (unless None) ``age``
        (``count`` long each)."""
        k = min(count, len(self.old) - self.used_old)
        part = self.old[self.used_old: self.used_old + k]
        self.used_old += k
        fresh = count - k
        gid[:k] = [g for _, g in part]
        at = self.first + self.pulled
        for lo in range(k, count, CHUNK_SAMPLES):  # bounds the permutation's temporaries
            n = min(CHUNK_SAMPLES, count - lo)
            gid[lo:lo + n] = draws(self.seed, self.source, self.size, at + lo - k, n)
        gid[k:] += self.offset
        if age is not None:
            age[:k] = [a for a, _ in part]
            age[k:] = np.arange(age_base + self.first + self.pulled,
                                age_base + self.first + self.pulled + fresh, dtype=np.int64)
        self.pulled += fresh

    def left_over(self) -> list[tuple[int, int]]:
        return self.old[self.used_old:]


def _sweep(L: np.ndarray, band_caps: np.ndarray | None, G: int) -> np.ndarray:
    """Slot of each sample in the bands (band ``slot // G``), or -1 where it overflows (see the
    module docstring, step 3)."""
    n = len(L)
    order = stable_ascending(L)
    slot = np.empty(n, dtype=np.int64)
    if band_caps is None:
        slot[order] = np.arange(n, dtype=np.int64)
        return slot
    i = np.arange(n, dtype=np.int64)
    u = np.searchsorted(band_caps, L[order], "left").astype(np.int64)  # a_i, then u_i in place
    u *= G
    u -= i
    np.maximum.accumulate(u, out=u)
    u += i
    u[u >= n] = -1
    slot[order] = u
    return slot


def mix_window(lengths: Sequence[np.ndarray], *, seed: int, cursor: PlanCursor,
               weights: np.ndarray, caps: np.ndarray | None, draws_per_step: int,
               defer: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, PlanCursor]:
    """The window's samples per step, each step one band of lengths (module docstring, 1-4).

    Args:
        lengths: Per source, every sample's length (the length index).
        seed: The ordering seed. cursor: Where the window starts.
        weights: ``[K, S]`` normalised weights of the window's steps.
        caps: ``[K]`` most tokens a sample of each step may have (the sequence-length warmup),
            or None.
        draws_per_step: G.
        defer: False: no sample is deferred (a finite epoch's windows, :mod:`.epoch_end`): one
            that fits no step takes a free slot (step 4's forced placement). The cursor's
            deferred samples are still placed first.

    Returns:
        ``(gid [K, G], length [K, G], counts [K, S], next cursor)``: each step's samples sorted
        by length (ascending), the realised per-step source counts, and the next window's
        cursor (draws, carry, deferred samples).
    """
    ids = SampleIds.of([len(x) for x in lengths])
    S = len(ids.sizes)
    offsets = ids.offsets.tolist()
    w = np.asarray(weights, dtype=np.float64)
    K, G = w.shape[0], int(draws_per_step)
    group_of_step, split, carry = window_counts(w, G, cursor.carry)
    n_groups = len(split)
    owner, _ = ids.split(np.asarray(cursor.deferred, dtype=np.int64))
    D = len(cursor.deferred)
    streams = [_Candidates(seed, s, ids.sizes[s], offsets[s], cursor.drawn[s],
                           [(a, g) for a, (g, o) in enumerate(zip(cursor.deferred, owner))
                            if o == s]) for s in range(S)]
    out_gid = np.empty((K, G), dtype=np.int64)
    out_len = np.empty((K, G), dtype=np.float64)
    counts = np.zeros((K, S), dtype=np.int64)
    deferred: list[tuple[int, int]] = []  # (age, gid) of samples held back by this window
    for g in range(n_groups):
        steps = band_order(caps, np.flatnonzero(group_of_step == g), seed, cursor.window, K)
        band_caps = None if caps is None else np.asarray(caps, dtype=np.float64)[steps]
        gid, age, src, L = _gather(streams, split[g], D, lengths, caps is not None)
        if band_caps is None:  # nothing overflows: the bands are the samples by length
            _place_by_length(out_gid, out_len, counts, steps, gid, src, L)
            del gid, src, L
            continue
        over = np.zeros(0, dtype=np.int64)
        for round_ in range(DEFER_ROUNDS + 1):
            slot = _sweep(L, band_caps, G)
            over = np.flatnonzero(slot < 0)
            room = (MAX_DEFERRED - len(deferred) - sum(len(c.left_over()) for c in streams)
                    if defer else 0)
            if not len(over) or round_ == DEFER_ROUNDS or room <= 0:
                break
            over = over[np.argsort(age[over], kind="stable")][:room]
            deferred += list(zip(age[over].tolist(), gid[over].tolist()))
            keep = np.ones(len(gid), dtype=bool)
            keep[over] = False
            more = _gather(streams, np.bincount(src[over], minlength=S), D, lengths, True)
            gid, age, src, L = (np.concatenate((a[keep], b))
                                for a, b in zip((gid, age, src, L), more))
        if len(over):  # forced: longest into the free slot of the largest cap
            free = np.setdiff1d(np.arange(len(L)), slot[slot >= 0], assume_unique=True)
            slot[over[np.argsort(L[over], kind="stable")]] = free
            pos = np.lexsort((slot, L, slot // G))  # by band, then by length within it
        else:
            pos = np.empty(len(L), dtype=np.int64)
            pos[slot] = np.arange(len(L))  # the sweep's slots follow the lengths in each band
        del slot, age
        _place(out_gid, out_len, counts, steps, gid, src, L, pos)
        del gid, src, L, pos
    left = [item for c in streams for item in c.left_over()] + deferred
    left.sort()
    nxt = PlanCursor(cursor.window + 1,
                     tuple(int(cursor.drawn[s] + streams[s].pulled) for s in range(S)),
                     tuple(float(c) for c in carry), tuple(int(g) for _, g in left))
    return out_gid, out_len, counts, nxt


def _place(out_gid: np.ndarray, out_len: np.ndarray, counts: np.ndarray, steps: np.ndarray,
           gid: np.ndarray, src: np.ndarray, L: np.ndarray, pos: np.ndarray) -> None:
    """Writes band b (``pos[b G:(b + 1) G]`` of a group's samples) to step ``steps[b]``, band
    by band (temporaries of one step, not of the window)."""
    G = out_gid.shape[1]
    for b, step in enumerate(np.asarray(steps).tolist()):
        part = pos[b * G:(b + 1) * G]
        # mode="clip": positions are in range by construction, and a take into ``out`` with
        # the default bounds check copies through a buffer (3x slower)
        np.take(gid, part, out=out_gid[step], mode="clip")
        np.take(L, part, out=out_len[step], mode="clip")
        counts[step] = np.bincount(src[part], minlength=counts.shape[1])


def _place_by_length(out_gid: np.ndarray, out_len: np.ndarray, counts: np.ndarray,
                     steps: np.ndarray, gid: np.ndarray, src: np.ndarray, L: np.ndarray) -> None:
    """:func:`_place` of a group without caps: its samples by length (ties in draw order),
    band b to step ``steps[b]``."""
    _place(out_gid, out_len, counts, steps, gid, src, L, stable_ascending(L))


def _gather(streams: list[_Candidates], counts: np.ndarray, age_base: int,
            lengths: Sequence[np.ndarray], aged: bool
            ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """The next ``counts[s]`` candidates of every source: ``(gid, age, source, length)``, each
    written in place source by source (no per-source copies); ``age`` None unless ``aged``
    (only a capped window defers, and only deferral reads the ages)."""
    c = np.asarray(counts, dtype=np.int64)
    n = int(c.sum())
    gid = np.empty(n, dtype=np.int64)
    age = np.empty(n, dtype=np.int64) if aged else None
    src = np.repeat(np.arange(len(c), dtype=np.int16), c)
    L = np.empty(n, dtype=np.float64)
    lo = 0
    for s, k in enumerate(c.tolist()):
        hi = lo + k
        streams[s].take(k, age_base, gid[lo:hi], None if age is None else age[lo:hi])
        local = gid[lo:hi] - streams[s].offset
        L[lo:hi] = np.asarray(lengths[s])[local]
        del local
        lo = hi
    return gid, age, src, L


def deal_bands(step_lengths: np.ndarray, *, world_size: int, micro_batch: int,
               micro_batches_per_step: int) -> np.ndarray:
    """Positions ``[K, R, M, B]`` into each step's samples (sorted by length, ``[K, G]``), each
    step dealt the cheapest of a few ways (module docstring, step 5).

    The ways: micro-batches of B neighbours dealt whole (no padding; ranks apart by the band's
    spread), or each micro-batch index's R B neighbours cut into h parts, each part dealt
    sample by sample to R/h ranks in tuples of R/h (h = 1: ranks level, a micro-batch spans the
    slice; larger h: narrower micro-batches, ranks apart by the parts' spread). Cheapest: the
    lowest ``idle / K + PADDING_WEIGHT x padding tokens / window tokens``, the step's share of
    the lost compute (DESIGN.md: straggler idle per optimizer step plus padding weighted by
    tokens), padding weighted by :data:`PADDING_WEIGHT`.
    """
    L = np.asarray(step_lengths, dtype=np.float64)
    K = L.shape[0]
    R, B, M = int(world_size), int(micro_batch), int(micro_batches_per_step)
    tokens = max(float(L.sum()), 1.0)
    out = np.empty((K, R, M, B), dtype=np.int64)
    chunk = max(1, CHUNK_SAMPLES // L.shape[1])  # steps at once: bounds the temporaries
    for lo in range(0, K, chunk):
        out[lo:lo + chunk] = _deal_steps(L[lo:lo + chunk], K, tokens, R, B, M)
    return out


def _idle(rank: np.ndarray) -> np.ndarray:
    """Idle per step of ranks' costs ``[steps, R]``: ``1 - mean / max``."""
    return 1 - rank.mean(axis=1) / np.maximum(rank.max(axis=1), 1e-300)


def _parts(world_size: int) -> list[int]:
    """The numbers of parts h a micro-batch index's slice is cut into: 1, 2, 4, ... while h < R
    divides R, at most :data:`MAX_PARTS`."""
    out, h = [], 1
    while h < world_size and world_size % h == 0 and h <= MAX_PARTS:
        out.append(h)
        h *= 2
    return out


def _deal_steps(L: np.ndarray, K: int, tokens: float, R: int, B: int, M: int) -> np.ndarray:
    """:func:`deal_bands` of some of the window's K steps (``L`` ``[steps, G]``, each row
    ascending), scored with the window's K and ``tokens``.

    A step's samples are sorted, so no dealing sorts again (:func:`~.lpt.deal_sorted`), and a
    dealing's padding is known before it is dealt: every rank takes one sample of each tuple,
    so a micro-batch's longest is its sample of the first tuple, and a part of r B samples pads
    ``B x (its r longest) - (its sum)`` whichever rank takes which; and its idle is at least
    that of its groups of ranks (the r ranks that take a part of each micro-batch index share
    the parts' cost). A cut dealing is tried only on the steps where those two bounds score
    below the best dealing so far (one skipped could not have won), lowest bound first (one
    that wins early prunes the rest), and never on a step whose whole dealing idles at most
    :data:`LEVEL_ENOUGH` (most bands are narrow: whole is level)."""
    n, G = L.shape
    cost = sample_cost(L)
    # micro-batches of B neighbours dealt whole: the blocks' costs ascend along each row
    block = cost[:, 0::B].copy()  # each block's cost, summed in order (as .sum(axis) does)
    for j in range(1, B):
        block += cost[:, j::B]
    dealt, rank = deal_sorted(block, R, M)  # [n, R, M]
    best = (dealt * B)[..., None] + np.arange(B)
    idle = _idle(rank)
    pad = B * L[:, B - 1::B].sum(axis=1) - L.sum(axis=1)  # each block ascending
    score = idle / K + PADDING_WEIGHT * pad / tokens
    del dealt, rank, pad
    rows = np.flatnonzero(idle > LEVEL_ENOUGH)
    if not len(rows):
        return best
    score = score[rows]
    cr = cost if len(rows) == n else cost[rows]  # (one step of 16,384 x 8 x 4 is 4 MiB a copy)
    del cost
    cs = np.zeros((len(rows), G + 1))
    np.cumsum(L[rows], axis=1, out=cs[:, 1:])
    ccs = np.zeros((len(rows), G + 1))
    np.cumsum(cr, axis=1, out=ccs[:, 1:])
    mean = ccs[:, -1] / R
    parts = _parts(R)
    floor = np.empty((len(parts), len(rows)))
    bound = np.empty((len(parts), len(rows)))
    for i, h in enumerate(parts):
        r = R // h
        ends = np.arange(1, M * h + 1) * (r * B)  # parts in (micro-batch index, part) order
        floor[i] = PADDING_WEIGHT * (B * (cs[:, ends] - cs[:, ends - r]).sum(axis=1)
                                     - cs[:, -1]) / tokens
        # idle is at least the parts' own: a rank's cost is its parts' (over the micro-batch
        # indices) mean at best, so the costliest group of ranks bounds the step's maximum
        part = (ccs[:, ends] - ccs[:, ends - r * B]).reshape(len(rows), M, h)
        part[:, 1::2] = part[:, 1::2, ::-1]
        bound[i] = floor[i] + (1 - mean / np.maximum(part.sum(axis=1).max(axis=1) / r,
                                                     1e-300)) / K
    del cs, ccs
    # most promising first: each step tries its cut dealing of the lowest bound not tried yet
    # while that bound is below its best score (by more than rounding: a dealing skipped could
    # not have won), so one that wins early prunes the rest. The dealing kept is the one of the
    # lowest score, ties to the earlier in the order whole, h = 1, 2, 4, ...: the same as
    # trying them in that order.
    kept = np.full(len(rows), -1)  # index into parts of the dealing kept; -1: whole, before all
    untried = np.ones(bound.shape, dtype=bool)
    while True:
        open_ = untried & (bound < score * (1 + 1e-9))
        some = np.flatnonzero(open_.any(axis=0))
        if not len(some):
            break
        pick = np.where(open_[:, some], bound[:, some], np.inf).argmin(axis=0)  # ties: lower h
        for i in np.unique(pick).tolist():
            tried = some[pick == i]
            untried[i, tried] = False
            h = parts[i]
            r = R // h
            col, tot = deal_sorted((cr if len(tried) == len(cr) else cr[tried])
                                   .reshape(-1, r * B), r, B)
            tot = tot.reshape(len(tried), M, h, r)
            tot[:, 1::2] = tot[:, 1::2, ::-1]  # odd micro-batches: parts to ranks the other way
            got = _idle(tot.sum(axis=1).reshape(len(tried), R)) / K + floor[i, tried]
            better = (got < score[tried]) | ((got == score[tried]) & (i < kept[tried]))
            if not better.any():
                continue
            won = tried[better]
            pos = col.reshape(len(tried), M, h, r, B)
            if not better.all():
                pos = pos[better]
            del col
            pos += (np.arange(M * h) * (r * B)).reshape(1, M, h, 1, 1)
            pos[:, 1::2] = pos[:, 1::2, ::-1].copy()
            best[rows[won]] = pos.reshape(len(won), M, R, B).transpose(0, 2, 1, 3)
            score[won] = got[better]
            kept[won] = i
            del tot, pos
    return best
