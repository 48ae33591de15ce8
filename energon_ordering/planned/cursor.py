"""Cursor arithmetic: which draws of each source a window of steps uses.

The plan draws each source in the order of its permutation (:mod:`.permutation`), one source
epoch after the other: the d-th draw of source s (counting from 0 over the whole run) is sample
``permute(d mod N_s, N_s, permutation_key(seed, s, d // N_s))``. Each source has its own epochs:
a source repeats when its own samples are used up, as Energon's blend of repeating datasets
does, so a small source with a large weight is seen more often, and every sample of a source
appears exactly once in each of that source's epochs.

The number of draws of source s before window w is the sum of its per-step counts
(:func:`energon_ordering.mixture.step_counts.step_source_counts`) over the steps before the
window; it equals the integral of ``weight x G`` plus the carry (within one sample of it). A
:class:`PlanCursor` holds those sums and the carry at a window boundary: a few dozen bytes, from
which the next window is planned exactly (:func:`advance`), and from which "was sample i
drawn yet" is a closed form (:func:`drawn_mask`). :func:`cursor_at` recomputes a cursor from
step 0 (O(steps), about 10 us per step), for a state that did not keep it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from energon_ordering.errors import OrderingConfigError, show
from energon_ordering.mixture.step_counts import step_source_counts

from .permutation import permutation_key, permute, unpermute

__all__ = ["PlanCursor", "advance", "check_window_steps", "cursor_at", "draws", "drawn_mask"]


def check_window_steps(window_steps: object) -> int:
    """``plan_window_steps`` as an int >= 1, or a typed error naming the field."""
    if isinstance(window_steps, bool) or not isinstance(window_steps, (int, np.integer)) \
            or int(window_steps) < 1:
        raise OrderingConfigError(
            f"plan_window_steps = {show(window_steps)}: the plan balances ranks over windows of "
            "this many optimizer steps; give an int >= 1 (the default is measured by "
            "tools/bench_planned.py)."
        )
    return int(window_steps)


@dataclass(frozen=True)
class PlanCursor:
    """Where the plan stands at the start of a window.

    Attributes:
        window: Index of the next window (0 at the start of training).
        drawn: Draws of each source before it (over all source epochs).
        carry: ``counted - integral`` per source (see ``step_counts``), in samples.
        deferred: ``planned_mix="window"`` only: global ids of drawn samples that fit no step
            of an earlier window (the warmup's caps), oldest first; the next windows place them
            before new draws of their source (:mod:`.window_mix`). Empty otherwise, so a cursor
            saved without it (three fields) loads as before.
    """

    window: int
    drawn: tuple[int, ...]
    carry: tuple[float, ...]
    deferred: tuple[int, ...] = ()

    @classmethod
    def start(cls, n_sources: int) -> PlanCursor:
        return cls(0, (0,) * n_sources, (0.0,) * n_sources)

    def epochs(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """The epoch each source is in (its completed passes)."""
        return tuple(d // int(n) for d, n in zip(self.drawn, sizes))


def advance(cursor: PlanCursor, counts: np.ndarray, carry: np.ndarray) -> PlanCursor:
    """The cursor after a window whose per-step counts are ``counts`` ``[steps, sources]`` and
    whose carry after its last step is ``carry``."""
    total = np.asarray(counts, dtype=np.int64).sum(axis=0)
    return PlanCursor(cursor.window + 1,
                      tuple(int(d + n) for d, n in zip(cursor.drawn, total)),
                      tuple(float(c) for c in carry), cursor.deferred)


def cursor_at(window: int, *, window_steps: int, draws_per_step: int,
              weights: Callable[[np.ndarray], np.ndarray], chunk: int = 1 << 14) -> PlanCursor:
    """The cursor at the start of ``window``, recomputed from step 0.

    Args:
        window: Window index (>= 0).
        window_steps: Steps per window (``plan_window_steps``).
        draws_per_step: G = world size x micro-batches per step x micro-batch.
        weights: ``steps -> [len(steps), sources]`` normalised weights (e.g.
            ``schedule.weights_table``).
        chunk: Steps evaluated at once.
    """
    k = check_window_steps(window_steps)
    end = int(window) * k
    carry = None
    drawn = None
    for lo in range(0, end, chunk):
        table = np.asarray(weights(np.arange(lo, min(end, lo + chunk))), dtype=np.float64)
        counts, carry = step_source_counts(table, draws_per_step, carry)
        drawn = counts.sum(axis=0) if drawn is None else drawn + counts.sum(axis=0)
    if drawn is None:
        n = np.asarray(weights(np.arange(1))).shape[1]
        return PlanCursor.start(n)
    return PlanCursor(int(window), tuple(int(d) for d in drawn), tuple(float(c) for c in carry))


def draws(seed: int, source: int, size: int, first: int, count: int) -> np.ndarray:
    """Sample indices (within the source) of the source's draws ``first .. first+count-1``.

    Draw d is ``permute(d mod size, size, permutation_key(seed, source, d // size))``; a range
    that crosses an epoch end continues in the next epoch's permutation.
    """
    first, count, size = int(first), int(count), int(size)
    out = np.empty(count, dtype=np.int64)
    at = first
    while at < first + count:  # one contiguous run per source epoch the range crosses
        epoch, into = divmod(at, size)
        end = min(first + count, (epoch + 1) * size)
        out[at - first: end - first] = permute(np.arange(into, into + end - at, dtype=np.int64),
                                               size, permutation_key(seed, source, epoch))
        at = end
    return out


def drawn_mask(seed: int, source: int, size: int, drawn: int, indices: np.ndarray) -> np.ndarray:
    """Whether each sample ``indices`` of the source was drawn in the source's current epoch
    after ``drawn`` draws (closed form: its position in the epoch's permutation is below
    ``drawn mod size``). Every sample was drawn ``drawn // size`` times in earlier epochs."""
    epoch, into = divmod(int(drawn), int(size))
    pos = unpermute(np.asarray(indices, dtype=np.int64), size, permutation_key(seed, source, epoch))
    return pos < into
