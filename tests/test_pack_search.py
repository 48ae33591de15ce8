"""The packed plan's count search (:mod:`energon_ordering.planned.pack_search`) as pure
functions: the token bound is the largest count that fits, the count taken packs every draw
within the cap, each source at its exact count, and the search packs once where the first
count fits and balances."""

from __future__ import annotations

import numpy as np
import pytest

from energon_ordering.mixture.step_counts import step_source_counts
from energon_ordering.planned import pack_search
from energon_ordering.planned.pack_fill import pack_fill
from energon_ordering.planned.pack_search import (
    FILL_RESOLUTION,
    START_MARGIN,
    most_that_fit,
    search_packed,
)
from energon_ordering.planned.source_draws import SourceDraws, cut_lengths

CAP = 2048


def _streams(seed: int = 0, sizes=(50_000, 20_000)) -> list[SourceDraws]:
    rng = np.random.default_rng(seed)
    short = np.clip(rng.lognormal(5.0, 0.8, sizes[0]), 8, 4096).round()
    long = np.clip(rng.lognormal(6.5, 0.9, sizes[1]), 8, 4096).round()
    return [SourceDraws(seed, s, x, 0) for s, x in enumerate((short, long))]


def _counts_of(weights=(0.7, 0.3)):
    w = np.asarray(weights, float)[None, :]

    def counts_of(n: int):
        c, e = step_source_counts(w, n, np.zeros(len(weights)))
        return c[0].astype(np.int64), e
    return counts_of


def _tokens(streams, c) -> float:
    return float(cut_lengths(streams, c, CAP).sum())


@pytest.fixture
def packings(monkeypatch) -> list[tuple[int, int]]:
    """The search's packings, in order: ``(samples packed, samples left out)``."""
    calls = []

    def counting(*a, **kw):
        got = pack_fill(*a, **kw)
        calls.append((len(a[0]), int((got[0] < 0).sum())))
        return got

    monkeypatch.setattr(pack_search, "pack_fill", counting)
    return calls


def _search(streams, counts_of, R, P, tolerance):
    """``(token bound, what the search took)`` for R ranks of P packs of CAP tokens."""
    most = most_that_fit(streams, counts_of, least=R * P, budget=float(R * P * CAP), cap=CAP,
                         limits=None)
    return most, search_packed(streams, counts_of, most=most, least=R * P, cap=CAP,
                               world_size=R, packs_per_rank=P, idle_tolerance=tolerance)


@pytest.mark.parametrize("R, P", [(4, 2), (16, 1), (64, 8)])
def test_the_token_bound_is_the_largest_count_that_fits(R, P):
    streams, counts_of = _streams(R), _counts_of()
    budget = float(R * P * CAP)
    most = most_that_fit(streams, counts_of, least=R * P, budget=budget, cap=CAP, limits=None)
    assert _tokens(streams, counts_of(most)[0]) <= budget
    assert _tokens(streams, counts_of(most + 1)[0]) > budget


def test_the_token_bound_stops_at_a_finite_epochs_limits():
    streams, counts_of = _streams(3), _counts_of()
    limits = np.array([10_000, 60])  # the long source runs out first
    most = most_that_fit(streams, counts_of, least=16, budget=1e12, cap=CAP, limits=limits)
    assert (counts_of(most)[0] <= limits).all() and (counts_of(most + 1)[0] > limits).any()


@pytest.mark.parametrize("R, P, tolerance", [(4, 2, 0.002), (16, 1, 0.002), (64, 8, 0.002),
                                              (32, 4, None)])
