"""Blend draw policies: which source the next sample comes from.

``random``
    A categorical draw with the current weights, from Energon's savable ``WorkerRng`` (different
    per rank and worker, which is what a blend wants). Over a window of n draws a source's count
    has binomial noise, standard deviation ``sqrt(n w (1 - w))``.

``deterministic``
    Low-discrepancy over the GLOBAL draw sequence of all data-parallel ranks: the source of
    global draw ``(b R + r) B + j`` (rank r's j-th draw of micro-batch b) is a pure function of
    that index, the schedule, R, B and the micro-batches per step, computed by
    :mod:`energon_ordering.mixture.step_counts` (exact counts per optimizer step with a carry,
    laid out in a quota-keeping order within the step). No randomness and nothing simulated: a
    worker lays out each step it serves (the same on every rank) and takes its own positions;
    together the ranks hit each step's target within one sample. :class:`~energon_ordering.mixture.scheduled_blend.ScheduledBlendDataset` maps its
    draws to global indices.

:func:`deterministic_choice` is the per-rank rule the deterministic policy used before blend
state version 2, kept as its fallback once a finite source is exhausted: draw the source that is
furthest behind its cumulative target, where the target of a source is the running SUM of its
weight over all past draws (not the current weight times the draw count, which would leave a
long error after every phase switch). Ties go to the first source. With
``D_s = target_s - emitted_s`` after each draw, ``sum_s D_s = 0`` and ``D_s`` stays within
(-1, 1), so over any window of ONE rank's draws the realised count of a source is within 2
samples of its target. Every rank running it draws the same sequence, so across R ranks the
errors add up: a step's error is R times a rank's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["BLEND_POLICIES", "deterministic_choice"]

#: The draw policies.
BLEND_POLICIES = ("random", "deterministic")


def deterministic_choice(
    targets: Sequence[float], emitted: Sequence[int], weights: np.ndarray
) -> int:
    """Index of the source furthest behind its cumulative target after this draw's weights.

    Args:
        targets: Running sum of each source's weight over all past draws.
        emitted: Samples drawn from each source so far.
        weights: This draw's normalised weights (0 for sources that may not be drawn).

    Returns:
        The chosen source index (a source with weight > 0).
    """
    best, best_deficit = -1, -np.inf
    for i, w in enumerate(weights):
        if w <= 0:
            continue
        deficit = targets[i] + float(w) - emitted[i]
        if deficit > best_deficit:
            best, best_deficit = i, deficit
    if best < 0:
        raise ValueError("deterministic_choice: all weights are 0.")
    return best
