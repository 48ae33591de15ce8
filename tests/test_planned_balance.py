"""The window's balancing (energon_ordering/planned/balance.py) against issue 32's measures:
idle per optimizer step near the free-dealing bound of the same steps' samples, exact per-step
source counts, and the choice between balancing the step and every micro-batch."""

from __future__ import annotations

import numpy as np
import pytest

from energon_ordering.inspect.lost_compute import (
    free_dealing_bound,
    idle_per_micro_batch,
    idle_per_step,
    micro_batch_costs,
)
from energon_ordering.inspect.synthetic import LENGTH_PROFILES, sample_lengths
from energon_ordering.planned.balance import _rank_within, balance_window, sample_cost

K, R, M, B = 32, 16, 8, 4
G = R * M * B


def _heavy_tailed(n: int, seed: int) -> np.ndarray:
    """10% of samples around 6,000 tokens, the rest around 500 (lognormal)."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.1
    return np.where(long, rng.lognormal(np.log(6000), 0.3, n),
                    rng.lognormal(np.log(500), 0.6, n)).clip(16, 32768).astype(np.int64)


def _trimodal() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = sample_lengths(LENGTH_PROFILES["trimodal"], K * G, 1)
    return lengths, np.zeros(K * G, dtype=np.int64), np.full((K, 1), G)


def _heavy() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two sources 0.7 / 0.3, the second 3x longer."""
    n0 = round(0.7 * G)
    lengths = np.concatenate([_heavy_tailed(K * n0, 1), 3 * _heavy_tailed(K * (G - n0), 2)])
    sources = np.repeat([0, 1], [K * n0, K * (G - n0)])
    return lengths, sources, np.tile([n0, G - n0], (K, 1))


def _plan(lengths, sources, counts, **kw) -> np.ndarray:
    """``[K, R, M, B]`` lengths of the balanced window, checked to hold every sample once and
    every step's exact counts."""
    pos = balance_window(sample_cost(lengths), sources, counts, world_size=R, micro_batch=B,
                         micro_batches_per_step=M, lengths=lengths, **kw)
    assert np.array_equal(np.sort(pos.ravel()), np.arange(len(lengths)))
    for t in range(len(counts)):
        assert np.array_equal(np.bincount(sources[pos[t].ravel()], minlength=counts.shape[1]),
                              counts[t])
    return lengths[pos].transpose(0, 2, 1, 3).astype(np.float64)


@pytest.mark.parametrize("mix, weight", [(_trimodal, {}), (_heavy, {"micro_batch_weight": 0.0})],
                         ids=["trimodal", "heavy-by-step"])
def test_idle_per_step_is_near_the_free_dealing_bound(mix, weight) -> None:
    lengths = _plan(*mix(), **weight)
    idle = idle_per_step(micro_batch_costs(lengths))
    bound = free_dealing_bound(sample_cost(lengths).reshape(K, -1), R)
    # issue 32: within 1.2x of the bound or 0.1 point of it (the old dealing, micro-batch by
    # micro-batch: 0.15% against 0.01% on trimodal, 0.83% against 0.32% on heavy; the default,
    # which keeps every micro-batch index balanced as well, misses it here on heavy tails:
    # 0.68%)
    assert idle <= max(1.2 * bound, bound + 0.001), (idle, bound)


def test_micro_batch_weight_trades_step_balance_for_micro_batch_balance() -> None:
    data = _heavy()
    by_step = micro_batch_costs(_plan(*data, micro_batch_weight=0.0))
    by_micro_batch = micro_batch_costs(_plan(*data))  # the default: 1
    # the step's outliers are evened out across micro-batch indices (measured: 0.23% against
    # 0.68% per step), or kept within their index (0.34% against 2.6% per micro-batch)
    assert idle_per_step(by_step) < 0.5 * idle_per_step(by_micro_batch)
    assert idle_per_micro_batch(by_micro_batch) < 0.5 * idle_per_micro_batch(by_step)


def test_exact_counts_with_an_excess_in_a_cycle_over_four_sources() -> None:
    """Four sources of disjoint lengths, two micro-batches per step: no slot holds a step's
    share of any source, and the excesses run in cycles; the bulk repair still reaches every
    step's counts."""
    rng = np.random.default_rng(7)
    k, r, m, b = 6, 4, 2, 2
    g = r * m * b
    counts = np.array([rng.multinomial(g, [0.4, 0.3, 0.2, 0.1]) for _ in range(k)])
    n = counts.sum(axis=0)
    sources = np.repeat(np.arange(4), n)
    lengths = np.concatenate([rng.integers(lo, lo + 50, c)
                              for lo, c in zip((10, 1000, 3000, 9000), n)])
    pos = balance_window(sample_cost(lengths), sources, counts, world_size=r, micro_batch=b,
                         micro_batches_per_step=m)
    assert np.array_equal(np.sort(pos.ravel()), np.arange(k * g))
    for t in range(k):
        assert np.array_equal(np.bincount(sources[pos[t].ravel()], minlength=4), counts[t])


@pytest.mark.parametrize("groups", [np.zeros(0, dtype=np.int32), np.array([5], dtype=np.int32),
                                    np.random.default_rng(3).integers(0, 9, 2000).astype(np.int32),
                                    np.random.default_rng(4).integers(0, 70_000, 5000)])
def test_rank_within_counts_earlier_elements_of_the_same_group(groups):
    """The repair's per-step quota check: element i's rank is how many earlier elements share
    its group (int32: a round of trades holds a window's worth of them)."""
    seen: dict[int, int] = {}
    expected = []
    for g in groups.tolist():
        expected.append(seen.get(g, 0))
        seen[g] = seen.get(g, 0) + 1
    got = _rank_within(groups)
    assert got.dtype == np.int32
    assert got.tolist() == expected
