"""The window mix planned in one buffer (:mod:`energon_ordering.planned.window_mix_buffer`) is
the reference plan (:func:`mix_window` then :func:`deal_bands`), id for id, in less memory."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from energon_ordering.planned import sort_order, window_mix_buffer
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.window import plan_window, window_weights
from energon_ordering.planned.window_mix import MAX_DEFERRED, deal_bands, mix_window
from energon_ordering.planned.window_mix_buffer import plan_mix_in_buffer


def _reference(lengths, *, world_size, micro_batch, micro_batches_per_step, **kw):
    gid, L, counts, nxt = mix_window(lengths, draws_per_step=world_size * micro_batch
                                     * micro_batches_per_step, **kw)
    pos = deal_bands(L, world_size=world_size, micro_batch=micro_batch,
                     micro_batches_per_step=micro_batches_per_step)
    ids = np.stack([gid[t][pos[t]] for t in range(len(pos))])
    return ids, counts, nxt


def _window(rng: np.random.Generator, case: int):
    """A random window's inputs: 1-3 sources (some smaller than a window: drawn twice), lengths
    with many ties, caps that bind or not, schedule groups, deferral on or off."""
    S = int(rng.integers(1, 4))
    lengths = []
    for _ in range(S):
        n = int(rng.choice([7, 50, 400, 3000]))
        top = int(rng.choice([8, 300, 5000, 40000, 100_000]))  # (beyond 2^16: no counting)
        lengths.append(rng.integers(1, top, n).astype(rng.choice([np.int64, np.int32,
                                                                  np.float32])))
    R, M, B = int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 5))
    K = int(rng.integers(1, 24))
    w = rng.random((K, S)) + 0.05
    if S > 1 and rng.random() < 0.5:  # a source off for part of the window: two groups
        w[: int(rng.integers(1, K + 1)), int(rng.integers(S))] = 0
    w /= w.sum(axis=1, keepdims=True)
    caps = None
    if rng.random() < 0.6:
        top = max(int(x.max()) for x in lengths)
        caps = rng.integers(max(1, top // 20), top + 2, K).astype(np.int64)
        if rng.random() < 0.5:
            caps.sort()
    defer = bool(rng.random() < 0.7)
    return lengths, dict(seed=case, weights=w, caps=caps, defer=defer,
                         world_size=R, micro_batch=B, micro_batches_per_step=M)


@pytest.mark.parametrize("chunk", [1 << 17, 5])
def test_the_buffer_plans_the_reference_plan_window_after_window(chunk, monkeypatch) -> None:
    """Random windows, three in a row (a window's deferred samples carried into the next), with
    the default chunk and with chunks of 5 samples (every chunked loop runs many times): the
    ids in every place, the counts and the next cursor are the reference's."""
    monkeypatch.setattr(window_mix_buffer, "CHUNK_SAMPLES", chunk)
    monkeypatch.setattr(sort_order, "_SCATTER_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    deferred_seen = forced_seen = 0
    for case in range(60):
        lengths, kw = _window(rng, case)
        cursor = PlanCursor.start(len(lengths))
        for _ in range(3):
            want = _reference(lengths, cursor=cursor, **kw)
            got = plan_mix_in_buffer(lengths, cursor=cursor, **kw)
            assert got is not None, case
            np.testing.assert_array_equal(got[0], want[0].reshape(got[0].shape), err_msg=case)
            np.testing.assert_array_equal(got[1], want[1], err_msg=str(case))
            assert got[2] == want[2], case
            deferred_seen += bool(got[2].deferred)
            forced_seen += kw["caps"] is not None and not kw["defer"]
            cursor = got[2]
    assert deferred_seen and forced_seen  # the cases reached deferral and forced placement


def test_the_buffer_plans_the_reference_where_the_deferral_fills_up() -> None:
    """Tight caps over a long window: more samples overflow than MAX_DEFERRED may wait, so the
    deferral stops at its limit and the rest are forced into free slots."""
    rng = np.random.default_rng(5)
    lengths = [rng.integers(1, 20000, 60000), rng.integers(1, 12000, 20000)]
    K, R, M, B = 16, 8, 2, 4
    w = window_weights([0.3, 0.7], 0, K)  # both overflow, drawn at other rates: ages interleave
    caps = np.linspace(200, 4000, K).astype(np.int64)
    cursor = PlanCursor.start(2)
    for _ in range(2):
        kw = dict(seed=3, cursor=cursor, weights=w, caps=caps, world_size=R, micro_batch=B,
                  micro_batches_per_step=M)
        want = _reference(lengths, **kw)
        got = plan_mix_in_buffer(lengths, **kw)
        np.testing.assert_array_equal(got[0], want[0].reshape(got[0].shape))
        np.testing.assert_array_equal(got[1], want[1])
        assert got[2] == want[2] and len(got[2].deferred) == MAX_DEFERRED
        cursor = got[2]


@pytest.mark.parametrize("chunk", [1 << 17, 7])
@pytest.mark.parametrize("share", [0.02, 0.9])  # a few long-context samples, or most of them
def test_lengths_past_the_counted_ones_are_sorted_after_them_as_the_reference_sorts(
        chunk, share, monkeypatch) -> None:
    """Lengths from 2^16 - 1 tokens up (long contexts) are counted at the top code, land last
    in draw order and are sorted there by their own lengths: the reference's plan, with the
    boundary lengths 65,535 and 65,536 tied across sources and the tail cut into chunks."""
    monkeypatch.setattr(window_mix_buffer, "CHUNK_SAMPLES", chunk)
    rng = np.random.default_rng(int(share * 100))
    lengths = []
    for n in (900, 700):
        x = rng.integers(1, 65_000, n)
        long = rng.random(n) < share
        x[long] = rng.choice([65_535, 65_536, 70_000, 200_000, 1 << 20], int(long.sum()))
        lengths.append(x)
    kw = dict(seed=5, weights=np.full((6, 2), 0.5), caps=None, defer=True, world_size=4,
              micro_batch=3, micro_batches_per_step=2)
    cursor = PlanCursor.start(2)
    for _ in range(3):
        want = _reference(lengths, cursor=cursor, **kw)
        got = plan_mix_in_buffer(lengths, cursor=cursor, **kw)
        np.testing.assert_array_equal(got[0], want[0].reshape(got[0].shape))
        np.testing.assert_array_equal(got[1], want[1])
        assert got[2] == want[2]
        cursor = got[2]


def test_lengths_that_are_not_whole_tokens_are_left_to_the_reference() -> None:
    """Fractional or negative lengths do not fit a key: the buffer declines, and plan_window
    plans them with the reference (the same as before)."""
    kw = dict(seed=1, cursor=PlanCursor.start(1), weights=window_weights([1.0], 0, 4),
              caps=None, world_size=2, micro_batch=2, micro_batches_per_step=1)
    assert plan_mix_in_buffer([np.array([1.5, 2.0, 3.0] * 10)], **kw) is None
    assert plan_mix_in_buffer([np.array([-1, 2, 3] * 10)], **kw) is None
    lengths = [np.array([1.5, 2.0, 3.25] * 10)]
    plan = plan_window(lengths, seed=1, cursor=kw["cursor"], weights=kw["weights"],
                       window_steps=4, world_size=2, micro_batch=2, micro_batches_per_step=1,
                       mix="window")
    want = _reference(lengths, **kw)
    np.testing.assert_array_equal(plan.ids, want[0])


@pytest.mark.parametrize("capped", [False, True])
def test_plan_window_writes_into_out_and_allocates_little_beside_it(capped) -> None:
    """``out`` receives the plan (the ids are a view of it), and the planning's peak beside it
    is about the plan's own size: uncapped under 2 x the plan (the ids copied out at 4 bytes a
    sample and the lengths at 2, the sorted keys counted into the plan's memory), capped under
    5 x (ids, ages and keys of the window in draw order)."""
    rng = np.random.default_rng(2)
    lengths = [rng.integers(1, 30000, 200_000), rng.integers(1, 4000, 200_000)]
    K, R, M, B = 32, 256, 2, 4
    n = K * R * M * B
    caps = np.linspace(1000, 32768, K).astype(np.int64) if capped else None
    out = np.empty(n + 3, dtype=np.int64)
    tracemalloc.start()
    try:
        plan = plan_window(lengths, seed=0, cursor=PlanCursor.start(2),
                           weights=window_weights([0.6, 0.4], 0, K), window_steps=K,
                           world_size=R, micro_batch=B, micro_batches_per_step=M, mix="window",
                           caps=caps, out=out[:n])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.shares_memory(plan.ids, out)
    chunk_temporaries = 16 * window_mix_buffer.CHUNK_SAMPLES * 8  # the dealing's, per chunk
    assert peak - chunk_temporaries <= (4 if capped else 1) * 8 * n, peak / n


def test_out_is_refused_by_the_step_mix_and_encoding_needs_the_plan_at_the_buffers_head() -> None:
    from energon_ordering.errors import OrderingConfigError
    from energon_ordering.pipeline.window_mix_share import (decode_window_mix_plan,
                                                            encode_window_mix_plan,
                                                            window_mix_plan_buffer)

    lengths = [np.arange(1, 101)]
    kw = dict(seed=1, cursor=PlanCursor.start(1), weights=window_weights([1.0], 0, 2),
              window_steps=2, world_size=2, micro_batch=2, micro_batches_per_step=1)
    with pytest.raises(OrderingConfigError, match="out given with mix = 'step'"):
        plan_window(lengths, mix="step", out=np.empty(8, dtype=np.int64), **kw)
    shape = (2, 2, 1, 2)
    buf = window_mix_plan_buffer(shape, 1)
    plan = plan_window(lengths, mix="window", out=buf[:8], **kw)
    a = encode_window_mix_plan(plan.ids, plan.next_cursor, buf)
    np.testing.assert_array_equal(a, encode_window_mix_plan(plan.ids, plan.next_cursor))
    ids, nxt = decode_window_mix_plan(a, kw["cursor"], shape)
    assert np.array_equal(ids, plan.ids) and nxt == plan.next_cursor
    with pytest.raises(ValueError, match="not built at the buffer's head"):
        encode_window_mix_plan(plan.ids.copy(), plan.next_cursor, buf)
