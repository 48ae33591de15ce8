"""The plan of one window of steps: a pure function of global information.

:func:`plan_window` takes the sources' lengths, the seed, the cursor at the window's start
(:class:`~.cursor.PlanCursor`: the window index, draws so far per source, the carry), the
window's per-step weights, and the shape of a step (data-parallel size R, micro-batches per
step M, micro-batch size B), and returns, for each of the window's K steps and each rank, the
global sample ids (:mod:`.sample_ids`) of its M micro-batches, plus the cursor of the next
window. Nothing depends on the rank, the worker or the process: every rank computes the same
plan and reads its own row.

How: per-step source counts with a carry (:func:`~energon_ordering.mixture.step_counts.
step_source_counts`: each step within one sample of ``weight x G``, cumulative counts within
one sample of the integral); the window draws the next ``sum over steps`` of each source from
the source's permutation (:func:`~.cursor.draws`); :func:`~.balance.balance_window` splits
them into steps, micro-batches and ranks with each step's exact counts.

With ``mix="window"`` (:mod:`.mix`) the window, not each step, holds the sources' shares, and
:mod:`.window_mix` bands the window's samples by length over its steps instead (each step one
band, level across ranks, padding-free micro-batches; the schedule's zeros and the warmup's caps
per step; a sample that fits no step waits in ``PlanCursor.deferred``), built in the memory of
its output by :mod:`.window_mix_buffer` where the lengths are whole tokens.

Memory: O(K G) per window (the window's draws), never O(samples of a source) beyond the
lengths the caller passes in (a later reader looks lengths up by id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from energon_ordering.errors import OrderingConfigError, show
from energon_ordering.mixture.step_counts import step_source_counts

from .balance import balance_window, sample_cost
from .cursor import PlanCursor, advance, check_window_steps, draws
from .mix import PlannedMix, check_planned_mix
from .permutation import ROUNDS
from .sample_ids import SampleIds
from .window_mix import deal_bands, mix_window
from .window_mix_buffer import plan_mix_in_buffer

__all__ = ["DEFAULT_WINDOW_STEPS", "PLAN_VERSION", "WINDOW_MIX_PLAN_VERSION", "WindowPlan",
           "check_caps", "plan_samples", "plan_window", "window_draws", "window_weights"]

#: Bumped whenever the plan of any window changes for the same inputs (permutation, counts,
#: balancing); a planned state stamps it. 2: balance_window balances each step's ranks over
#: its M micro-batches and evens out outliers (issue 32).
PLAN_VERSION = 2
assert ROUNDS == 6  # part of PLAN_VERSION 1
#: The same for ``mix="window"`` plans (:mod:`.window_mix`); a window-mix state stamps it too.
#: 2: :func:`~.window_mix.deal_bands` deals each step's sorted samples without sorting them
#: again (tied lengths go to other ranks; the same idle and padding, 3-4x less CPU). 3: a
#: group's samples of one length are banded in draw order, not by id (a counting sort: 3x
#: less CPU sorting the window; the same lengths in every place, so the same idle and padding).
WINDOW_MIX_PLAN_VERSION = 3

#: The default ``plan_window_steps``, measured by ``tools/bench_planned.py`` (8, 64, 256 and
#: 1,024 ranks, micro-batch 4, 8 micro-batches per step, a trimodal mix and a heavy-tailed two-
#: source mix): the smallest window that meets issue 23's targets (idle <= 1.5x the global sort
#: of the same samples and <= 0.5%, padding <= 2%, every step within one sample) using at most
#: 2/3 of each. K = 16 met them with little room (heavy mix: idle 0.42-0.43%, padding 1.77%);
#: K = 32 halves both (0.24%, 0.94%) for twice the window's memory (about 50-75 MiB of
#: transient arrays at 1,024 ranks) and the same planning time per step.
DEFAULT_WINDOW_STEPS = 32


@dataclass(frozen=True)
class WindowPlan:
    """The plan of one window.

    Attributes:
        ids: ``[K, R, M, B]`` global sample ids: step of the window, rank, micro-batch, sample.
        counts: ``[K, S]`` samples per step and source.
        cursor: The cursor this window started from.
        next_cursor: The cursor of the next window.
    """

    ids: np.ndarray
    counts: np.ndarray
    cursor: PlanCursor
    next_cursor: PlanCursor

    def rank_micro_batches(self, step: int, rank: int) -> np.ndarray:
        """``[M, B]`` global ids of ``rank``'s micro-batches in the window's ``step``."""
        return self.ids[step, rank]


def window_weights(weights: np.ndarray | Sequence[float], window: int, window_steps: int,
                   schedule=None) -> np.ndarray:
    """``[K, S]`` weights of window ``window``'s steps: the schedule's (``weights_table``) if
    given, else the constant normalised ``weights`` (a metadataset's blend weights)."""
    k = check_window_steps(window_steps)
    if schedule is not None:
        return schedule.weights_table(np.arange(window * k, (window + 1) * k))
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not (w >= 0).all() or not w.sum() > 0:
        raise OrderingConfigError(
            f"planned order: weights = {show(w.tolist())}; give one weight >= 0 per source, "
            "at least one > 0.")
    return np.tile(w / w.sum(), (k, 1))


def window_draws(sizes: Sequence[int], seed: int, cursor: PlanCursor,
                 counts: np.ndarray) -> np.ndarray:
    """The global ids (:mod:`.sample_ids`) of the samples a window draws, source by source in
    draw order: for each source s, its draws ``cursor.drawn[s] ..`` (:func:`~.cursor.draws`),
    as many as ``counts`` gives it over the window's steps.

    A window's plan (:func:`plan_window`, or :func:`~.packs.plan_packed_window` for its counts)
    holds exactly these samples, each as often as here, in another arrangement: what a plan read
    from a file is checked against (:mod:`.plan_check`).

    Args:
        sizes: Samples per source.
        seed: The ordering seed.
        cursor: Where the window starts.
        counts: ``[steps, S]`` samples per step and source (or ``[S]``: per source).

    Returns:
        ``[sum(counts)]`` int64 global ids.
    """
    ids = SampleIds.of(sizes)
    c = np.asarray(counts, dtype=np.int64)
    per_source = c if c.ndim == 1 else c.sum(axis=0)
    if per_source.shape != (len(ids.sizes),) or len(cursor.drawn) != len(ids.sizes):
        raise OrderingConfigError(
            f"planned order: counts of shape {c.shape} and a cursor of {len(cursor.drawn)} "
            f"sources do not describe a window of {len(ids.sizes)} sources.")
    parts = [draws(seed, s, n, cursor.drawn[s], int(per_source[s])) + off
             for s, (n, off) in enumerate(zip(ids.sizes, ids.offsets.tolist()))]
    return np.concatenate(parts)


def plan_window(
    lengths: Sequence[np.ndarray],
    *,
    seed: int,
    cursor: PlanCursor,
    weights: np.ndarray,
    window_steps: int,
    world_size: int,
    micro_batch: int,
    micro_batches_per_step: int,
    mix: PlannedMix = "step",
    caps: np.ndarray | Sequence[int] | None = None,
    defer: bool = True,
    out: np.ndarray | None = None,
) -> WindowPlan:
    """Plans window ``cursor.window``.

    Args:
        lengths: Per source, the length (tokens the model computes on) of every sample, in
            the source's sample order (its length index).
        seed: The ordering seed (the same on every rank).
        cursor: Where the window starts (:meth:`PlanCursor.start` for the first window, then
            the previous plan's ``next_cursor``).
        weights: ``[window_steps, S]`` normalised weights of the window's steps
            (:func:`window_weights`).
        window_steps: K, ``plan_window_steps`` (>= 1).
        world_size: R. micro_batch: B. micro_batches_per_step: M.
        mix: ``"step"``: every step holds each source within one sample of ``weight x G``
            (the plans of PLAN_VERSION); ``"window"``: the window does, and each step holds one
            band of lengths (:mod:`.window_mix`, WINDOW_MIX_PLAN_VERSION).
        caps: ``"window"`` only: ``[window_steps]`` most tokens a sample of each step may have
            (the sequence-length warmup's caps), or None (no cap). A sample fitting no step is
            deferred to a later window (``next_cursor.deferred``). ``"step"`` ignores it (the
            warmup cuts a step's samples to its cap).
        defer: ``"window"`` only: False defers no sample (a finite epoch's windows,
            :mod:`.epoch_end`); one that fits no step's cap takes a free slot and the warmup
            cuts it, as in the step mix.
        out: ``"window"`` only: a C-contiguous int64 array of ``K R M B`` elements the plan's
            ids are built in (``ids`` is a view of it; e.g. the head of the array a node
            shares), or None.

    Returns:
        The :class:`WindowPlan`. ``counts`` are the realised samples per step and source
        (with ``"window"`` only the window's sum follows the weights).

    Raises:
        OrderingConfigError: ``plan_window_steps`` < 1, weights of the wrong shape, a source
            without samples, a step shape < 1, a ``mix`` other than ``"step"``/``"window"``
            (named ``planned_mix``), or caps that are not ``window_steps`` ints >= 1.
    """
    mix = check_planned_mix(mix)
    k = check_window_steps(window_steps)
    for name, v in (("world_size", world_size), ("micro_batch", micro_batch),
                    ("micro_batches_per_step", micro_batches_per_step)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 1:
            raise OrderingConfigError(f"planned order: {name} = {show(v)}; give an int >= 1.")
    ids = SampleIds.of([len(x) for x in lengths])
    S = len(ids.sizes)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (k, S):
        raise OrderingConfigError(
            f"planned order: weights have shape {w.shape}, expected (plan_window_steps={k}, "
            f"sources={S}); the schedule must name exactly the plan's sources.")
    if len(cursor.drawn) != S:
        raise OrderingConfigError(
            f"planned order: the cursor has {len(cursor.drawn)} sources, the plan {S}.")
    R, B, M = int(world_size), int(micro_batch), int(micro_batches_per_step)
    if out is not None and mix != "window":
        raise OrderingConfigError(
            f"planned order: out given with mix = {show(mix)}; only the window mix builds its "
            "plan in a given array: drop out.")
    if mix == "window":
        caps = check_caps(caps, k)
        lean = plan_mix_in_buffer(lengths, seed=seed, cursor=cursor, weights=w, caps=caps,
                                  world_size=R, micro_batch=B, micro_batches_per_step=M,
                                  defer=defer, out=out)
        if lean is not None:  # whole lengths (token counts): the same plan in its own memory
            return WindowPlan(lean[0], lean[1], cursor, lean[2])
        gid, step_lengths, counts, nxt = mix_window(
            lengths, seed=seed, cursor=cursor, weights=w, caps=caps,
            draws_per_step=R * M * B, defer=defer)
        pos = deal_bands(step_lengths, world_size=R, micro_batch=B, micro_batches_per_step=M)
        del step_lengths
        flat = (np.empty(pos.shape, dtype=np.int64) if out is None
                else out.reshape(pos.shape))
        for t in range(len(pos)):  # step by step (2.5x faster than take_along_axis)
            np.take(gid[t], pos[t], out=flat[t], mode="clip")  # positions in range
        return WindowPlan(flat, counts, cursor, nxt)
    counts, carry = step_source_counts(w, R * M * B, cursor.carry)
    per_source = counts.sum(axis=0)
    # the window's draws: global id, source and cost of each (arrays of K G; temporaries are
    # dropped as soon as they are used, since the peak is what a loader worker pays)
    gid = window_draws(ids.sizes, seed, cursor, counts)
    bounds = np.concatenate(([0], np.cumsum(per_source))).tolist()
    drawn = np.concatenate([np.asarray(lengths[s])[gid[bounds[s]:bounds[s + 1]] - off]
                            for s, off in enumerate(ids.offsets.tolist())])
    cost = sample_cost(drawn)
    src = np.repeat(np.arange(S, dtype=np.int16 if S < 2**15 else np.int64), per_source)
    pos = balance_window(cost, src, counts, world_size=R, micro_batch=B,
                         micro_batches_per_step=M, lengths=drawn)  # [K, M, R, B]
    del cost, src, drawn
    flat = np.take(gid, pos.transpose(0, 2, 1, 3))  # [K, R, M, B], C-contiguous
    return WindowPlan(flat, counts, cursor, advance(cursor, counts, carry))


def check_caps(caps: np.ndarray | Sequence[int] | None, window_steps: int) -> np.ndarray | None:
    """``caps`` as ``[window_steps]`` int64 (tokens per step), or None; a typed error naming
    the step and its value otherwise."""
    if caps is None:
        return None
    c = np.asarray(caps)
    if c.shape != (window_steps,) or c.dtype.kind not in "iu" or (c.size and c.min() < 1):
        raise OrderingConfigError(
            f"planned order: caps = {show(c.tolist())}; give one int >= 1 per step of the window "
            f"({window_steps}): the sequence-length warmup's most tokens per sample, or None.")
    return c.astype(np.int64)


def plan_samples(sizes: Sequence[int], seed: int, cursor: PlanCursor,
                 next_cursor: PlanCursor) -> np.ndarray:
    """The global ids a window's plan holds, as a multiset, from its two cursors: the samples the
    cursor deferred, plus the draws between the cursors, less the samples the next cursor
    defers. Without deferred samples (always with ``mix="step"``) it is :func:`window_draws` of
    the window's counts; with ``mix="window"`` a plan read from a file is checked against it.
    """
    ids = SampleIds.of(sizes)
    fresh = [draws(seed, s, n, cursor.drawn[s], next_cursor.drawn[s] - cursor.drawn[s]) + off
             for s, (n, off) in enumerate(zip(ids.sizes, ids.offsets.tolist()))]
    held = np.asarray(cursor.deferred, dtype=np.int64)
    every = np.sort(np.concatenate([held, *fresh]))
    later = np.sort(np.asarray(next_cursor.deferred, dtype=np.int64))
    if not later.size:
        return every
    # remove one occurrence per deferred id: the k-th copy of x in ``later`` removes the k-th
    # copy of x in ``every``
    first = np.searchsorted(every, later, "left")
    copy = np.arange(len(later)) - np.searchsorted(later, later, "left")
    keep = np.ones(len(every), dtype=bool)
    keep[first + copy] = False
    return every[keep]
