"""Checks of a plan read from a file (``planned/plan_check.py``): a corrupt or planted plan
cannot drop or repeat a sample, and a plan of the window passes."""

from __future__ import annotations

import numpy as np
import pytest

from energon_ordering.errors import OrderingConfigError
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.packs import PackedWindowPlan, plan_packed_window
from energon_ordering.planned.plan_check import (
    ids_out_of_range,
    packed_plan_matches_inputs,
    plan_matches_draws,
)
from energon_ordering.planned.window import plan_window, window_draws, window_weights

SIZES = (500, 300)
RNG = np.random.default_rng(0)
LENGTHS = [RNG.integers(10, 3000, n).astype(float) for n in SIZES]
TOTAL = sum(SIZES)


def test_ids_in_range_and_the_multiset_of_the_draws():
    draws = np.array([5, 1, 1, 7])
    assert plan_matches_draws(np.array([[1, 7], [5, 1]]), draws, 10) is None
    assert ids_out_of_range(np.array([3, 10]), 10) == "sample id 10 lies outside [0, 10)"
    assert ids_out_of_range(np.array([-1, 3]), 10) == "sample id -1 lies outside [0, 10)"
    assert plan_matches_draws(np.array([1, 7, 5, 10]), draws, 10) == (
        "sample id 10 lies outside [0, 10)")
    assert plan_matches_draws(np.array([1, 7, 5, 5]), draws, 10) == (
        "sample id 1 appears 1 time(s) in it, 2 in the window's draws")
    assert plan_matches_draws(np.array([1, 7, 5, 1, 2]), draws, 10) == (
        "it holds 5 sample ids, the window draws 4")
    assert plan_matches_draws(np.array([1, 7, 5, 2]), draws, None) == (
        "sample id 1 appears 1 time(s) in it, 2 in the window's draws")


def test_window_draws_are_the_plans_samples_across_source_epochs():
    """The helper the loader checks a mapped plan with describes plan_window's draws exactly,
    window after window (the small source wraps into its next epochs)."""
    cursor = PlanCursor.start(2)
    weights = window_weights([0.3, 0.7], 0, 4)
    for _ in range(8):
        plan = plan_window(LENGTHS, seed=5, cursor=cursor, weights=weights, window_steps=4,
                           world_size=4, micro_batch=4, micro_batches_per_step=2)
        draws = window_draws(SIZES, 5, cursor, plan.counts)
        assert plan_matches_draws(plan.ids, draws, TOTAL) is None
        # the draws of another seed or cursor are other samples
        assert plan_matches_draws(plan.ids, window_draws(SIZES, 6, cursor, plan.counts),
                                  TOTAL) is not None
        cursor = plan.next_cursor
    assert cursor.epochs(SIZES)[1] >= 2


def _packed(cursor: PlanCursor, limits=None) -> tuple[PackedWindowPlan, dict]:
    inputs = dict(seed=1, cursor=cursor, weights=window_weights([0.6, 0.4], 0, 4),
                  caps=[2048] * 4, epoch_limits=limits)
    plan = plan_packed_window(LENGTHS, world_size=2, micro_batch=2, micro_batches_per_step=2,
                              **inputs)
    return plan, dict(inputs, sizes=SIZES, shape=(2, 2, 2))


def test_packed_plans_of_the_window_pass_through_a_finite_epochs_end():
    cursor, ended = PlanCursor.start(2), False
    for _ in range(6):
        plan, inputs = _packed(cursor, limits=[60, 40])
        assert packed_plan_matches_inputs(plan.to_array(), **inputs) is None
        if plan.epoch_end:
            ended = True
            break
        cursor = plan.next_cursor
    assert ended and plan.steps < 4


def _tampered(kind: str) -> tuple[np.ndarray, dict]:
    """A packed plan of window 1 changed as ``kind`` says, and the window's inputs."""
    first, _ = _packed(PlanCursor.start(2))
    plan, inputs = _packed(first.next_cursor)
    a = plan.to_array().copy()
    n, S, steps = len(plan.ids), len(SIZES), plan.steps
    ids = a[len(a) - n:]  # a view: edits change ``a``
    R, M, B = plan.shape
    step1 = int(plan.offsets[R * M * B])  # where step 1's ids start
    if kind == "repeated":
        ids[0] = ids[1]
    elif kind == "out of range":
        ids[-1] = TOTAL + 3
    elif kind == "another window's sample":
        ids[0] = first.ids[0]
    elif kind == "moved to another step":  # the window's multiset, but a step's draws moved
        ids[0], ids[step1] = ids[step1], ids[0]
    elif kind == "counts":
        a[7 + 2 * S] += 1
        a[7 + 2 * S + 1] -= 1
    elif kind == "carry":
        a[7 + S] = np.float64(0.25).view(np.int64)
    elif kind == "epoch end":
        a[1] = 1
    elif kind == "caps":
        a[7 + 2 * S + steps * S] = 4096
    elif kind == "shape":
        a[3], a[4] = 4, 1
    elif kind == "truncated":
        a = a[:-1]
    elif kind == "offsets":  # a sample of step 0's last pack counted in step 1
        a[7 + 2 * S + steps * S + steps + R * M * B] -= 1
    return a, inputs


@pytest.mark.parametrize("kind,reason", [
    ("repeated", "its step 0: sample id"), ("out of range", "lies outside"),
    ("another window's sample", "appears 0 time"), ("moved to another step", "its step 0"),
    ("counts", "its step 0 counts"), ("carry", "next cursor"), ("epoch end", "epoch end"),
    ("caps", "caps"), ("shape", "header names"), ("truncated", "its header"),
    ("offsets", "offsets"),
])
def test_a_tampered_packed_plan_is_named_with_why(kind, reason):
    a, inputs = _tampered(kind)
    why = packed_plan_matches_inputs(a, **inputs)
    assert why is not None and reason in why, why


def test_a_packed_plan_of_other_inputs_fails():
    plan, inputs = _packed(PlanCursor.start(2))
    a = plan.to_array()
    assert packed_plan_matches_inputs(a, **{**inputs, "seed": 2}) is not None
    assert packed_plan_matches_inputs(a, **{**inputs, "epoch_limits": [10, 10]}) is not None
    other = PlanCursor(0, (7, 0), (0.0, 0.0))
    assert packed_plan_matches_inputs(a, **{**inputs, "cursor": other}) is not None


def test_window_draws_refuse_counts_of_other_sources():
    with pytest.raises(OrderingConfigError, match=r"counts of shape \(2, 3\) and a cursor of 2"):
        window_draws(SIZES, 1, PlanCursor.start(2), np.ones((2, 3), dtype=np.int64))
