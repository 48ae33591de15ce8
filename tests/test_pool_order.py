"""The pool orders as pure functions: no dataset needed."""

from __future__ import annotations

import random

import pytest

from energon_ordering.pool.order import (
    POOL_ORDERS,
    batch_mode_order,
    permutation,
    pool_seed,
    sample_mode_order,
    sorted_indices,
)


def test_permutation_is_a_permutation_and_deterministic():
    for n in (0, 1, 2, 7, 100):
        p = permutation(n, seed=123)
        assert sorted(p) == list(range(n))
        assert p == permutation(n, seed=123)


def test_permutation_depends_on_seed():
    assert permutation(50, seed=1) != permutation(50, seed=2)


GOLDEN_POOL_SEED = 14328793197874242718


def test_permutation_golden_value():
    # Saved checkpoints replay pools with this function: its output for a given seed must never
    # change without bumping ORDER_VERSION.
    assert permutation(6, seed=42) == [2, 5, 4, 1, 0, 3]
    assert pool_seed(0, 0, 0) == GOLDEN_POOL_SEED


def test_pool_seed_varies_with_every_argument():
    base = pool_seed(7, 3, 1)
    assert pool_seed(8, 3, 1) != base
    assert pool_seed(7, 4, 1) != base
    assert pool_seed(7, 3, 0) != base
    assert 0 <= base < 2**64


def test_sorted_indices_is_stable():
    assert sorted_indices([5, 1, 5, 1, 3]) == [1, 3, 4, 0, 2]


@pytest.mark.parametrize("mode", sorted(POOL_ORDERS))
def test_orders_are_permutations_of_the_pool(mode):
    rng = random.Random(0)
    lengths = [rng.randint(1, 5000) for _ in range(64)]
    order = POOL_ORDERS[mode](lengths, 99, 4)
    assert sorted(order) == list(range(64))


def test_sample_mode_applies_one_permutation_to_the_sorted_pool():
    lengths = [30, 10, 20, 40]
    seed = 5
    ranked = sorted_indices(lengths)
    assert sample_mode_order(lengths, seed) == [ranked[p] for p in permutation(4, seed)]


def test_sample_mode_aligns_ranks_with_similar_quantiles():
    # Two ranks whose pools hold the same quantiles in different arrival orders emit, position
    # by position, samples of the same quantile.
    rng = random.Random(1)
    base = sorted(rng.sample(range(100, 10_000), 32))
    rank0 = [x for x in base]
    rank1 = [x + 1 for x in base]
    rng.shuffle(rank0)
    rng.shuffle(rank1)
    seed = pool_seed(0, 0, 0)
    out0 = [rank0[i] for i in sample_mode_order(rank0, seed)]
    out1 = [rank1[i] for i in sample_mode_order(rank1, seed)]
    assert [b - a for a, b in zip(out0, out1)] == [1] * 32
    assert out0 != sorted(out0)  # permuted, not just sorted


def test_batch_mode_chunks_are_sorted_neighbours_and_permuted():
    rng = random.Random(2)
    lengths = [rng.randint(1, 5000) for _ in range(32)]
    order = batch_mode_order(lengths, seed=11, batch_size=4)
    ranked = sorted_indices(lengths)
    chunks = [order[i : i + 4] for i in range(0, 32, 4)]
    starts = []
    for chunk in chunks:
        start = ranked.index(chunk[0])
        assert chunk == ranked[start : start + 4]
        starts.append(start // 4)
    assert sorted(starts) == list(range(8))
    assert starts == permutation(8, 11)


def test_batch_mode_partial_pool_puts_remainder_last():
    lengths = [9, 1, 8, 2, 7, 3, 6, 4, 5, 0]
    order = batch_mode_order(lengths, seed=3, batch_size=4)
    ranked = sorted_indices(lengths)
    assert order[-2:] == ranked[8:]
    assert sorted(order[:8]) == sorted(ranked[:8])


def test_batch_mode_needs_a_batch_size():
    with pytest.raises(ValueError, match="batch_size = None"):
        batch_mode_order([1, 2], seed=0, batch_size=None)
