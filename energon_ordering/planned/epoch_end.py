"""Where a finite epoch (``repeat=False``) of the planned order ends, per mix granularity.

Epoch e draws each source's epoch-e permutation from its start, and ends before the first
optimizer step at which some source would run out: every rank stops after the same step, every
sample is drawn at most once per epoch, and what is left of the sources at the end is not drawn
in that epoch. Both rules are pure functions of the sources' sizes, the weights of each step and
the global batch of each step (it changes only at a resume with ``allow_global_batch_change``,
at a plan window boundary), so every rank computes the same end.

- :func:`step_mix_end_step` (``planned_mix="step"``): the per-step counts
  (:func:`~energon_ordering.mixture.step_counts.step_source_counts`, with the carry) summed
  from the epoch's start; the end is the first step whose counts no longer fit.
- :func:`window_mix_end_step` (``planned_mix="window"``): a window holds each source's total
  over its K steps (:func:`~.window_mix.window_totals`, the carry on the window's total), not a
  count per step, so the end is found window by window: whole windows while their totals fit,
  then the longest start of the next window (k < K steps, planned as a window of k steps) whose
  totals fit (the plan's own counts, :func:`~.window_mix.window_counts`). A finite epoch's windows defer no sample (one deferred past the last window would
  be lost): a sample that fits no step's cap takes a free slot, and the warmup cuts it, as in
  the step mix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from energon_ordering.mixture.step_counts import step_source_counts

from .window_mix import window_counts

__all__ = ["step_mix_end_step", "window_mix_end_step"]

#: Steps whose weights the step mix's rule evaluates at once.
_CHUNK_STEPS = 4096

WeightsOf = Callable[[int, int], np.ndarray]
"""``(first, steps) -> [steps, S]`` normalised weights of optimizer steps ``first ..``."""


def step_mix_end_step(sizes: Sequence[int], weights_of: WeightsOf,
                      global_batch_at: Callable[[int], int],
                      changes: Sequence[int] = ()) -> int:
    """Optimizer steps of a finite epoch under the step mix (the module docstring).

    Args:
        sizes: Samples per source.
        weights_of: The weights of a run of steps.
        global_batch_at: The global batch (samples) of a step.
        changes: Steps at which the global batch may change (a resume's), ascending or not.
    """
    size = np.asarray(sizes, dtype=np.int64)
    drawn = np.zeros_like(size)
    at = sorted(int(c) for c in changes)
    carry, step = None, 0
    while True:
        # a chunk of steps with one global batch (it changes only at a restore's step)
        chunk = min([_CHUNK_STEPS] + [c - step for c in at if c > step])
        counts, carry = step_source_counts(weights_of(step, chunk), global_batch_at(step),
                                           carry)
        cum = drawn + np.cumsum(counts, axis=0)
        over = (cum > size).any(axis=1)
        if over.any():
            return step + int(np.argmax(over))
        step, drawn = step + chunk, cum[-1]


def window_mix_end_step(sizes: Sequence[int], weights_of: WeightsOf,
                        global_batch_at: Callable[[int], int], window_steps: int) -> int:
    """Optimizer steps of a finite epoch under the window mix (the module docstring): whole
    windows of ``window_steps`` while their totals fit the sources, then the longest start of
    the next window that fits (its last window has that many steps).

    Args:
        sizes: Samples per source.
        weights_of: The weights of a run of steps.
        global_batch_at: The global batch (samples) of a step; read at each window's first
            step (a change of global batch falls on a window boundary).
        window_steps: K.
    """
    size = np.asarray(sizes, dtype=np.int64)
    K = int(window_steps)
    drawn = np.zeros_like(size)
    carry: Sequence[float] = np.zeros(len(size))
    first = 0
    def totals(w: np.ndarray, G: int, carry: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
        _, split, out = window_counts(w, G, carry)  # the plan's own counts (mix_window's)
        return split.sum(axis=0), out

    while True:
        w, G = weights_of(first, K), global_batch_at(first)
        took, nxt = totals(w, G, carry)
        if (drawn + took <= size).all():
            drawn, carry, first = drawn + took, nxt, first + K
            continue
        for k in range(1, K):
            if not (drawn + totals(w[:k], G, carry)[0] <= size).all():
                return first + k - 1
        return first + K - 1
