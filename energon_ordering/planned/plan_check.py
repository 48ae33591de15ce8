"""Checks of a plan read from a file: it holds exactly the window's draws before it is trusted.

A window's plan is a pure function of global inputs (:mod:`.window`, :mod:`.packs`), and a node's
processes share it through files (:mod:`energon_ordering.pipeline.shared_plans`). A file can be
corrupt (a full disk, a crash, an edit) or planted, so a mapped plan is checked against what any
plan of the window must hold, in O(n log n) for its n ids (a sort of each side; about 0.1 s for
10^6 ids), against the 0.2 s or more of planning it again:

- :func:`plan_matches_draws`: every id is a sample (in ``[0, total)``), and the ids are the
  window's draws (:func:`~.window.window_draws`) as a multiset: no sample dropped, none repeated.
- :func:`packed_plan_matches_inputs`: a packed plan's header agrees with the window (sources,
  shape, caps), its per-step counts and carry are the ones its step sizes give at the window's
  weights, its epoch end is where the limits put it, and each step's ids are that step's draws as
  a multiset.

What a check cannot see is the arrangement (which rank and micro-batch gets which draw): that is
the planner's choice, known only by planning again. A file of the right name in a folder only its
user can write (:mod:`~energon_ordering.pipeline.shared_plans`) was planned from the same inputs.
The checks return the reason a plan fails (one phrase, for a log line), or None.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from energon_ordering.mixture.step_counts import step_source_counts

from .cursor import PlanCursor
from .packs import PackedWindowPlan
from .window import window_draws

__all__ = ["ids_out_of_range", "packed_plan_matches_inputs", "plan_matches_draws"]

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
) -> str | None:
    """Why ``flat`` (:meth:`~.packs.PackedWindowPlan.to_array`) is not a packed plan of the window
    :func:`~.packs.plan_packed_window` plans from these inputs, or None.

    Checked: the header (sources, ``(R, M, B)``, steps, size); the caps; each step's source counts
    and the carry after it, recomputed from the step's sample count at its weights; the next
    cursor; the epoch end (only before a step the limits refuse); the packs' offsets; and each
    step's ids as the multiset of its draws. Not checked: which pack holds which draw, and
    whether a pack's tokens fit its cap (the planner's choices).

    Args:
        flat: The file's values (int64, 1-D).
        seed, sizes, cursor, weights, caps, shape, epoch_limits: As given to
            :func:`~.packs.plan_packed_window` (``shape``: R, M, B).
    """
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
    w = np.asarray(weights, dtype=np.float64)
    carry = np.asarray(cursor.carry, dtype=np.float64)
    drawn = np.asarray(cursor.drawn, dtype=np.int64)
    limits = None if epoch_limits is None else np.asarray(epoch_limits, dtype=np.int64)
    for t in range(steps):
        if (counts[t] < 0).any() or counts[t].sum() < G:
            return f"its step {t} counts {counts[t].tolist()} samples per source"
        c, carry = step_source_counts(w[t][None], int(counts[t].sum()), carry)
        if not np.array_equal(c[0], counts[t]):
            return (f"its step {t} counts {counts[t].tolist()} samples per source; "
                    f"{int(counts[t].sum())} at the step's weights are {c[0].tolist()}")
        drawn = drawn + counts[t]
        if limits is not None and (drawn > limits).any():
            return f"its step {t} draws beyond the epoch's end {limits.tolist()}"
    if (tuple(int(d) for d in drawn) != plan.next_cursor.drawn
            or not np.array_equal(np.asarray(carry, dtype=np.float64).view(np.int64),
                                  np.asarray(plan.next_cursor.carry).view(np.int64))):
        return "its next cursor is not where its steps' counts lead"
    if plan.epoch_end != (steps < K):
        return f"it has {steps} of {K} steps and {'an' if plan.epoch_end else 'no'} epoch end"
    if plan.epoch_end:
        c, _ = step_source_counts(w[steps][None], G, carry)
        if limits is None or not (c[0] > limits - drawn).any():
            return f"it ends the epoch after step {steps}, before a step the sources still hold"
    offsets = plan.offsets
    if (int(offsets[0]) != 0 or int(offsets[-1]) != n or (np.diff(offsets) < 0).any()
            or not np.array_equal(np.diff(offsets[::G]), counts.sum(axis=1))):
        return "its pack offsets do not split its ids into its steps' packs"
    draws = window_draws(sizes, seed, cursor, counts)
    # source s's draws in step t: its draws cum[t-1, s] .. cum[t, s] (steps draw in turn)
    first = np.concatenate(([0], np.cumsum(counts.sum(axis=0))[:-1]))
    cum = np.vstack((np.zeros((1, S), dtype=np.int64), np.cumsum(counts, axis=0)))
    total = int(sum(int(x) for x in sizes))
    for t in range(steps):
        want = np.concatenate([draws[first[s] + cum[t, s]:first[s] + cum[t + 1, s]]
                               for s in range(S)])
        why = plan_matches_draws(plan.ids[offsets[t * G]:offsets[(t + 1) * G]], want, total)
        if why is not None:
            return f"its step {t}: {why}"
    return None
