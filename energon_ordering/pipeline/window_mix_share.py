"""A ``planned_mix="window"`` plan as one shared array, and its check before use.

With the window mix a window's samples are not its draws in a fixed count per step: the
window holds each source's total over the window, and a sample that fits no step's cap (the
warmup) is deferred to a later window (``PlanCursor.deferred``). The next window's cursor is
therefore part of the plan, not a function of the counts alone, and a process that maps
another's plan (:class:`~.shared_plans.SharedPlans`) reads it from the file:

    ids [K R M B] | drawn [S] | carry [S] (float64 bits) | deferred count | deferred ids

:func:`window_mix_plan_problem` checks a mapped array before it is trusted (DESIGN.md,
contract 14): its layout (at most :data:`~energon_ordering.planned.window_mix.MAX_DEFERRED`
deferred samples), then what every window-mix plan of the window holds
(:func:`~energon_ordering.planned.plan_check.plan_matches_inputs`: the carry, each source's
draws, the deferred samples, the caps, the ids as the multiset the two cursors describe). Not
checked: which step and rank holds which sample (the planner's choice), as for the step mix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.plan_check import plan_matches_inputs
from energon_ordering.planned.window_mix import MAX_DEFERRED

__all__ = ["decode_window_mix_plan", "encode_window_mix_plan", "window_mix_plan_buffer",
           "window_mix_plan_problem"]


def encode_window_mix_plan(ids: np.ndarray, next_cursor: PlanCursor,
                           buffer: np.ndarray | None = None) -> np.ndarray:
    """``ids`` ``[K, R, M, B]`` and the next window's cursor as one flat int64 array.

    ``buffer``: an array from :func:`window_mix_plan_buffer` whose head ``ids`` already is
    (the plan was built in it): the cursor is written after the ids and the result is a view
    of it, with no copy of the plan."""
    carry = np.asarray(next_cursor.carry, dtype=np.float64).view(np.int64)
    deferred = np.asarray(next_cursor.deferred, dtype=np.int64)
    tail = np.concatenate([np.asarray(next_cursor.drawn, dtype=np.int64), carry,
                           np.asarray([len(deferred)], dtype=np.int64), deferred])
    if buffer is None:
        return np.concatenate([np.asarray(ids, dtype=np.int64).reshape(-1), tail])
    n = int(np.prod(np.shape(ids)))
    head = buffer.__array_interface__["data"][0] == np.asarray(ids).__array_interface__["data"][0]
    if not head or not np.asarray(ids).flags.c_contiguous or len(buffer) < n + len(tail):
        raise ValueError("encode_window_mix_plan: the plan was not built at the buffer's head")
    buffer[n:n + len(tail)] = tail
    return buffer[:n + len(tail)]


def window_mix_plan_buffer(shape: tuple[int, ...], sources: int) -> np.ndarray:
    """An int64 array to build a window's plan of ``shape`` in, with room after it for the
    next cursor (at most :data:`MAX_DEFERRED` deferred samples): the plan is encoded in place
    (:func:`encode_window_mix_plan` with ``buffer``)."""
    return np.empty(int(np.prod(shape)) + 2 * int(sources) + 1 + MAX_DEFERRED, dtype=np.int64)


def decode_window_mix_plan(a: np.ndarray, cursor: PlanCursor, shape: tuple[int, ...]
                           ) -> tuple[np.ndarray, PlanCursor]:
    """``(ids [K, R, M, B], next cursor)`` of an array :func:`encode_window_mix_plan` wrote
    (``a`` may be a read-only memory map; check it first with :func:`window_mix_plan_problem`)."""
    n = int(np.prod(shape))
    S = len(cursor.drawn)
    drawn = a[n:n + S]
    carry = np.asarray(a[n + S:n + 2 * S]).view(np.float64)
    deferred = a[n + 2 * S + 1:]
    nxt = PlanCursor(cursor.window + 1, tuple(int(d) for d in drawn),
                     tuple(float(c) for c in carry), tuple(int(d) for d in deferred))
    return np.asarray(a[:n]).reshape(shape), nxt


def window_mix_plan_problem(a: np.ndarray, *, seed: int, sizes: Sequence[int],
                            cursor: PlanCursor, weights: np.ndarray,
                            shape: tuple[int, int, int, int],
                            caps: Sequence[int] | None = None,
                            lengths: Sequence[np.ndarray] | None = None,
                            deferrable: bool = True) -> str | None:
    """Why ``a`` is not a window-mix plan of the window at ``cursor``, or None: its layout,
    then :func:`~energon_ordering.planned.plan_check.plan_matches_inputs` of its ids and next
    cursor (see the module docstring).

    Args:
        a: The mapped array (int64, 1-D).
        seed: The ordering seed. sizes: Samples per source.
        cursor: The window's cursor. weights: ``[K, S]`` the window's step weights.
        shape: ``(K, R, M, B)`` of the window's plan.
        caps: The ``[K]`` caps the window was planned under (None: none).
        lengths: Per source, every sample's length (needed with ``caps``).
        deferrable: False: the window was planned to defer nothing (a finite epoch's), so a
            plan naming deferred samples is refused.
    """
    a = np.asarray(a).reshape(-1)
    n, S = int(np.prod(shape)), len(sizes)
    head = n + 2 * S + 1
    if len(a) < head:
        return f"it holds {len(a)} values, fewer than a window-mix plan of {shape} needs"
    D = int(a[head - 1])
    most = MAX_DEFERRED if deferrable else 0
    if not 0 <= D <= most or len(a) != head + D:
        return (f"it holds {len(a)} values and names {D} deferred samples; a plan of {shape} "
                f"holds {head} values and at most {most} deferred")
    ids, nxt = decode_window_mix_plan(a, cursor, shape)
    return plan_matches_inputs(ids, seed=seed, sizes=sizes, cursor=cursor, weights=weights,
                               next_cursor=nxt, mix="window", caps=caps, lengths=lengths)
