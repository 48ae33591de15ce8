"""Checks of a plan read from a file: it holds exactly the window's draws before it is trusted.

A window's plan is a pure function of global inputs (:mod:`.window`, :mod:`.packs`), and a node's
processes share it through files (:mod:`energon_ordering.pipeline.shared_plans`). A file can be
corrupt (a full disk, a crash, an edit) or planted, so a mapped plan is checked against what any
plan of the window must hold, in O(n log n) for its n ids (a sort of each side; about 0.1 s for
10^6 ids), against the 0.2 s or more of planning it again:

- :func:`plan_matches_draws`: every id is a sample (in ``[0, total)``), and the ids are the
  window's draws (:func:`~.window.window_draws`) as a multiset: no sample dropped, none repeated.
- :func:`plan_matches_inputs`: a padded plan ``[K, R, M, B]`` holds the window's draws, each
  step its count of each source (and with its next cursor, where those counts lead).
- :func:`packed_plan_matches_inputs`: a packed plan's header agrees with the window (sources,
  shape, caps), its per-step counts and carry are the ones its step sizes give at the window's
  weights, its epoch end is where the limits put it, and each step's ids are that step's draws as
  a multiset (``mix="window"``: a window packed whole, the window's, below; a window the
  window mix packs step by step, as the step mix's).

What a check cannot see is the arrangement (which rank and micro-batch gets which draw): that is
the planner's choice, known only by planning again. A file of the right name in a folder only its
user can write (:mod:`~energon_ordering.pipeline.shared_plans`) was planned from the same inputs.
The checks return the reason a plan fails (one phrase, for a log line), or None.

With ``mix="window"`` (:mod:`.window_mix`, :mod:`.window_packs`) a window's samples move
between its steps, so the per-step counts are the planner's choice too; what every valid plan
holds, and the checks compare, is instead:

- the window's totals: each source's samples over the window are the carry rounding of the
  window's total (:func:`~.window_mix.window_totals`; packed: of the window's sample count at
  the window's mean weights), and so is the next cursor's carry; where the schedule switches a
  source inside a padded window, each group of steps with the same zero weights holds its
  split of them (the rule of :func:`~.window_mix.mix_window`, step 2);
- the window's ids: the cursor's deferred samples plus the draws between the two cursors,
  less the next cursor's deferred samples (:func:`~.window.plan_samples`, as a multiset),
  checked without drawing the window again: each id is mapped back by the inverse permutation
  to the draw it is and takes it (one byte per draw), or, for a source the window draws at
  least once over, each sample's copies are counted against its draws (one count per sample of
  the source); the plan is read in chunks of steps, so a window of 2^22 ids is checked in about
  16 MiB;
- per step: no sample of a source at a step where its weight is 0, and (padded, with the
  warmup's caps) no more samples above their step's cap than any placement of the group's
  samples needs (0 unless more fit no step than can be deferred: then the planner places the
  longest over a cap, :data:`~.window_mix.MAX_DEFERRED`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from energon_ordering.errors import OrderingConfigError
from energon_ordering.mixture.step_counts import step_source_counts

from . import window_mix
from .cursor import PlanCursor, advance
from .permutation import permutation_key, permute, unpermute
from .mix import PlannedMix, check_planned_mix
from .packs import PackedWindowPlan
from .sample_ids import SampleIds
from .window import check_caps, window_draws

__all__ = ["ids_out_of_range", "packed_plan_matches_inputs", "plan_matches_draws",
           "plan_matches_inputs"]

#: Values before a packed plan's per-source fields (see PackedWindowPlan.to_array).
_HEAD = 7


def ids_out_of_range(ids: np.ndarray, total: int) -> str | None:
    """Why ``ids`` are not all sample ids of ``total`` samples (``[0, total)``), or None."""
    flat = np.asarray(ids).reshape(-1)
    if not flat.size:
        return None
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= int(total):
        return f"sample id {lo if lo < 0 else hi} lies outside [0, {int(total)})"
    return None


def plan_matches_draws(ids: np.ndarray, draws: np.ndarray, total: int | None) -> str | None:
    """Why ``ids`` (any shape) are not the multiset ``draws`` of sample ids in ``[0, total)``,
    or None.

    Args:
        ids: A plan's sample ids (e.g. a window's ``[K, R, M, B]``, possibly a memory map).
        draws: The window's draws, any order (:func:`~.window.window_draws`).
        total: Samples of all sources (None: the range is not checked apart; ids equal to
            valid draws are in it).
    """
    why = None if total is None else ids_out_of_range(ids, total)
    if why is not None:
        return why
    got = np.array(np.asarray(ids).reshape(-1), dtype=np.int64)  # copies: sorted in place
    want = np.array(np.asarray(draws).reshape(-1), dtype=np.int64)
    if len(got) != len(want):
        return f"it holds {len(got)} sample ids, the window draws {len(want)}"
    got.sort()
    want.sort()
    differ = np.flatnonzero(got != want)
    if not differ.size:
        return None
    x = int(min(got[differ[0]], want[differ[0]]))

    def times(a: np.ndarray) -> int:
        return int(np.searchsorted(a, x, "right") - np.searchsorted(a, x, "left"))

    return f"sample id {x} appears {times(got)} time(s) in it, {times(want)} in the window's draws"


def plan_matches_inputs(
    ids: np.ndarray,
    *,
    seed: int,
    sizes: Sequence[int],
    cursor: PlanCursor,
    weights: np.ndarray,
    next_cursor: PlanCursor | None = None,
    mix: PlannedMix = "step",
    caps: np.ndarray | Sequence[int] | None = None,
    lengths: Sequence[np.ndarray] | None = None,
) -> str | None:
    """Why ``ids`` ``[K, R, M, B]`` are not a plan :func:`~.window.plan_window` makes of the
    window from these inputs, or None.

    Checked: every id is a sample; with ``mix="step"`` each step's count of each source (the
    step's weights x G with the carry), the next cursor (if given) where those counts lead,
    and the ids as the window's draws; with ``mix="window"`` the module docstring's list (the
    next cursor's carry, draws and deferred samples, no sample at a zero weight, each group of
    steps' counts, the caps, the ids as :func:`~.window.plan_samples`). Not checked: which rank
    and micro-batch holds which sample (the planner's choice).

    Args:
        ids: The plan's ids (possibly a memory map).
        seed, sizes, cursor, weights: As given to :func:`~.window.plan_window` (``sizes``:
            samples per source; ``weights``: ``[K, S]``).
        next_cursor: The plan's next cursor, read with it (``mix="window"``: required, its
            deferred samples are part of the plan).
        mix: ``planned_mix``, as given to :func:`~.window.plan_window`.
        caps: ``mix="window"``: the ``[K]`` caps given to :func:`~.window.plan_window`, or None.
        lengths: Per source, every sample's length (the length index); needed with ``caps``.

    Raises:
        OrderingConfigError: a ``mix`` other than ``"step"``/``"window"``, ``ids`` that are not
            ``[K, R, M, B]`` for the ``[K, S]`` weights, ``mix="window"`` without
            ``next_cursor``, or ``caps`` without ``lengths`` (or not K ints >= 1).
    """
    mix = check_planned_mix(mix)
    a = np.asarray(ids)
    w = np.asarray(weights, dtype=np.float64)
    S = len(sizes)
    if a.ndim != 4 or w.shape != (a.shape[0], S):
        raise OrderingConfigError(
            f"plan check: ids of shape {a.shape} and weights of shape {w.shape}; give ids "
            f"[K, R, M, B] and weights [K, sources={S}] of the same window.")
    total = SampleIds.of(sizes).total
    why = ids_out_of_range(a, total)
    if why is not None:
        return why
    K = a.shape[0]
    flat = a.reshape(K, -1)
    G = flat.shape[1]
    if mix == "step":
        counts, carry = step_source_counts(w, G, cursor.carry)
        why = _step_sources(_step_counts(flat, SampleIds.of(sizes)), w, counts)
        if why is None and next_cursor is not None and not _same_cursor(
                next_cursor, advance(cursor, counts, carry)):
            why = "its next cursor is not where the window's counts lead"
        return why or plan_matches_draws(a, window_draws(sizes, seed, cursor, counts), total)
    if next_cursor is None:
        raise OrderingConfigError(
            "plan check: next_cursor = None with mix = 'window'; pass the cursor read with the "
            "plan (its deferred samples are part of the plan).")
    if caps is not None and lengths is None:
        raise OrderingConfigError(
            "plan check: lengths = None with caps given; pass lengths = the per-source length "
            "arrays the plan was made from (to check the caps), or caps = None.")
    return _window_plan_problem(flat, seed=seed, sizes=sizes, cursor=cursor,
                                nxt=next_cursor, w=w, caps=check_caps(caps, K),
                                lengths=lengths)


def _window_plan_problem(ids: np.ndarray, *, seed: int, sizes: Sequence[int],
                         cursor: PlanCursor, nxt: PlanCursor, w: np.ndarray,
                         caps: np.ndarray | None,
                         lengths: Sequence[np.ndarray] | None) -> str | None:
    """:func:`plan_matches_inputs` of a ``mix="window"`` plan (``ids``: ``[K, G]``), read in
    chunks of steps (a window's plan may be 2^22 ids: its check holds a few MiB beside them)."""
    split_ids = SampleIds.of(sizes)
    S, G = len(sizes), ids.shape[1]
    later = np.asarray(nxt.deferred, dtype=np.int64)
    if nxt.window != cursor.window + 1 or len(nxt.drawn) != S or len(nxt.carry) != S:
        return (f"its next cursor (window {nxt.window}) is not a cursor of window "
                f"{cursor.window + 1}")
    if len(later) > window_mix.MAX_DEFERRED:
        return f"its next cursor defers {len(later)} samples, more than {window_mix.MAX_DEFERRED}"
    why = ids_out_of_range(later, split_ids.total)
    if why is not None:
        return f"its next cursor's deferred {why}"
    group, split, carry = window_mix.window_counts(w, G, cursor.carry)
    if not _same_bits(nxt.carry, carry):
        return f"its carry {list(nxt.carry)} is not the window's {carry.tolist()}"
    held = np.bincount(split_ids.split(np.asarray(cursor.deferred, dtype=np.int64))[0],
                       minlength=S)
    want = (np.asarray(cursor.drawn, dtype=np.int64) + split.sum(axis=0)
            + np.bincount(split_ids.split(later)[0], minlength=S) - held)
    if tuple(int(x) for x in want) != tuple(nxt.drawn) or (want < cursor.drawn).any():
        return (f"it draws the sources up to {list(nxt.drawn)}, the window's totals and "
                f"deferrals to {want.tolist()}")
    counts = _step_counts(ids, split_ids)
    why = _step_sources(counts, w, None)
    if why is not None:
        return why
    for g in range(len(split)):
        steps = np.flatnonzero(group == g)
        got = counts[steps].sum(axis=0)
        if not np.array_equal(got, split[g]):
            return (f"its steps {steps.tolist()} hold {got.tolist()} samples per source, the "
                    f"window's share of them {split[g].tolist()}")
    if caps is not None and lengths is not None:
        why = _over_caps(ids, group, caps, lengths, split_ids)
        if why is not None:
            return why
    # the ids and the samples the next cursor defers are the deferred ones plus the new draws
    return _window_samples_problem(ids, later, sizes, seed, cursor, nxt)


#: Ids a window-mix check reads at once (a chunk of the plan's steps).
_CHUNK_IDS = 1 << 17


def _row_chunks(ids: np.ndarray):
    """``(first step, rows)`` of ``ids`` ``[K, G]`` in chunks of about :data:`_CHUNK_IDS`."""
    rows = max(1, _CHUNK_IDS // max(1, ids.shape[1]))
    for lo in range(0, ids.shape[0], rows):
        yield lo, np.asarray(ids[lo:lo + rows])


def _step_counts(ids: np.ndarray, split_ids: SampleIds) -> np.ndarray:
    """``[K, S]`` samples per step and source of ``ids`` ``[K, G]`` (in range), read in
    chunks of steps."""
    counts = np.zeros((ids.shape[0], len(split_ids.sizes)), dtype=np.int64)
    for lo, rows in _row_chunks(ids):
        counts[lo:lo + len(rows)] = split_ids.source_counts(rows)
    return counts


def _over_caps(ids: np.ndarray, group: np.ndarray, caps: np.ndarray,
               lengths: Sequence[np.ndarray], split_ids: SampleIds) -> str | None:
    """Why a window-mix plan's ``ids`` ``[K, G]`` hold more samples above their step's cap than
    their group of steps must (:func:`_fewest_over`), or None."""
    c = np.asarray(caps, dtype=np.float64)
    G = ids.shape[1]
    groups = int(group.max()) + 1
    n_over = np.zeros(groups, dtype=np.int64)
    first_over: list[tuple[int, int, float] | None] = [None] * groups
    fits = [np.zeros(int((group == g).sum()) + 1, dtype=np.int64) for g in range(groups)]
    sorted_caps = [np.sort(c[group == g]) for g in range(groups)]
    for lo, rows in _row_chunks(ids):
        src, within = split_ids.split(rows)
        L = np.empty(rows.shape, dtype=np.float64)
        for s in range(len(split_ids.sizes)):
            mine = src == s
            L[mine] = np.asarray(lengths[s])[within[mine]]
        del src, within
        over = L > c[lo:lo + len(rows), None]
        for g in range(groups):
            mine = np.flatnonzero(group[lo:lo + len(rows)] == g)
            if not len(mine):
                continue
            hit = over[mine]
            n_over[g] += int(hit.sum())
            if first_over[g] is None and hit.any():
                t, j = (int(x) for x in np.argwhere(hit)[0])
                first_over[g] = (lo + int(mine[t]), j, float(L[mine[t], j]))
            fits[g] += np.bincount(np.searchsorted(sorted_caps[g], L[mine].reshape(-1), "left"),
                                   minlength=len(fits[g]))
    for g in range(groups):
        steps = np.flatnonzero(group == g)
        fewest = _fewest_over(fits[g], G)
        if n_over[g] > fewest:
            t, _, length = first_over[g]
            return (f"its step {t} holds a sample of {length:g} tokens above "
                    f"the step's cap {int(c[t])} ({int(n_over[g])} above their caps in its "
                    f"steps {steps.tolist()}, where the fewest possible is {fewest})")
    return None


def _fewest_over(first_fit: np.ndarray, G: int) -> int:
    """The fewest samples that any placement into K steps of ``G`` samples puts above their
    step's cap, from ``first_fit`` ``[K + 1]``: how many samples first fit the p-th smallest cap
    (K: none). It is the largest excess, over p, of the samples fitting only the steps with the
    p smallest caps excluded over those steps' slots (Hall's theorem; the window mix's sweep
    places all but this many)."""
    K = len(first_fit) - 1
    need = np.cumsum(first_fit[::-1])[::-1]
    room = (K - np.arange(K + 1)) * int(G)
    return int(max(0, int((need - room).max())))


def _window_samples_problem(ids: np.ndarray, later: np.ndarray, sizes: Sequence[int], seed: int,
                            cursor: PlanCursor, nxt: PlanCursor) -> str | None:
    """Why ``ids`` ``[K, G]`` plus the next cursor's deferred ``later`` are not the cursor's
    deferred samples plus the draws between the two cursors, as a multiset
    (:func:`~.window.plan_samples`), or None.

    Without drawing the window again, source by source:

    - a source the window draws fewer times than it has samples (its draws cross at most one
      epoch end): each id is mapped back by the inverse permutation to the draw it is in each
      epoch the draws cross, and takes one of them not yet taken, else one of the cursor's
      deferred copies of it (one byte per draw);
    - a source drawn at least once over: how often each of its samples is drawn (once per whole
      epoch, plus the two partial epochs' draws) against how often the plan holds it (a count
      per sample of the source).

    The counts being equal, every id finding a place of its own is the multisets being equal.
    The plan is read in chunks of :data:`_CHUNK_IDS`."""
    split_ids = SampleIds.of(sizes)
    S = len(sizes)
    first = [int(cursor.drawn[s]) for s in range(S)]
    count = [int(nxt.drawn[s]) - first[s] for s in range(S)]
    n_got = ids.size + len(later)
    n_want = len(cursor.deferred) + sum(count)
    if n_got != n_want:
        return f"it holds {n_got} sample ids, the window draws {n_want}"
    held: dict[int, int] = {}
    for g in cursor.deferred:
        held[int(g)] = held.get(int(g), 0) + 1
    counted = [count[s] >= split_ids.sizes[s] for s in range(S)]
    times = [_drawn_times(seed, s, split_ids.sizes[s], first[s], count[s]) if counted[s]
             else None for s in range(S)]
    for g, k in held.items():  # a counted source's deferred copies are counted with its draws
        (s,), (i,) = split_ids.split(np.array([g]))
        if counted[s]:
            times[s][i] += k
    taken = [None if counted[s] else np.zeros(count[s], dtype=bool) for s in range(S)]
    # the source epochs the draws of each source not counted cross (at most two)
    epochs = [range(f // n, (f + c - 1) // n + 1) if c and not k else range(0)
              for f, c, n, k in zip(first, count, split_ids.sizes, counted)]
    keys = {(s, e): permutation_key(seed, s, e) for s in range(S) for e in epochs[s]}
    offsets = split_ids.offsets

    def chunks():
        for _, rows in _row_chunks(ids):
            yield rows.reshape(-1)
        yield np.asarray(later, dtype=np.int64)

    for part in chunks():
        src, within = split_ids.split(part)
        for s in np.unique(src).tolist():
            left = within[src == s]
            size = split_ids.sizes[s]
            if counted[s]:
                _subtract_counts(times[s], left)
                continue
            for e in epochs[s]:
                d = e * size + unpermute(left, size, keys[s, e]) - first[s]
                fits = np.flatnonzero((d >= 0) & (d < count[s]))
                fits = fits[~taken[s][d[fits]]]
                _, once = np.unique(d[fits], return_index=True)  # one id per draw in a chunk
                fits = fits[once]
                taken[s][d[fits]] = True
                keep = np.ones(len(left), dtype=bool)
                keep[fits] = False
                left = left[keep]
                if not len(left):
                    break
            for i in left.tolist():  # not a draw of the window: one of the deferred copies
                g = int(offsets[s]) + int(i)
                if held.get(g, 0) < 1:
                    return _times_message(g, ids, later, cursor, split_ids, seed, first, count)
                held[g] -= 1
    for s in range(S):
        if counted[s] and times[s].any():
            i = int(np.flatnonzero(times[s])[0])
            return _times_message(int(offsets[s]) + i, ids, later, cursor, split_ids, seed,
                                  first, count)
    return None


#: Samples of a source whose copies :func:`_subtract_counts` counts at once (its int64
#: temporary: 8 MiB, whatever the source's size).
_COUNT_BLOCK = 1 << 20


def _subtract_counts(times: np.ndarray, ids: np.ndarray) -> None:
    """``times[i] -= (copies of i in ids)``, a block of :data:`_COUNT_BLOCK` samples at a
    time."""
    for lo in range(0, len(times), _COUNT_BLOCK):
        hi = min(lo + _COUNT_BLOCK, len(times))
        here = ids if len(times) <= _COUNT_BLOCK else ids[(ids >= lo) & (ids < hi)]
        if len(here):
            np.subtract(times[lo:hi], np.bincount(here - lo, minlength=hi - lo), out=times[lo:hi],
                        casting="unsafe")


def _drawn_times(seed: int, source: int, size: int, first: int, count: int) -> np.ndarray:
    """How often each sample of a source is among its draws ``first .. first + count - 1``
    (int32 ``[size]``): once per whole epoch the draws cover, plus the drawn positions of the
    (at most two) epochs they cover in part, permuted a chunk at a time."""
    times = np.zeros(size, dtype=np.int32)
    if not count:
        return times
    for e in range(first // size, (first + count - 1) // size + 1):
        lo = max(first, e * size) - e * size
        hi = min(first + count, (e + 1) * size) - e * size
        if lo == 0 and hi == size:
            times += 1
            continue
        key = permutation_key(seed, source, e)
        for a in range(lo, hi, _CHUNK_IDS):  # an epoch's positions are distinct samples
            times[permute(np.arange(a, min(a + _CHUNK_IDS, hi), dtype=np.int64), size, key)] += 1
    return times


def _times_message(x: int, ids: np.ndarray, later: np.ndarray, cursor: PlanCursor,
                   split_ids: SampleIds, seed: int, first: list[int], count: list[int]) -> str:
    """The reason naming how often sample ``x`` is in the plan and in the window's draws."""
    got = sum(int(np.count_nonzero(rows == x)) for _, rows in _row_chunks(ids))
    got += int(np.count_nonzero(np.asarray(later) == x))
    (s,), (i,) = split_ids.split(np.array([x]))
    size = split_ids.sizes[s]
    want = sum(int(g) == x for g in cursor.deferred)
    want += int(_drawn_times(seed, int(s), size, first[s], count[s])[i]) if count[s] else 0
    return f"sample id {x} appears {got} time(s) in it, {want} in the window's draws"


def _step_sources(held: np.ndarray, w: np.ndarray, counts: np.ndarray | None
                  ) -> str | None:
    """Why the steps' samples per source ``held`` (``[steps, S]``) put a sample at a step
    whose weight for its source is 0, or (``counts`` given) differ from the steps' counts, or
    None."""
    for t, got in enumerate(np.asarray(held)):
        zero = np.flatnonzero((got > 0) & (w[t] == 0))
        if zero.size:
            s = int(zero[0])
            return (f"its step {t} holds {int(got[s])} sample(s) of source {s}, whose weight "
                    "there is 0")
        if counts is not None and not np.array_equal(got, counts[t]):
            return (f"its step {t} holds {got.tolist()} samples per source, the step's counts "
                    f"are {np.asarray(counts[t]).tolist()}")
    return None


def _same_bits(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> bool:
    """Whether two carries are the same float64 values, bit for bit."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return x.shape == y.shape and np.array_equal(x.view(np.int64), y.view(np.int64))


def _same_cursor(a: PlanCursor, b: PlanCursor) -> bool:
    return (a.window, tuple(a.drawn), tuple(a.deferred)) == (b.window, tuple(b.drawn),
                                                             tuple(b.deferred)) \
        and _same_bits(a.carry, b.carry)


def _packs_whole_window(w: np.ndarray, caps: Sequence[int], carry: np.ndarray,
                        drawn: np.ndarray, limits: np.ndarray | None, G: int) -> bool:
    """Whether ``mix="window"`` packs the window whole (:func:`~.window_packs.plan_window_packs`
    does not fall back to the step mix): no drawn source switched on or off, one cap, and the
    window's fewest samples within a finite epoch's limits."""
    active = w.sum(axis=0) > 0
    if ((w == 0) & active[None, :]).any() or len({int(c) for c in caps}) > 1:
        return False
    if limits is None:
        return True
    c, _ = step_source_counts(w.mean(axis=0)[None, :], len(w) * G, carry)
    return not (c[0] > limits - drawn).any()


def packed_plan_matches_inputs(
    flat: np.ndarray,
    *,
    seed: int,
    sizes: Sequence[int],
    cursor: PlanCursor,
    weights: np.ndarray,
    caps: Sequence[int],
    shape: tuple[int, int, int],
    epoch_limits: Sequence[int] | None = None,
    mix: PlannedMix = "step",
) -> str | None:
    """Why ``flat`` (:meth:`~.packs.PackedWindowPlan.to_array`) is not a packed plan of the window
    :func:`~.packs.plan_packed_window` plans from these inputs, or None.

    Checked: the header (sources, ``(R, M, B)``, steps, size); the caps; the counts and the
    carry after them, recomputed (the step mix, and a window the window mix packs step by step:
    each step's from its sample count at its weights; a window the window mix packs whole: the
    window's from its sample count at the window's mean weights, all K steps, each at least one
    sample per pack); the next cursor; the epoch end (only before a step the limits refuse);
    the packs' offsets; each step's sources (its counts, no sample at a zero weight); and the
    ids as the multiset of the draws (the step mix: each step's). Not checked: which pack
    holds which draw, and whether a pack's tokens fit its cap (the planner's choices).

    Args:
        flat: The file's values (int64, 1-D).
        seed, sizes, cursor, weights, caps, shape, epoch_limits, mix: As given to
            :func:`~.packs.plan_packed_window` (``shape``: R, M, B).

    Raises:
        OrderingConfigError: a ``mix`` other than ``"step"``/``"window"``.
    """
    mix = check_planned_mix(mix)
    a = np.asarray(flat).reshape(-1)
    S, K = len(sizes), len(caps)
    R, M, B = (int(x) for x in shape)
    G = R * M * B
    if len(a) < _HEAD:
        return f"it holds {len(a)} values, fewer than a packed plan's header"
    steps, end, s_, r_, m_, b_, n = (int(x) for x in a[:_HEAD])
    if (s_, r_, m_, b_) != (S, R, M, B):
        return (f"its header names {s_} sources and (R, M, B) = ({r_}, {m_}, {b_}), the window "
                f"{S} and {(R, M, B)}")
    if not (0 <= steps <= K and end in (0, 1) and n >= 0):
        return f"its header is not a window's (steps {steps} of {K}, epoch end {end}, {n} ids)"
    size = _HEAD + 2 * S + steps * S + steps + steps * G + 1 + n
    if len(a) != size:
        return f"it holds {len(a)} values, its header {size}"
    plan = PackedWindowPlan.from_array(a, cursor)
    if plan.caps.tolist() != [int(c) for c in caps[:steps]]:
        return f"its caps {plan.caps.tolist()} are not the window's {list(caps[:steps])}"
    counts = plan.counts
    if (counts < 0).any():
        return f"its counts {counts.tolist()} are not samples per step and source"
    w = np.asarray(weights, dtype=np.float64)
    carry = np.asarray(cursor.carry, dtype=np.float64)
    drawn = np.asarray(cursor.drawn, dtype=np.int64)
    limits = None if epoch_limits is None else np.asarray(epoch_limits, dtype=np.int64)
    whole = mix == "window" and _packs_whole_window(w, caps, carry, drawn, limits, G)
    why = (_packed_window_counts if whole else _packed_step_counts)(
        plan, w, carry, drawn, limits, G, K)
    if why is not None:
        return why
    offsets = plan.offsets
    if (int(offsets[0]) != 0 or int(offsets[-1]) != n or (np.diff(offsets) < 0).any()
            or not np.array_equal(np.diff(offsets[::G]), counts.sum(axis=1))):
        return "its pack offsets do not split its ids into its steps' packs"
    total = int(sum(int(x) for x in sizes))
    why = ids_out_of_range(plan.ids, total)
    if why is not None:
        return why
    step_ids = [plan.ids[offsets[t * G]:offsets[(t + 1) * G]] for t in range(steps)]
    # each step's counts (the step mix: implied by each step's draws, checked below)
    split_ids = SampleIds.of(sizes)
    held = np.array([np.bincount(split_ids.split(x)[0], minlength=S) for x in step_ids],
                    dtype=np.int64).reshape(len(step_ids), S)
    why = _step_sources(held, w, counts if whole else None)
    if why is not None:
        return why
    draws = window_draws(sizes, seed, cursor, counts)
    if whole:  # the window's draws, any step
        return plan_matches_draws(plan.ids, draws, total)
    # source s's draws in step t: its draws cum[t-1, s] .. cum[t, s] (steps draw in turn)
    first = np.concatenate(([0], np.cumsum(counts.sum(axis=0))[:-1]))
    cum = np.vstack((np.zeros((1, S), dtype=np.int64), np.cumsum(counts, axis=0)))
    for t in range(steps):
        want = np.concatenate([draws[first[s] + cum[t, s]:first[s] + cum[t + 1, s]]
                               for s in range(S)])
        why = plan_matches_draws(step_ids[t], want, total)
        if why is not None:
            return f"its step {t}: {why}"
    return None


def _packed_step_counts(plan: PackedWindowPlan, w: np.ndarray, carry: np.ndarray,
                        drawn: np.ndarray, limits: np.ndarray | None, G: int, K: int
                        ) -> str | None:
    """Why a packed plan's counts, next cursor and epoch end are not the step mix's (each step
    its sample count at its weights with the carry), or None."""
    counts, steps = plan.counts, plan.steps
    for t in range(steps):
        if counts[t].sum() < G:
            return f"its step {t} counts {counts[t].tolist()} samples per source"
        c, carry = step_source_counts(w[t][None], int(counts[t].sum()), carry)
        if not np.array_equal(c[0], counts[t]):
            return (f"its step {t} counts {counts[t].tolist()} samples per source; "
                    f"{int(counts[t].sum())} at the step's weights are {c[0].tolist()}")
        drawn = drawn + counts[t]
        if limits is not None and (drawn > limits).any():
            return f"its step {t} draws beyond the epoch's end {limits.tolist()}"
    if not _same_next(plan.next_cursor, drawn, carry):
        return "its next cursor is not where its steps' counts lead"
    if plan.epoch_end != (steps < K):
        return f"it has {steps} of {K} steps and {'an' if plan.epoch_end else 'no'} epoch end"
    if plan.epoch_end:
        c, _ = step_source_counts(w[steps][None], G, carry)
        if limits is None or not (c[0] > limits - drawn).any():
            return f"it ends the epoch after step {steps}, before a step the sources still hold"
    return None


def _packed_window_counts(plan: PackedWindowPlan, w: np.ndarray, carry: np.ndarray,
                          drawn: np.ndarray, limits: np.ndarray | None, G: int, K: int
                          ) -> str | None:
    """Why a packed plan's counts, next cursor and epoch end are not those of a window the
    window mix packs whole (:mod:`.window_packs`), or None."""
    counts = plan.counts
    if plan.epoch_end or plan.steps != K:
        return (f"it has {plan.steps} of {K} steps and {'an' if plan.epoch_end else 'no'} epoch "
                f"end; a window packed whole has {K} and none")
    low = np.flatnonzero(counts.sum(axis=1) < G)
    if low.size:
        t = int(low[0])
        return f"its step {t} counts {counts[t].tolist()} samples per source, fewer than {G} packs"
    n = int(counts.sum())
    c, carry = step_source_counts(w.mean(axis=0)[None, :], n, carry)
    if not np.array_equal(c[0], counts.sum(axis=0)):
        return (f"its steps count {counts.sum(axis=0).tolist()} samples per source; {n} at the "
                f"window's weights are {c[0].tolist()}")
    drawn = drawn + c[0]
    if limits is not None and (drawn > limits).any():
        return f"its window draws beyond the epoch's end {limits.tolist()}"
    if not _same_next(plan.next_cursor, drawn, carry):
        return "its next cursor is not where its window's counts lead"
    return None


def _same_next(nxt: PlanCursor, drawn: np.ndarray, carry: np.ndarray) -> bool:
    """Whether ``nxt`` draws up to ``drawn`` with ``carry`` (bit for bit)."""
    return tuple(int(d) for d in drawn) == tuple(nxt.drawn) and _same_bits(nxt.carry, carry)
