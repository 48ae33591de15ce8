"""Exact source counts per optimizer step, and where they sit among the step's draws.

A step of the blend is ``G = R * M * B`` consecutive global draws (data-parallel size R,
micro-batches per step M, micro-batch size B). Two pure functions decide its sources:

**Counts per step, with a carry** (:func:`step_source_counts`). Source s is owed
``x_s = w_s(step) * G`` draws. Its count is ``floor(x_s)`` or ``floor(x_s) + 1`` (so within one
sample of ``x_s``); the ``G - sum floor(x)`` extra draws go to the sources with a fractional
part > 0 that are furthest behind the running integral ``I_s = sum over past steps of x_s``,
ties to the lower source index. The carry ``E_s = counted_s - I_s`` is what a step hands to the
next. It sums to 0 and stays within (-1, 1) in every case we have tried (random phase schedules
and ramps, 2-8 sources, G from 16 to 32k; a Pfair-style argument, not a proof): cumulative
counts track the integral within one sample. A source with weight 0 is never counted. The
recurrence is sequential, O(S) per step but in Python: :func:`carry_at` from step 0 costs about
10 us per step (25-55 us on a busy shared core; 1,000,000 steps take 10-50 s). So a dataset
saves the carry (S floats) in its state and a resume never recomputes it; the carry is in
samples, so it also stays meaningful if G changes (a resume onto another data-parallel size).

**Layout within the step** (:class:`StepLayout`). The j-th of a source's c_s draws in the step
is placed at its ideal position, the draw at which the source's running integral passes
``counted + j + 1/2``: key ``(j + 1/2 + E_s) / x_s`` (a fraction of the step), and the step's
draws are all sources' items merged by key (ties to the lower source index). Items follow the
integral, not just the step's own counts, so the layout continues the previous step's carry
and windows that straddle a step boundary stay tight. Finding the item at position p needs no
layout of the step: the rank of item (s, j) among all items is a sum of closed-form counts
per source, so a binary search over j finds it in O(S^2 log G) (:meth:`StepLayout.sources`
then walks a micro-batch's consecutive positions in O(S) each). A loader worker computes only
its own B positions, never the other G - B.

What it guarantees, over the global draw sequence (measured in ``tests/test_step_counts.py``
and by the formula's structure):

- every step: each source within one sample of ``w_s * G`` (within 1 by construction);
- every prefix of steps: within one sample of the integral (the carry);
- every window of consecutive draws: within 1 sample for 2 sources, within 2 for 3 sources.
  With 4 or more sources a window can exceed 2 (measured up to 2.8 with 4 sources and 3.9 with
  6, on adversarial random weights): merging by ideal position is a divisor-method order,
  which does not keep quota for many sources. Whole steps stay within 1 regardless.

Trade-off against the alternatives: a sequential deficit rule over the whole global sequence
(what the per-rank policy used to run) keeps every window within 2 for any number of sources,
but the source of draw g then depends on all draws before it, so a worker would have to
replay O(G) draws per step; here every position is a closed-form lookup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "StepLayout",
    "carry_at",
    "global_draw_index",
    "layout_sources",
    "step_source_counts",
]


def global_draw_index(micro_batch: int, rank: int, position: int, *, world_size: int,
                      batch_size: int) -> int:
    """Global draw index of ``rank``'s ``position``-th sample of rank-level micro-batch
    ``micro_batch``: ``(micro_batch * world_size + rank) * batch_size + position``. Micro-batch
    b of every rank together forms global draws ``[b R B, (b + 1) R B)``, so a step (M
    micro-batches) is ``G = R M B`` consecutive global draws."""
    return (micro_batch * world_size + rank) * batch_size + position


def step_source_counts(
    weights: np.ndarray | Sequence[Sequence[float]],
    draws_per_step: int,
    carry: np.ndarray | Sequence[float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Integer source counts for consecutive steps, rounded with a carry.

    Args:
        weights: ``[n_steps, n_sources]`` normalised weights of consecutive steps (e.g.
            ``schedule.weights_table(range(first, first + n))``).
        draws_per_step: Draws per step, G (global batch in samples, ``R * M * B``).
        carry: ``counted - integral`` per source before the first step (zeros at step 0, or the
            carry returned for the previous steps). None: zeros.

    Returns:
        ``(counts, carry)``: ``counts[t, s]`` (int64, each row sums to G) and the carry after
        the last step.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"step_source_counts: weights must be [steps, sources], got {w.shape}.")
    G = int(draws_per_step)
    if G < 1:
        raise ValueError(f"step_source_counts: draws_per_step = {draws_per_step} must be >= 1.")
    n, S = w.shape
    e = [0.0] * S if carry is None else [float(v) for v in carry]
    if len(e) != S:
        raise ValueError(f"step_source_counts: carry has {len(e)} values for {S} sources.")
    x = w * G
    floor = np.floor(x)
    counts = floor.astype(np.int64)
    extra = np.rint(G - floor.sum(axis=1)).astype(np.int64)
    frac = (x - floor).tolist()
    x_rows = x.tolist()
    counts_rows = counts.tolist()
    order = range(S)
    for t in range(n):
        xt, ft, ct = x_rows[t], frac[t], counts_rows[t]
        k = int(extra[t])
        if k:
            # Extra draws go to the sources (fractional part > 0) furthest behind the integral.
            behind = sorted([(e[i] - ft[i], i) for i in order if ft[i] > 0.0])
            for _, i in behind[:k]:
                ct[i] += 1
        for i in order:
            e[i] += ct[i] - xt[i]
    return np.array(counts_rows, dtype=np.int64).reshape(n, S), np.array(e)


def carry_at(schedule, step: int, draws_per_step: int, *, chunk: int = 1 << 16) -> np.ndarray:
    """The carry before ``step``, computed from step 0 (O(step * S), in chunks of weights).

    Args:
        schedule: A :class:`~energon_ordering.mixture.schedule.MixtureSchedule`.
        step: The step (>= 0).
        draws_per_step: G.
        chunk: Steps of weights evaluated at once.
    """
    carry = np.zeros(len(schedule.sources))
    for lo in range(0, int(step), chunk):
        hi = min(int(step), lo + chunk)
        weights = schedule.weights_table(np.arange(lo, hi))
        _, carry = step_source_counts(weights, draws_per_step, carry)
    return carry


@dataclass(frozen=True)
class StepLayout:
    """Which source each of one step's G draws takes (see the module docstring).

    Attributes:
        counts: Draws per source in the step (sum G).
        expected: ``w_s * G`` per source (> 0 wherever ``counts`` > 0).
        carry: ``counted - integral`` per source before the step.
    """

    counts: tuple[int, ...]
    expected: tuple[float, ...]
    carry: tuple[float, ...]

    @classmethod
    def of_step(cls, weights: Sequence[float], draws_per_step: int,
                carry: Sequence[float]) -> StepLayout:
        """The layout of a step with these normalised ``weights``, entered with ``carry``."""
        counts, _ = step_source_counts([list(weights)], draws_per_step, carry)
        return cls(tuple(int(c) for c in counts[0]),
                   tuple(float(w) * int(draws_per_step) for w in weights),
                   tuple(float(c) for c in carry))

    @property
    def size(self) -> int:
        return sum(self.counts)

    def key(self, source: int, j: int) -> float:
        """Ideal position (fraction of the step) of the source's j-th item in the step."""
        return (j + 0.5 + self.carry[source]) / self.expected[source]

    def _count_before(self, source: int, key: float, inclusive: bool) -> int:
        """Items of ``source`` with key < ``key`` (<= if ``inclusive``), in O(1)."""
        c = self.counts[source]
        if c == 0:
            return 0
        guess = key * self.expected[source] - 0.5 - self.carry[source]
        if math.isfinite(guess):
            n = min(c, max(0, math.floor(guess) + 1))
        else:
            n = c if guess > 0 else 0

        def before(j: int) -> bool:
            k = self.key(source, j)
            return k <= key if inclusive else k < key

        while n < c and before(n):  # exact against the float keys, whatever the rounding
            n += 1
        while n > 0 and not before(n - 1):
            n -= 1
        return n

    def _rank(self, source: int, j: int) -> int:
        """Position in the step of the source's j-th item (ties go to the lower source)."""
        k = self.key(source, j)
        return j + sum(
            self._count_before(t, k, inclusive=t < source)
            for t in range(len(self.counts)) if t != source
        )

    def _item_at(self, position: int) -> tuple[int, int]:
        for s, c in enumerate(self.counts):
            lo, hi = 0, c - 1
            while lo <= hi:  # the rank is strictly increasing in j
                mid = (lo + hi) // 2
                r = self._rank(s, mid)
                if r == position:
                    return s, mid
                if r < position:
                    lo = mid + 1
                else:
                    hi = mid - 1
        raise AssertionError(f"StepLayout: no item at position {position} of {self.size}")

    def sources(self, start: int, n: int) -> list[int]:
        """Sources of the step's positions ``[start, start + n)``; O(S^2 log G + n S)."""
        if start < 0 or n < 0 or start + n > self.size:
            raise ValueError(
                f"StepLayout.sources: [{start}, {start + n}) is outside [0, {self.size})."
            )
        if n <= 0:
            return []
        s0, j0 = self._item_at(start)
        k0 = self.key(s0, j0)
        nxt = [j0 if t == s0 else self._count_before(t, k0, inclusive=t < s0)
               for t in range(len(self.counts))]
        out = []
        for _ in range(n):
            best = min(
                (t for t in range(len(self.counts)) if nxt[t] < self.counts[t]),
                key=lambda t: (self.key(t, nxt[t]), t),
            )
            out.append(best)
            nxt[best] += 1
        return out


def layout_sources(layout: StepLayout) -> np.ndarray:
    """The whole step's sources in order (O(G log G)); the reference for
    :meth:`StepLayout.sources`, and for tools that look at a whole step."""
    keys, srcs = [], []
    for s, c in enumerate(layout.counts):
        j = np.arange(c, dtype=np.float64)
        keys.append((j + 0.5 + layout.carry[s]) / layout.expected[s] if c else j)
        srcs.append(np.full(c, s, dtype=np.int64))
    keys_a, srcs_a = np.concatenate(keys), np.concatenate(srcs)
    return srcs_a[np.lexsort((srcs_a, keys_a))]