def test_the_count_taken_packs_every_draw_within_the_cap(R, P, tolerance):
    streams, counts_of = _streams(R + P), _counts_of()
    most, found = _search(streams, counts_of, R, P, tolerance)
    n = int(found.counts.sum())
    assert np.array_equal(found.counts, counts_of(n)[0])  # each source exact for its count
    assert np.array_equal(found.carry, counts_of(n)[1])
    L = cut_lengths(streams, found.counts, CAP)
    assert len(found.pack) == len(L) and (found.pack >= 0).all()
    load = np.bincount(found.pack, weights=L, minlength=R * P)
    assert load.max() <= CAP and (np.bincount(found.pack, minlength=R * P) > 0).all()
    # full: within the margin the search starts at (or, where that count failed, the
    # resolution of its bisection) of the token bound
    assert n >= most - int(most * START_MARGIN) - max(1, int(n * FILL_RESOLUTION)) - 1
    # the ranks' costs the packing reports are the draws' own
    cost = L + L * L / 4096
    rank_cost = np.bincount(found.pack // P, weights=cost, minlength=R)
    assert np.allclose(rank_cost, found.packing.rank_cost)


def test_one_packing_where_the_first_count_fits_and_balances(packings):
    most, found = _search(_streams(7), _counts_of(), 64, 8, 0.002)
    assert found.packing.idle <= 0.002
    assert [n for n, _ in packings] == [most - int(most * START_MARGIN)]


def test_an_unbalanced_full_count_is_traded_for_a_balanced_one(packings):
    """The count at the margin packs whole with its ranks over the tolerance, and an emptier one
    balances: the search balances first, and takes a count within the tolerance."""
    R, P, tolerance = 64, 2, 0.025
    streams, counts_of = _streams(11), _counts_of()
    most = most_that_fit(streams, counts_of, least=R * P, budget=float(R * P * CAP), cap=CAP,
                         limits=None)
    start = most - int(most * START_MARGIN)
    pack, at_start = pack_fill(cut_lengths(streams, counts_of(start)[0], CAP), R, P, CAP)
    assert (pack >= 0).all() and at_start.idle > tolerance  # the case this test is about
    _, found = _search(streams, counts_of, R, P, tolerance)
    assert len(packings) > 1 and packings[0][0] == start
    assert (found.pack >= 0).all()
    assert found.packing.idle <= tolerance


def test_a_count_short_of_room_is_lowered_by_the_left_out_tokens(packings, monkeypatch):
    """Started at the token bound itself (no margin), the packing leaves draws out; the next
    try is lower by their tokens in mean-length samples (less than their number: they are the
    shortest) and the search ends on a count that packs whole, close below the bound."""
    monkeypatch.setattr(pack_search, "START_MARGIN", 0.0)
    most, found = _search(_streams(5), _counts_of(), 64, 8, None)
    (first, left_out), (second, _) = packings[:2]
    assert first == most and left_out > 0
    assert most - left_out < second < most
    n = int(found.counts.sum())
    assert (found.pack >= 0).all() and n >= most - left_out


def test_a_count_lowered_by_the_resolution_from_one_left_short_is_taken_as_it_is(packings,
                                                                                   monkeypatch):
    """The bisection's resolution is measured against the count that left draws out: lowered
    from it by exactly the resolution (no slack for the left-out tokens), the count that packs
    whole is taken, with no third packing (``PACKED_PLAN_VERSION`` 3 measured it against the
    lower count, which is smaller, so it bisected once more)."""
    monkeypatch.setattr(pack_search, "START_MARGIN", 0.0)
    monkeypatch.setattr(pack_search, "LOWER_SLACK", 0.0)
    monkeypatch.setattr(pack_search, "FILL_RESOLUTION", 1 / 50)
    most, found = _search(_streams(5), _counts_of(), 64, 8, None)
    (first, left_out), (second, second_left_out) = packings[:2]
    assert first == most and left_out > 0
    assert second == most - int(most / 50) and second_left_out == 0
    assert len(packings) == 2 and int(found.counts.sum()) == second


def _heavy_streams(seed: int) -> list[SourceDraws]:
    """A heavy tail at the cap: 10% of one source near it, 30% of the other's (two packs per rank
    cannot balance those: the idle is the packs' own)."""
    rng = np.random.default_rng(seed)

    def source(long_share: float) -> np.ndarray:
        long = rng.random(20_000) < long_share
        x = np.where(long, rng.lognormal(np.log(1500), 0.3, 20_000),
                     rng.lognormal(np.log(120), 0.6, 20_000))
        return np.clip(x, 8, 4096).round()

    return [SourceDraws(seed, s, source(p), 0) for s, p in enumerate((0.1, 0.3))]


@pytest.mark.parametrize("R", [8, 64])
def test_where_no_count_balances_the_one_losing_least_compute_is_taken(packings, R):
    """At two packs per rank on a heavy tail no count is within the idle tolerance: the search
    takes, of the counts it packed whole, the one with the least idle per step + padding by
    tokens (``PACKED_PLAN_VERSION`` 5; version 4 took the most balanced one and bisected up from
    it, padding 2-3 points more for less than one point of idle)."""
    P = 2
    streams, counts_of = _heavy_streams(R), _counts_of()
    most, found = _search(streams, counts_of, R, P, 0.002)
    whole = []  # (count, lost compute, idle) of every count the search packed whole
    for n, left_out in packings:
        if not left_out:
            c = counts_of(n)[0]
            _, packing = pack_fill(cut_lengths(streams, c, CAP), R, P, CAP)
            whole.append((n, packing.lost, packing.idle))
    assert all(idle > 0.002 for _, _, idle in whole)  # the case this test is about
    assert found.packing.lost == min(lost for _, lost, _ in whole)
    n = int(found.counts.sum())
    assert (n, found.packing.lost) in [(m, lost) for m, lost, _ in whole]
    assert found.packing.padding == pytest.approx(
        1 - float(cut_lengths(streams, found.counts, CAP).sum()) / (R * P * CAP))


@pytest.mark.parametrize("R", [8, 64])
def test_an_emptier_count_that_cannot_win_is_not_packed(packings, R):
    """One pack per rank on a heavy tail: the rank holding the costliest sample idles the others
    whatever the count, so the emptier counts of the balance-first search are known to lose (their
    idle is at least ``1 - mean / costliest sample``, their padding larger) and are not packed.
    Packed by hand, they do lose at least what the count taken loses."""
    P, tolerance = 1, 0.002
    streams, counts_of = _heavy_streams(R + 1), _counts_of()
    most, found = _search(streams, counts_of, R, P, tolerance)
    n = int(found.counts.sum())
    whole = [m for m, left_out in packings if not left_out]
    assert whole == [n]  # only the count taken was packed whole
    for margin in (START_MARGIN, pack_search.BALANCE_MARGIN):
        m = n - int(n * margin)
        pack, packing = pack_fill(cut_lengths(streams, counts_of(m)[0], CAP), R, P, CAP)
        assert (pack >= 0).all()
        assert packing.idle > tolerance and packing.lost >= found.packing.lost


#: sha256 of :func:`_packed_digest`'s plans (every pack's ids, the offsets, counts and cursors)
#: under PACKED_PLAN_VERSION 5 (and, for the window mix, WINDOW_MIX_PLAN_VERSION 3). A packed
#: state resumes by re-planning its window, so a change of any packed plan for the same inputs
#: must bump the version (restores of older states are then refused by name) and update these.
PINNED_PACKED_DIGESTS = {
    "step": "e7d75de2d235d6b906f6d38416281bc19bdc2b7b8b644bbb1cd01a44aae3b77d",
    "window": "337fc06995aad37d85c1d1e6eb895ed6783854ac7abe3a22ef8df8092935dd09",
}


def _packed_digest(mix: str) -> str:
    import hashlib

    from energon_ordering.planned.cursor import PlanCursor
    from energon_ordering.planned.packs import plan_packed_window

    rng = np.random.default_rng(11)
    lengths = [rng.integers(20, 3000, 30011), np.minimum(rng.lognormal(7.5, 0.8, 9001), 12000)
               .astype(np.int64)]
    h = hashlib.sha256()
    cursor = PlanCursor.start(2)
    for w in range(3):
        plan = plan_packed_window(lengths, seed=4, cursor=cursor, weights=[[0.7, 0.3]] * 4,
                                  caps=[4096, 4096, 4096, 4096], world_size=8, micro_batch=1,
                                  micro_batches_per_step=2, mix=mix)
        for a in (plan.ids, plan.offsets, plan.counts):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        cursor = plan.next_cursor
        h.update(repr(cursor).encode())
    return h.hexdigest()


@pytest.mark.parametrize("mix", ["step", "window"])
def test_packed_plans_are_pinned_to_their_version(mix):
    from energon_ordering.planned.packs import PACKED_PLAN_VERSION
    from energon_ordering.planned.window import WINDOW_MIX_PLAN_VERSION

    assert (PACKED_PLAN_VERSION, WINDOW_MIX_PLAN_VERSION) == (5, 3), (
        "a plan version was bumped: recompute PINNED_PACKED_DIGESTS")
    assert _packed_digest(mix) == PINNED_PACKED_DIGESTS[mix], (
        f"the packed plans of planned_mix={mix} changed for the same inputs: bump "
        "PACKED_PLAN_VERSION (or WINDOW_MIX_PLAN_VERSION) and update PINNED_PACKED_DIGESTS")


def test_a_packing_is_the_same_whichever_sort_orders_its_rounds(monkeypatch):
    """A round's ranks are distinct keys: numpy's default sort (where it is vectorised) and its
    stable sort (timsort, elsewhere) give the same packs."""
    from energon_ordering.planned import pack_fill as fill_module

    L = np.minimum(np.random.default_rng(8).lognormal(6.5, 1.0, 1_800), 4096).round()
    got = {}
    for kind in (None, "stable"):
        monkeypatch.setattr(fill_module, "runs_sort_kind", lambda kind=kind: kind)
        pack, packing = pack_fill(L, 128, 4, 4096)
        got[kind] = (pack, packing.rank_cost.copy())
    assert np.array_equal(got[None][0], got["stable"][0])
    assert np.array_equal(got[None][1], got["stable"][1])
    assert (got[None][0] >= 0).sum() > 0.9 * len(L)
