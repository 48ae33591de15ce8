"""``planned_mix="window"`` with packing: a window's packs built from the window's draws.

The step mix packs step by step (:func:`~.packs.plan_packed_step`): each step takes as many
samples as fill its ``G = R M B`` packs, each source within one sample of its share. Here the
window of K steps takes as many samples as fill its ``K G`` packs, each source within one sample
of its weights' sum over the window (the carry on the window's total), and deals them to steps:

1. **Samples.** The window's count N, each source within one sample of its mean weight x N
   (the carry on the window's total), is searched as the step mix searches a step's
   (:mod:`.pack_search`: the token bound of the window's ``K G x cap`` tokens, packed first
   :data:`~.pack_search.START_MARGIN` below it; lowered and bisected back up only where not
   every draw fits), with no idle tolerance: the bands below balance the steps.
2. **Packs.** The window is packed as one step of ``K R`` ranks of ``M B`` packs
   (:func:`~.pack_fill.fill_packs`: every pack seeded with one of the ``K G`` longest samples, the
   rest dealt longest first to the cheapest (step, rank) with room), so every (step, rank) ends
   near the same attention cost with full packs.
3. **Steps by band.** The ``K R`` (step, rank) slots, sorted by their costliest sample, are cut
   into K bands of R: a step's ranks carry alike samples (and alike micro-batches); band p goes
   to the p-th step of the seeded band order (:func:`~.window_mix.band_order`).

A window in which the schedule switches a drawn source on or off, whose caps differ (the
sequence-length warmup's ramp), or which reaches a finite epoch's end is packed step by step
(the step mix, which holds all three per step); ``counts`` are the realised ones either way.
Its idle, padding, planning CPU and peak memory beside the step mix's, at 2 to 16,384 ranks:
``python tools/bench_planned.py --only packed`` (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .balance import sample_cost
from .pack_search import packed_count
from .source_draws import SourceDraws, cut_lengths
from .window_mix import band_order

__all__ = ["plan_window_packs"]


def plan_window_packs(streams: Sequence[SourceDraws], weights: np.ndarray, carry: np.ndarray,
                      caps: np.ndarray, *, seed: int, window: int, world_size: int,
                      packs_per_rank: int, limits: np.ndarray | None) -> tuple | None:
    """The window's packs (module docstring), or None when the window is packed step by step.

    Args:
        streams: Per source, its upcoming draws.
        weights: ``[K, S]`` normalised weights. carry: Per source, before the window.
        caps: ``[K]`` tokens per pack of each step.
        seed, window: The band order's key. world_size: R. packs_per_rank: M B.
        limits: Per source, the draws left in a finite epoch, or None.

    Returns:
        ``(counts [S], carry [S], step [n], pack [n])``: the samples each source gives (its
        next draws, in source order), the carry after the window, and each sample's step and
        pack (``rank x M B + pack``) in that order; or None.
    """
    w = np.asarray(weights, dtype=np.float64)
    K = w.shape[0]
    active = w.sum(axis=0) > 0
    if ((w == 0) & active[None, :]).any() or len(set(np.asarray(caps).tolist())) > 1:
        return None  # the schedule switches a source, or the warmup the cap: per step
    R, P = int(world_size), int(packs_per_rank)
    cap = int(np.asarray(caps)[0])
    steps = band_order(np.asarray(caps, np.int64), np.arange(K), seed, window, K)  # band p -> step
    # the window as K R ranks of M B packs: every (step, rank) ends near the same cost
    found = packed_count(streams, w.mean(axis=0), carry, cap=cap, world_size=K * R,
                         packs_per_rank=P, limits=limits, idle_tolerance=None)
    if found is None:
        return None  # a finite epoch ends inside the window: per step
    pack = found.pack
    # (step, rank) slots by their longest sample, K bands of R: a step's ranks alike
    top = np.zeros(K * R)
    np.maximum.at(top, pack // P, sample_cost(cut_lengths(streams, found.counts, cap)))
    band = np.argsort(top, kind="stable").reshape(K, R)
    slot_step = np.empty(K * R, dtype=pack.dtype)  # int32 below 2^31 packs
    slot_rank = np.empty(K * R, dtype=pack.dtype)
    slot_step[band] = steps[:, None]
    slot_rank[band] = np.arange(R)[None, :]
    v = pack // P
    return found.counts, found.carry, slot_step[v], slot_rank[v] * P + pack % P
