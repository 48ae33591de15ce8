"""Where a finite epoch of the planned order ends (:mod:`energon_ordering.planned.epoch_end`):
pure functions, checked against the plans themselves.

The window mix's end is checked by planning the epoch with :func:`mix_window` (whole windows,
then the last one shorter, deferring nothing): its draws fit every source, and one more step
(the last window a step longer, or the next window's first step) would run a source out.
"""

from __future__ import annotations

import numpy as np
import pytest

from energon_ordering.mixture.step_counts import step_source_counts
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.epoch_end import step_mix_end_step, window_mix_end_step
from energon_ordering.planned.window import window_draws
from energon_ordering.planned.window_mix import mix_window


def _weights(table: np.ndarray):
    """``weights_of(first, steps)`` of a ``[steps, S]`` table (rows past it repeat the last)."""
    def of(first: int, steps: int) -> np.ndarray:
        rows = np.minimum(np.arange(first, first + steps), len(table) - 1)
        return table[rows]
    return of


def _drawn_through(lengths, weights_of, G: int, K: int, steps: int, caps=None) -> np.ndarray:
    """Each source's draws of the window mix's plans of ``steps`` steps (windows of K, the last
    one shorter), deferring nothing."""
    cursor = PlanCursor.start(len(lengths))
    first = 0
    while first < steps:
        k = min(K, steps - first)
        cap = None if caps is None else np.asarray(caps[first:first + k], dtype=np.int64)
        *_, cursor = mix_window(lengths, seed=1, cursor=cursor, weights=weights_of(first, k),
                                caps=cap, draws_per_step=G, defer=False)
        assert cursor.deferred == ()
        first += k
    return np.asarray(cursor.drawn)


def _table(rng: np.random.Generator, S: int, steps: int, switch: bool) -> np.ndarray:
    w = rng.dirichlet(np.ones(S), size=2 if switch else 1)
    if switch:  # a phase switch at a random step, one source off in the second phase
        w[1, rng.integers(S)] = 0.0
        w[1] /= w[1].sum()
        at = int(rng.integers(1, steps))
        return np.concatenate([np.repeat(w[:1], at, axis=0), np.repeat(w[1:], steps - at, axis=0)])
    return np.repeat(w, steps, axis=0)


@pytest.mark.parametrize("case", range(12))
def test_the_window_mixs_epoch_ends_where_one_more_step_would_run_a_source_out(case):
    rng = np.random.default_rng(case)
    S = int(rng.integers(1, 4))
    sizes = rng.integers(40, 400, size=S)
    lengths = [rng.integers(16, 3000, size=n) for n in sizes]
    G = int(rng.choice([4, 8, 24]))
    K = int(rng.choice([1, 3, 4, 7]))
    weights_of = _weights(_table(rng, S, 200, switch=case % 2 == 1))
    end = window_mix_end_step(sizes, weights_of, lambda step: G, K)
    assert end >= 0
    assert (_drawn_through(lengths, weights_of, G, K, end) <= sizes).all()
    assert (_drawn_through(lengths, weights_of, G, K, end + 1) > sizes).any()


def test_the_window_mixs_end_under_the_warmups_caps_draws_each_sample_once():
    """Caps that fit no sample at first: the plans place the overflow (nothing is deferred past
    the epoch), and the epoch's ids are its draws, each once."""
    rng = np.random.default_rng(7)
    sizes = [150, 90]
    lengths = [rng.integers(16, 4000, size=n) for n in sizes]
    G, K = 8, 4
    weights_of = _weights(np.array([[0.6, 0.4]]))
    end = window_mix_end_step(sizes, weights_of, lambda step: G, K)
    caps = np.linspace(64, 4096, end).astype(np.int64)
    cursor, ids = PlanCursor.start(2), []
    for first in range(0, end, K):
        k = min(K, end - first)
        gid, _, counts, nxt = mix_window(lengths, seed=3, cursor=cursor,
                                         weights=weights_of(first, k), caps=caps[first:first + k],
                                         draws_per_step=G, defer=False)
        assert nxt.deferred == ()
        assert np.array_equal(np.sort(gid.ravel()),
                              np.sort(window_draws(sizes, 3, cursor, counts.sum(axis=0))))
        ids.append(gid.ravel())
        cursor = nxt
    every = np.concatenate(ids)
    assert len(every) == end * G == len(set(every.tolist()))
    assert (np.asarray(cursor.drawn) <= sizes).all()


def test_deferring_stays_the_default_of_a_repeating_window():
    """The same capped window with ``defer=True`` (repeating data) holds samples back for a
    later window; with ``defer=False`` it places them."""
    rng = np.random.default_rng(2)
    lengths = [rng.integers(16, 4000, size=500)]
    kw = dict(seed=0, cursor=PlanCursor.start(1), weights=np.ones((4, 1)),
              caps=np.array([64, 64, 128, 128]), draws_per_step=8)
    assert mix_window(lengths, **kw)[3].deferred
    assert mix_window(lengths, **kw, defer=False)[3].deferred == ()


@pytest.mark.parametrize("changes", [(), (5,), (3, 9)])
def test_the_step_mixs_end_is_the_first_step_whose_counts_overrun(changes):
    sizes = [200, 120]
    table = np.array([[0.7, 0.3]])

    def batch(step: int) -> int:
        return 12 + 4 * sum(step >= c for c in changes)

    end = step_mix_end_step(sizes, _weights(table), batch, changes)
    drawn, carry = np.zeros(2, dtype=np.int64), None
    for step in range(end + 1):
        counts, carry = step_source_counts(table, batch(step), carry)
        drawn += counts[0]
        assert (drawn <= sizes).all() == (step < end), step
