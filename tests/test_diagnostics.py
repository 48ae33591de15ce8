"""Diagnostics on constructed inputs with known answers."""

from __future__ import annotations

import pytest

from energon_ordering.diagnostics import batch_cost, padding_waste, rank_overlap, straggler_idle


def test_batch_cost_has_linear_and_quadratic_terms():
    assert batch_cost([4096]) == 4096 + 4096
    assert batch_cost([100, 200]) == pytest.approx(300 + (100**2 + 200**2) / 4096)


def test_straggler_idle_known_values():
    assert straggler_idle([[[10], [10]], [[5, 5], [5, 5]]]) == 0.0
    # one rank costs c, the other 0: mean/max = 1/2 -> half the time idle
    assert straggler_idle([[[4096], []]]) == pytest.approx(0.5)
    # costs 1x and 3x: mean/max = 2/3
    c1 = batch_cost([100])
    step = [[100], [100, 100, 100]]
    assert batch_cost(step[1]) == pytest.approx(3 * c1)
    assert straggler_idle([step]) == pytest.approx(1 / 3)


def test_straggler_idle_rejects_empty_input():
    with pytest.raises(ValueError, match="no steps"):
        straggler_idle([])
    with pytest.raises(ValueError, match="step 0 has no ranks"):
        straggler_idle([[]])


def test_padding_waste_known_values():
    assert padding_waste([[5, 5, 5]]) == 0.0
    assert padding_waste([[1, 3]]) == pytest.approx(1 - 4 / 6)
    assert padding_waste([[2, 2], [1, 3]]) == pytest.approx((0 + 1 / 3) / 2)
    with pytest.raises(ValueError, match="no non-empty batches"):
        padding_waste([[]])


def test_rank_overlap():
    assert rank_overlap([["a", "b"], ["c"], ["d"]]) == set()
    assert rank_overlap([["a", "b"], ["b", "c"], ["a"]]) == {"a", "b"}
    assert rank_overlap([["a", "a"], ["b"]]) == set()  # repeats within a rank are not overlap


def test_switch_lag_of_a_delayed_step_is_the_delay():
    from energon_ordering.diagnostics import switch_lag

    target = [0.1] * 10 + [0.6] * 20
    late = [0.1] * 13 + [0.6] * 17
    assert switch_lag(late, target) == pytest.approx(3)
    assert switch_lag(target, target) == 0
    early = [0.1] * 8 + [0.6] * 22
    assert switch_lag(early, target) == pytest.approx(-2)
    smeared = [0.1] * 10 + [0.1 + 0.5 * k / 10 for k in range(1, 11)] + [0.6] * 10
    assert switch_lag(smeared, target) == pytest.approx(4.5)
    with pytest.raises(ValueError, match="does not change"):
        switch_lag([0.1, 0.1], [0.1, 0.1])
