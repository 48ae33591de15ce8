"""Blend draw policies: which source the next sample comes from.

``random``
    A categorical draw with the current weights, from Energon's savable ``WorkerRng`` (different
    per rank and worker, which is what a blend wants). Over a window of n draws a source's count
    has binomial noise, standard deviation ``sqrt(n w (1 - w))``.

``deterministic``
    Low-discrepancy, in the spirit of Megatron-LM's blended dataset: draw the source that is
    furthest behind its cumulative target, where the target of a source is the running SUM of
    its weight over all past draws (not the current weight times the draw count, which would
    leave a long error after every phase switch). Ties go to the first source. With
    ``D_s = target_s - emitted_s`` after each draw, ``sum_s D_s = 0`` and ``D_s`` stays within
    (-1, 1), so over any window the realised count of a source is within 2 samples of its target
    (within 1 over any prefix). No randomness: the sequence is a pure function of the weights.
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
