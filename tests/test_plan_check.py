"""Checks of a plan read from a file (``planned/plan_check.py``): a corrupt or planted plan
cannot drop or repeat a sample, and a plan of the window passes, with either ``planned_mix``
(``"window"``: samples deferred by the warmup's caps, a source switched inside a window, packed
windows packed whole or step by step)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
import sys

import numpy as np
import pytest

from energon_ordering.errors import OrderingConfigError
from energon_ordering.planned import plan_check, window_mix
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.packs import PackedWindowPlan, plan_packed_window
from energon_ordering.planned.plan_check import (
    ids_out_of_range,
    packed_plan_matches_inputs,
    plan_matches_draws,
    plan_matches_inputs,
)
from energon_ordering.planned.window import plan_window, window_draws, window_weights

sys.path.insert(0, str(Path(__file__).parent))
from test_window_mix import B, K, M, R, _caps, _lengths, _weights  # noqa: E402

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


# -- planned_mix="window": a window's samples move between its steps ----------------------------

# the window mix's own scenario (tests/test_window_mix.py): 3 sources, K = 8 steps of 4 ranks x
# 1 micro-batch of 2; source 2 switches off and source 1 on inside windows 1 and 3; a warmup's
# caps over windows 0-2 defer samples
W_LENGTHS = _lengths()
W_SIZES = tuple(len(x) for x in W_LENGTHS)


@pytest.fixture(params=["whole", "in chunks"])
def check_reads(request, monkeypatch):
    """The window-mix check as it reads a small window (whole), and as it reads a large one:
    steps in chunks of 3 ids (a sample's copies in different chunks), a source drawn over
    counted 2 samples at a time."""
    if request.param != "whole":
        monkeypatch.setattr(plan_check, "_CHUNK_IDS", 3)
        monkeypatch.setattr(plan_check, "_COUNT_BLOCK", 2)
    return request.param


def _window_plans(windows: int, mix: str = "window") -> list[tuple]:
    """``(plan, inputs of plan_matches_inputs)`` of the first ``windows`` windows."""
    cursor, out = PlanCursor.start(3), []
    for w in range(windows):
        plan = plan_window(W_LENGTHS, seed=5, cursor=cursor, weights=_weights(w),
                           window_steps=K, world_size=R, micro_batch=B,
                           micro_batches_per_step=M, mix=mix, caps=_caps(w))
        out.append((plan, dict(seed=5, sizes=W_SIZES, cursor=cursor, weights=_weights(w),
                               next_cursor=plan.next_cursor, mix=mix, caps=_caps(w),
                               lengths=W_LENGTHS)))
        cursor = plan.next_cursor
    return out


def _over_cap(plan, caps) -> bool:
    return bool((np.concatenate(W_LENGTHS)[plan.ids].reshape(K, -1) > caps[:, None]).any())


def test_window_mix_plans_pass_with_caps_deferrals_and_zeros(check_reads):
    plans = _window_plans(8)
    for plan, inputs in plans:
        assert plan_matches_inputs(plan.ids, **inputs) is None, plan.cursor.window
    # the rows this covers: samples deferred and placed later, caps, a source switched inside
    # a window (two groups of steps), and windows without caps
    assert any(p.cursor.deferred for p, _ in plans)
    assert any(p.next_cursor.deferred for p, _ in plans)
    assert any(i["caps"] is None for _, i in plans)
    assert (plans[1][1]["weights"] == 0).any(axis=0).any()
    # the step mix's check refuses them: their steps hold other counts than the step mix's
    assert any(plan_matches_inputs(p.ids, **{**i, "mix": "step", "next_cursor": None}) is not None
               for p, i in plans)


def test_step_mix_plans_pass_and_need_their_counts_per_step():
    for plan, inputs in _window_plans(4, mix="step"):
        assert plan_matches_inputs(plan.ids, **inputs) is None
        assert plan_matches_inputs(plan.ids, **{**inputs, "next_cursor": None}) is None
        # the window's multiset, a sample of source 0 and one of source 2 swapped between steps
        ids = plan.ids.copy().reshape(K, -1)
        src = np.searchsorted(np.cumsum(W_SIZES), ids, "right")
        both = [t for t in range(K) if (src[t] == 0).any() and (src[t] == 2).any()]
        t0, u = both[:2]
        i, j = int(np.flatnonzero(src[t0] == 0)[0]), int(np.flatnonzero(src[u] == 2)[0])
        ids[t0, i], ids[u, j] = ids[u, j], ids[t0, i]
        why = plan_matches_inputs(ids.reshape(plan.ids.shape), **inputs)
        assert why is not None and "samples per source" in why, why
        moved = {**inputs, "next_cursor": PlanCursor(1, (0, 0, 0), (0.0, 0.0, 0.0))}
        assert "next cursor" in plan_matches_inputs(plan.ids, **moved)


def test_window_mix_plans_placed_over_their_caps_pass_when_nothing_else_fits(monkeypatch, check_reads):
    """With no room to defer, the planner places the longest samples over a cap: as many as
    no placement avoids, which the check accepts; one more over a cap is refused."""
    monkeypatch.setattr(window_mix, "MAX_DEFERRED", 3)
    plans = _window_plans(3)
    forced = [(p, i) for p, i in plans if _over_cap(p, i["caps"])]
    assert forced
    for plan, inputs in plans:
        assert plan_matches_inputs(plan.ids, **inputs) is None
    plan, inputs = forced[0]
    ids = _planted(plan, inputs, "above its cap")
    why = plan_matches_inputs(ids, **inputs)
    assert why is not None and "above the step's cap" in why, why


def _sources(ids: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.cumsum(W_SIZES), ids, "right")


def _planted(plan, inputs: dict, kind: str) -> np.ndarray:
    """``plan.ids`` ``[K, R, M, B]`` changed as ``kind`` says (the window's own samples)."""
    ids = plan.ids.copy().reshape(K, -1)
    src = _sources(ids)
    w = inputs["weights"]
    L = np.concatenate(W_LENGTHS)
    if kind == "another id":  # a sample of the same source the window does not hold
        s = int(src[0, 0])
        lo = int(np.cumsum((0,) + W_SIZES)[s])
        ids[0, 0] = next(x for x in range(lo, lo + W_SIZES[s]) if x not in set(plan.ids.flat)
                         and x not in plan.next_cursor.deferred and L[x] <= L[ids[0, 0]])
    elif kind == "duplicate":  # a sample twice, one of its source's dropped
        t, i = np.argwhere(src == src[0, 0])[1]
        ids[t, i] = ids[0, 0]
    elif kind == "at a zero weight":  # a sample where its source's weight is 0, swapped
        t, s = (int(x) for x in np.argwhere(w == 0)[0])
        u, i = np.argwhere((src == s) & (w[:, s] > 0)[:, None])[0]
        j = int(np.flatnonzero(w[u, src[t]] > 0)[0])  # a sample of step t its source allows at u
        ids[t, j], ids[u, i] = ids[u, i], ids[t, j]
    elif kind == "above its cap":  # the longest sample swapped into the lowest-capped step
        caps = inputs["caps"]
        t = int(np.argmin(caps))
        cand = np.argwhere((L[ids] > caps[t]) & (L[ids] <= caps[:, None])
                           & (w[t, src] > 0))
        u, i = cand[0]
        j = int(np.flatnonzero(w[u, src[t]] > 0)[0])
        ids[t, j], ids[u, i] = ids[u, i], ids[t, j]
    elif kind == "group counts":  # a sample of source 0 and one of source 2 swapped between the
        a = np.flatnonzero(w[:, 1] == 0)  # steps without source 1 and those with it
        b = np.flatnonzero(w[:, 1] > 0)
        i = np.argwhere(src[a] == 0)[0]
        j = np.argwhere(src[b] == 2)[0]
        ids[a[i[0]], i[1]], ids[b[j[0]], j[1]] = ids[b[j[0]], j[1]], ids[a[i[0]], i[1]]
    return ids.reshape(plan.ids.shape)


@pytest.mark.parametrize("kind,reason", [
    ("another id", "time(s) in it"), ("duplicate", "time(s) in it"),
    ("at a zero weight", "whose weight there is 0"), ("above its cap", "above the step's cap"),
    ("group counts", "samples per source, the window's share"),
])
def test_a_planted_window_mix_plan_is_named_with_why(kind, reason, check_reads):
    plans = _window_plans(3)
    plan, inputs = plans[1]  # caps, deferrals and a source switched on inside the window
    assert plan.cursor.deferred and (inputs["weights"] == 0).any()
    ids = _planted(plan, inputs, kind)
    assert not np.array_equal(ids, plan.ids)
    why = plan_matches_inputs(ids, **inputs)
    assert why is not None and reason in why, why


@pytest.mark.parametrize("kind,reason", [
    ("count edited", "draws the sources up to"), ("carry", "carry"),
    ("deferred swapped", "time(s) in it"), ("deferral dropped", "draws the sources up to"),
    ("deferred out of range", "lies outside"), ("window", "next cursor"),
])
def test_a_planted_next_cursor_of_a_window_mix_plan_is_named_with_why(kind, reason, check_reads):
    plan, inputs = next((p, i) for p, i in _window_plans(3) if p.next_cursor.deferred)
    nxt = plan.next_cursor
    d = list(nxt.deferred)
    if kind == "count edited":
        nxt = dataclasses.replace(nxt, drawn=(nxt.drawn[0] + 1,) + nxt.drawn[1:])
    elif kind == "carry":
        nxt = dataclasses.replace(nxt, carry=(nxt.carry[0] + 0.25,) + nxt.carry[1:])
    elif kind == "deferred swapped":  # another sample of the same source claimed deferred
        held = set(plan.ids.flat) | set(d) | set(plan.cursor.deferred)
        s = int(_sources(np.array(d[:1]))[0])
        lo = int(np.cumsum((0,) + W_SIZES)[s])
        d[0] = next(x for x in range(lo, lo + W_SIZES[s]) if x not in held)
        nxt = dataclasses.replace(nxt, deferred=tuple(d))
    elif kind == "deferral dropped":
        nxt = dataclasses.replace(nxt, deferred=tuple(d[1:]))
    elif kind == "deferred out of range":
        nxt = dataclasses.replace(nxt, deferred=tuple(d[:-1]) + (sum(W_SIZES),))
    elif kind == "window":
        nxt = dataclasses.replace(nxt, window=nxt.window + 1)
    why = plan_matches_inputs(plan.ids, **{**inputs, "next_cursor": nxt})
    assert why is not None and reason in why, why


def test_plan_matches_inputs_refuses_calls_it_cannot_check():
    plan, inputs = _window_plans(1)[0]
    with pytest.raises(OrderingConfigError, match=r"next_cursor = None with mix = 'window'; pass"):
        plan_matches_inputs(plan.ids, **{**inputs, "next_cursor": None})
    with pytest.raises(OrderingConfigError, match=r"lengths = None with caps given; pass lengths"):
        plan_matches_inputs(plan.ids, **{**inputs, "lengths": None})
    with pytest.raises(OrderingConfigError, match=r"planned_mix = 'steps'"):
        plan_matches_inputs(plan.ids, **{**inputs, "mix": "steps"})
    with pytest.raises(OrderingConfigError, match=r"ids of shape \(8, 8\)"):
        plan_matches_inputs(plan.ids.reshape(K, -1), **inputs)
    with pytest.raises(OrderingConfigError, match=r"caps = "):
        plan_matches_inputs(plan.ids, **{**inputs, "caps": [100] * (K - 1)})
    assert plan_matches_inputs(plan.ids + sum(W_SIZES), **inputs) == (
        f"sample id {int(plan.ids.max()) + sum(W_SIZES)} lies outside [0, {sum(W_SIZES)})")


def _packed_windows(windows: int, caps=lambda w: [8192] * K, limits=None) -> list[tuple]:
    """``(plan, inputs of packed_plan_matches_inputs)`` of mix='window' packed windows."""
    cursor, out = PlanCursor.start(3), []
    for w in range(windows):
        inputs = dict(seed=3, cursor=cursor, weights=_weights(w), caps=caps(w),
                      epoch_limits=limits, mix="window")
        plan = plan_packed_window(W_LENGTHS, world_size=R, micro_batch=B,
                                  micro_batches_per_step=M, **inputs)
        out.append((plan, dict(inputs, sizes=W_SIZES, shape=(R, M, B))))
        if plan.epoch_end:
            break
        cursor = plan.next_cursor
    return out


def _step_rule(inputs: dict) -> dict:
    return {**inputs, "mix": "step"}


def test_packed_window_mix_plans_pass_whole_or_step_by_step():
    plans = _packed_windows(4)
    for plan, inputs in plans:
        assert packed_plan_matches_inputs(plan.to_array(), **inputs) is None, plan.cursor.window
    # windows 0 and 2 are packed whole (the step mix's check refuses them), 1 and 3 switch a
    # source inside them and are packed step by step (both checks pass them)
    whole = [packed_plan_matches_inputs(p.to_array(), **_step_rule(i)) is not None
             for p, i in plans]
    assert whole == [True, False, True, False]
    # a warmup's ramp (caps differ) is packed step by step too
    ramp = _packed_windows(1, caps=lambda w: [1024 * (t + 1) for t in range(K)])
    assert packed_plan_matches_inputs(ramp[0][0].to_array(), **ramp[0][1]) is None
    assert packed_plan_matches_inputs(ramp[0][0].to_array(), **_step_rule(ramp[0][1])) is None


def test_packed_window_mix_plans_pass_through_a_finite_epochs_end():
    plans = _packed_windows(20, limits=[400, 150, 500])
    assert plans[-1][0].epoch_end
    for plan, inputs in plans:
        assert packed_plan_matches_inputs(plan.to_array(), **inputs) is None, plan.cursor.window


def _tampered_window(kind: str) -> tuple[np.ndarray, dict]:
    """Packed window 0 (packed whole) changed as ``kind`` says."""
    plan, inputs = _packed_windows(1)[0]
    a = plan.to_array().copy()
    S, steps, n = 3, plan.steps, len(plan.ids)
    ids = a[len(a) - n:]
    src = _sources(plan.ids)
    G = R * M * B
    step_of = np.repeat(np.arange(steps), plan.counts.sum(axis=1))
    if kind == "another id":
        held = set(plan.ids.tolist())
        lo = int(np.cumsum((0,) + W_SIZES)[src[0]])
        ids[0] = next(x for x in range(lo, lo + W_SIZES[src[0]]) if x not in held)
    elif kind == "duplicate":
        ids[int(np.flatnonzero(src == src[0])[1])] = ids[0]
    elif kind == "count edited":  # the window's counts: one of source 0 for one of source 2
        a[7 + 2 * S] += 1
        a[7 + 2 * S + 2] -= 1
    elif kind == "count moved":  # the same totals per step and source, other steps' counts
        a[7 + 2 * S] += 1
        a[7 + 2 * S + 2] -= 1
        a[7 + 2 * S + S] -= 1
        a[7 + 2 * S + S + 2] += 1
    elif kind == "sources swapped between steps":  # the steps' counts no longer match them
        i = int(np.flatnonzero((src == 0) & (step_of == 0))[0])
        j = int(np.flatnonzero((src == 2) & (step_of == 1))[0])
        ids[i], ids[j] = ids[j], ids[i]
    elif kind == "carry":
        a[7 + S] = np.float64(0.25).view(np.int64)
    elif kind == "epoch end":
        a[1] = 1
    elif kind == "a step's packs":  # a pack of step 0 counted in step 1
        a[7 + 2 * S + steps * S + steps + G] -= 1
    return a, inputs


@pytest.mark.parametrize("kind,reason", [
    ("another id", "time(s) in it"), ("duplicate", "time(s) in it"),
    ("count edited", "its steps count"), ("count moved", "its step 0 holds"),
    ("sources swapped between steps", "its step 0 holds"), ("carry", "next cursor"),
    ("epoch end", "epoch end"), ("a step's packs", "offsets"),
])
def test_a_planted_packed_window_mix_plan_is_named_with_why(kind, reason):
    a, inputs = _tampered_window(kind)
    why = packed_plan_matches_inputs(a, **inputs)
    assert why is not None and reason in why, why


@pytest.mark.parametrize("seed", range(8))
def test_random_window_mix_plans_pass(seed, monkeypatch):
    """Random schedules with zeros, caps in any order, shapes and deferral room: every window
    mix plan, padded and packed, passes."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(window_mix, "MAX_DEFERRED", int(rng.choice([0, 2, 1024])))
    S = int(rng.integers(1, 4))
    lengths = [rng.integers(8, int(rng.integers(100, 9000)), int(rng.integers(20, 400)))
               for _ in range(S)]
    sizes = [len(x) for x in lengths]
    R_, M_, B_, K_ = (int(x) for x in rng.integers(1, [4, 3, 4, 6]))
    cursor = packed_cursor = PlanCursor.start(S)
    for _ in range(4):
        w = rng.random((K_, S)) * (rng.random((K_, S)) > 0.3)
        w[:, 0] += w.sum(axis=1) == 0
        w /= w.sum(axis=1, keepdims=True)
        caps = None if rng.random() < 0.3 else rng.integers(50, 9000, K_)
        plan = plan_window(lengths, seed=seed, cursor=cursor, weights=w, window_steps=K_,
                           world_size=R_, micro_batch=B_, micro_batches_per_step=M_,
                           mix="window", caps=caps)
        assert plan_matches_inputs(plan.ids, seed=seed, sizes=sizes, cursor=cursor, weights=w,
                                   next_cursor=plan.next_cursor, mix="window", caps=caps,
                                   lengths=lengths) is None
        cursor = plan.next_cursor
        pack_caps = [int(rng.choice([2048, 8192]))] * K_
        packed = plan_packed_window(lengths, seed=seed, cursor=packed_cursor, weights=w,
                                    caps=pack_caps, world_size=R_, micro_batch=B_,
                                    micro_batches_per_step=M_, mix="window")
        assert packed_plan_matches_inputs(packed.to_array(), seed=seed, sizes=sizes,
                                          cursor=packed_cursor, weights=w, caps=pack_caps,
                                          shape=(R_, M_, B_), mix="window") is None
        packed_cursor = packed.next_cursor


def test_a_window_drawing_a_source_several_times_over_is_checked_copy_by_copy(check_reads):
    """A source of 5 samples drawn 3-4 times over in one window (its draws cross epochs, so a
    sample is in the window several times): the plan passes; one copy of a sample swapped for
    another copy of a different sample is named with both counts."""
    lengths = [np.arange(1, 6) * 100, np.arange(1, 201) * 7]
    sizes = [len(x) for x in lengths]
    K_, R_, M_, B_ = 4, 2, 1, 4
    w = window_weights([0.5, 0.5], 0, K_)
    cursor = PlanCursor(0, (3, 0), (0.0, 0.0))  # source 0 starts inside its first epoch
    plan = plan_window(lengths, seed=2, cursor=cursor, weights=w, window_steps=K_,
                       world_size=R_, micro_batch=B_, micro_batches_per_step=M_, mix="window")
    inputs = dict(seed=2, sizes=sizes, cursor=cursor, weights=w, next_cursor=plan.next_cursor,
                  mix="window")
    flat = plan.ids.reshape(-1)
    assert np.bincount(flat[flat < 5], minlength=5).max() >= 3  # copies from several epochs
    assert plan_matches_inputs(plan.ids, **inputs) is None
    ids = flat.copy()
    a = int(np.flatnonzero(ids < 5)[0])
    c = [i for i in np.flatnonzero(ids < 5) if ids[i] != ids[a]][-1]  # far apart: other chunks
    ids[c] = ids[a]  # one more copy of ids[a], one fewer of the other
    why = plan_matches_inputs(ids.reshape(plan.ids.shape), **inputs)
    assert why is not None and "time(s) in it" in why, why
    x = int(why.split()[2])
    assert f"appears {int(np.count_nonzero(ids == x))} time(s) in it" in why


def test_deferred_samples_of_a_source_drawn_over_and_over_are_counted_with_its_draws(
        check_reads):
    """A source of 5 samples drawn 16 times a window: the warmup's caps of window 0 defer its
    longest sample (4 copies), window 1 (no caps) places them beside 12 new draws of the
    source; both pass, and a plan that drops one deferred copy for another sample is refused."""
    lengths = [np.array([100, 200, 300, 400, 500]), np.full(200, 50)]
    sizes = [len(x) for x in lengths]
    K_, R_, M_, B_ = 4, 2, 1, 4
    w = window_weights([0.5, 0.5], 0, K_)
    cursor, plans = PlanCursor.start(2), []
    for caps in (np.full(K_, 450), None):  # sample 4 (500 tokens) waits, 4 times
        plan = plan_window(lengths, seed=4, cursor=cursor, weights=w, window_steps=K_,
                           world_size=R_, micro_batch=B_, micro_batches_per_step=M_,
                           mix="window", caps=caps)
        plans.append((plan, dict(seed=4, sizes=sizes, cursor=cursor, weights=w,
                                 next_cursor=plan.next_cursor, mix="window", caps=caps,
                                 lengths=lengths)))
        cursor = plan.next_cursor
    assert plans[1][0].cursor.deferred == (4, 4, 4, 4)  # placed by window 1 ...
    assert plans[1][0].next_cursor.drawn[0] - plans[1][0].cursor.drawn[0] >= 5  # ... drawn over
    for plan, inputs in plans:
        assert plan_matches_inputs(plan.ids, **inputs) is None
    plan, inputs = plans[1]
    ids = plan.ids.reshape(-1).copy()
    g = plan.cursor.deferred[0]
    at = int(np.flatnonzero(ids == g)[0])
    ids[at] = next(x for x in range(5) if x != g)
    why = plan_matches_inputs(ids.reshape(plan.ids.shape), **inputs)
    assert why is not None and "time(s) in it" in why, why
