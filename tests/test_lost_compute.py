"""Lost compute measures (energon_ordering/inspect/lost_compute.py) on hand-computed cases."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest

from energon_ordering.errors import OrderingConfigError
from energon_ordering.inspect.lost_compute import (
    free_dealing_bound,
    held_packs_bound,
    idle_per_micro_batch,
    idle_per_step,
    lost_compute,
    micro_batch_costs,
    pack_padding_by_tokens,
    padding_by_tokens,
)


def test_micro_batch_costs_are_linear_plus_attention() -> None:
    # 4096 tokens cost 4096 + 4096 = 8192; an empty slot costs nothing
    assert micro_batch_costs(np.array([[4096, 0], [64, 64]])).tolist() == [8192.0, 130.0]


def test_idle_per_micro_batch_and_per_step_differ() -> None:
    # one step, 2 ranks, 2 micro-batches: rank 0 costs (4, 0), rank 1 (2, 2)
    costs = np.array([[[4.0, 0.0], [2.0, 2.0]]])
    # micro-batch 0: 1 - 3/4; micro-batch 1: 1 - 1/2
    assert idle_per_micro_batch(costs) == pytest.approx((0.25 + 0.5) / 2)
    # per step both ranks cost 4: no idle at the gradient reduction
    assert idle_per_step(costs) == pytest.approx(0.0)


def test_idle_per_step_averages_over_steps() -> None:
    costs = np.array([[[3.0], [1.0]], [[2.0], [2.0]]])  # step 0: 1 - 2/3; step 1: 0
    assert idle_per_step(costs) == pytest.approx(1 / 6)
    assert idle_per_micro_batch(costs) == pytest.approx(1 / 6)  # M = 1: the same figure


def test_idle_of_all_zero_costs_is_zero() -> None:
    assert idle_per_step(np.zeros((2, 3, 1))) == 0.0
    assert idle_per_micro_batch(np.zeros((2, 3, 1))) == 0.0


def test_padding_is_weighted_by_tokens() -> None:
    # padded to 2 x 3 + 2 x 2 = 10 tokens for 8 real: 20% (a mean of ratios would say 1/6)
    assert padding_by_tokens(np.array([[1, 3], [2, 2]])) == pytest.approx(0.2)
    # a heavy micro-batch weighs by its tokens: (2 - 2 + 200 - 101) / 202
    assert padding_by_tokens(np.array([[1, 1], [100, 1]])) == pytest.approx(99 / 202)


def test_padding_excludes_empty_slots_and_flattens_leading_axes() -> None:
    assert padding_by_tokens(np.array([[4, 0], [2, 2]])) == pytest.approx(0.0)
    lens = np.array([[1, 3], [2, 2]]).reshape(1, 2, 1, 2)  # [steps, R, M, B]
    assert padding_by_tokens(lens) == pytest.approx(0.2)
    assert padding_by_tokens(np.zeros((3, 4))) == 0.0


def test_pack_padding_by_tokens() -> None:
    assert pack_padding_by_tokens(np.array([6, 8]), 8) == pytest.approx(2 / 16)
    # a warmup pack of cap 4 weighs half as much as one of 8
    assert pack_padding_by_tokens(np.array([6, 2]), np.array([8, 4])) == pytest.approx(4 / 12)
    with pytest.raises(OrderingConfigError, match="pack 1 holds 9.0 tokens, above its capacity"):
        pack_padding_by_tokens(np.array([6, 9]), 8)
    with pytest.raises(OrderingConfigError, match="capacity has 3 values for 2 packs"):
        pack_padding_by_tokens(np.array([6, 8]), np.array([8, 8, 8]))


def test_free_dealing_is_longest_first_onto_the_least_loaded() -> None:
    # LPT: 5 -> A, 4 -> B, 3 -> B (7), 3 -> A (8), 3 -> B (10): 1 - 9/10 (the best split is 9/9)
    assert free_dealing_bound(np.array([[5.0, 4, 3, 3, 3]]), 2) == pytest.approx(0.1)
    # a single sample costing more than the mean load bounds the step: loads 10 and 2
    assert free_dealing_bound(np.array([[1.0, 10, 1]]), 2) == pytest.approx(1 - 6 / 10)
    # a rank takes any number of samples: 4 | 1+1+1+1
    assert free_dealing_bound(np.array([[1.0, 1, 4, 1, 1]]), 2) == pytest.approx(0.0)


@pytest.mark.parametrize("ranks", [1, 2, 7, 64, 300])
def test_free_dealing_equals_one_at_a_time_dealing(ranks: int) -> None:
    rng = np.random.default_rng(ranks)
    costs = rng.lognormal(6, 1.5, (4, ranks * 6 + 3))
    expected = []
    for step in costs:
        heap = [(0.0, r) for r in range(ranks)]
        for c in np.sort(step)[::-1]:
            total, r = heapq.heappop(heap)
            heapq.heappush(heap, (total + c, r))
        loads = np.array([t for t, _ in heap])
        expected.append(1 - loads.mean() / loads.max())
    assert free_dealing_bound(costs, ranks) == pytest.approx(np.mean(expected), rel=1e-12)


def test_held_packs_bound_is_the_costliest_pack_beside_the_cheapest() -> None:
    # 2 ranks x 2 packs: a pack of one cap-long sample (24) and three full packs of short ones;
    # the rank holding the 24 holds another pack of at least 8: 1 - 28 / 32
    costs = np.array([[[24.0, 12.0], [12.0, 8.0]]])
    assert held_packs_bound(costs) == pytest.approx(1 - 28 / 32)
    # one pack per rank: the bound is the step's own idle (no dealing moves a pack's cost)
    one = np.array([[[5.0], [3.0]], [[2.0], [2.0]]])
    assert held_packs_bound(one) == pytest.approx(idle_per_step(one))
    # a step whose packs balance however dealt: 0, never negative
    assert held_packs_bound(np.array([[[4.0, 4.0], [4.0, 4.0]]])) == 0.0
    assert held_packs_bound(np.zeros((1, 2, 2))) == 0.0
    with pytest.raises(OrderingConfigError, match=r"pack_costs has shape \(2, 2\); give \[steps"):
        held_packs_bound(np.zeros((2, 2)))


@pytest.mark.parametrize("seed", range(6))
def test_no_dealing_of_the_packs_beats_the_held_packs_bound(seed: int) -> None:
    """Every way of dealing a step's R M packs to R ranks of M idles at least the bound."""
    rng = np.random.default_rng(seed)
    R, M = 3, 2
    packs = rng.lognormal(9, 0.6, R * M)
    bound = held_packs_bound(packs.reshape(1, R, M))
    best = min(idle_per_step(packs[list(order)].reshape(1, R, M))
               for order in itertools.permutations(range(R * M)))
    assert best >= bound - 1e-12


def test_lost_compute_adds_idle_per_step_and_padding() -> None:
    assert lost_compute(0.01, 0.02) == pytest.approx(0.03)
    with pytest.raises(OrderingConfigError, match="padding = 1.5; give a fraction in"):
        lost_compute(0.01, 1.5)


def test_bad_inputs_name_the_argument() -> None:
    with pytest.raises(OrderingConfigError, match=r"costs has shape \(2, 3\); give \[steps"):
        idle_per_step(np.zeros((2, 3)))
    with pytest.raises(OrderingConfigError, match="costs holds -1.0; give finite values >= 0"):
        idle_per_micro_batch(np.array([[[1.0, -1.0]]]))
    with pytest.raises(OrderingConfigError, match="lengths holds nan"):
        padding_by_tokens(np.array([[1.0, np.nan]]))
    with pytest.raises(OrderingConfigError, match=r"lengths has shape \(3,\)"):
        padding_by_tokens(np.array([1, 2, 3]))
    with pytest.raises(OrderingConfigError, match="world_size = 0; give an int >= 1"):
        free_dealing_bound(np.ones((1, 4)), 0)
    with pytest.raises(OrderingConfigError, match="costs has shape"):
        idle_per_step(np.zeros((0, 2, 1)))
