"""Longest-processing-time dealing in tuples (:mod:`energon_ordering.planned.lpt`)."""

from __future__ import annotations

import numpy as np
import pytest

from energon_ordering.planned.lpt import deal_sorted, deal_tuples, falling_order


@pytest.mark.parametrize("R,P", [(1, 1), (4, 1), (4, 3), (16, 4), (7, 5)])
def test_deal_sorted_is_deal_tuples_on_sorted_slots_without_ties(R, P):
    rng = np.random.default_rng(R * 10 + P)
    costs = np.sort(rng.random((6, R * P)) * 1000, axis=1)  # distinct: no tie to order
    column, totals = deal_sorted(costs, R, P)
    flat = np.arange(costs.size).reshape(costs.shape)
    expected = deal_tuples(flat, costs.reshape(-1), R, P) % (R * P)
    assert np.array_equal(column, expected)
    assert np.allclose(totals, np.take_along_axis(costs, column.reshape(6, -1), axis=1)
                       .reshape(6, R, P).sum(axis=2))


def test_deal_sorted_gives_every_rank_one_item_of_each_tuple_ties_included():
    R, P = 8, 4
    costs = np.sort(np.random.default_rng(0).integers(0, 5, (10, R * P)), axis=1).astype(float)
    column, totals = deal_sorted(costs, R, P)
    for row in range(10):
        assert sorted(column[row].ravel().tolist()) == list(range(R * P))  # each item once
        # tuple j (the j-th costliest R items) gives each rank exactly one item
        tuple_of = (R * P - 1 - column[row]) // R
        assert (np.sort(tuple_of, axis=1) == np.arange(P)).all()
    lpt_spread = totals.max(axis=1) - totals.min(axis=1)
    assert (lpt_spread <= costs.max(axis=1) - costs.min(axis=1) + 1e-9).all()


@pytest.mark.parametrize("spread", [1, 3, 1000])  # all tied, many ties, few
def test_falling_order_is_the_stable_argsort_of_rows_that_do_not_rise(spread):
    """The first tuple's order, known without a sort: numpy's stable order, ties by index."""
    rng = np.random.default_rng(spread)
    for n, R in ((0, 5), (3, 0), (1, 1), (4, 7), (6, 300)):
        v = -np.sort(-rng.integers(0, spread, (n, R)).astype(np.float64), axis=1)
        assert np.array_equal(falling_order(v), np.argsort(v, axis=1, kind="stable")), (n, R)
