"""The planned order's packs as pure functions (issue 23, packing): every step's packs fit
the step's cap, every drawn sample is in exactly one pack, the per-step mix is exact, the ranks
are balanced by attention cost, and a finite epoch ends before a source runs out."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from energon_ordering.errors import OrderingConfigError
from energon_ordering.inspect.synthetic import LENGTH_PROFILES, sample_lengths
from energon_ordering.mixture.step_counts import step_source_counts
from energon_ordering.planned import pack_fill as pack_fill_module
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.packs import fill_packs, plan_packed_window
from energon_ordering.warmup.pack_cap import pack_target
from energon_ordering.warmup.schedule import SeqLenWarmup


def _lengths(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    short = np.clip(rng.lognormal(5.5, 0.8, 20_000), 8, 4096).round()
    heavy = np.clip(rng.lognormal(7.0, 0.9, 6_000), 8, 4096).round()
    return [short, heavy]


def _plan(lengths, *, R=4, M=2, B=2, caps=(2048,) * 4, weights=(0.7, 0.3), cursor=None,
          limits=None):
    w = np.tile(np.asarray(weights, float), (len(caps), 1))
    return plan_packed_window(lengths, seed=3, cursor=cursor or PlanCursor.start(len(lengths)),
                              weights=w, caps=list(caps), world_size=R, micro_batch=B,
                              micro_batches_per_step=M, epoch_limits=limits)


def test_fill_packs_fits_every_pack_and_balances_ranks():
    rng = np.random.default_rng(1)
    L = np.minimum(rng.lognormal(5.5, 1.0, 3000).round(), 1024)
    pack = fill_packs(L, 8, 4, 1024)
    placed = pack >= 0
    loads = np.bincount(pack[placed], weights=L[placed], minlength=32)
    assert loads.max() <= 1024
    cost = L + L * L / 4096
    rank_cost = np.bincount(pack[placed] // 4, weights=cost[placed], minlength=8)
    assert rank_cost.max() - rank_cost.min() <= cost.max()  # within one sample's cost
    # what is left over could not fit: every unplaced item is longer than every pack's room
    if (~placed).any():
        assert L[~placed].min() > (1024 - loads).max()


@pytest.mark.parametrize("seed", range(6))
def test_whole_lengths_are_dealt_in_integers_to_the_same_packs_as_in_floats(seed):
    """The integer dealing (``_WholeCosts``) places every item as the float dealing does, and
    leaves the packing in the same state: lengths near the cap (rooms run out, cheapest packs
    fill up), equal lengths (ties everywhere) and a lognormal tail."""
    rng = np.random.default_rng(seed)
    R, P, cap = int(rng.integers(1, 40)), int(rng.integers(1, 9)), int(rng.choice([64, 1024]))
    n = R * P * 6
    L = [rng.integers(1, cap + 1, n), rng.choice([cap // 8, cap // 4, cap // 2, 3 * cap // 4], n),
         np.minimum(rng.lognormal(np.log(cap / 6), 1.0, n).astype(np.int64) + 1, cap)
         ][seed % 3].astype(np.float64)
    queue = pack_fill_module._longest_first(L)
    states = []
    for whole in (True, False):
        packing = pack_fill_module.Packing.empty(R, P, cap)
        out = np.full(n, -1)
        packing.seed(L, queue[:R * P], out)
        if whole:
            assert pack_fill_module._WholeCosts.of(packing, L, queue[R * P:]) is not None
            packing.place(L, queue[R * P:], out)
        else:
            packing._place_floats(L, queue[R * P:], out)
        states.append((out, packing))
    (a, pa), (b, pb) = states
    assert (a >= 0).sum() > R * P
    np.testing.assert_array_equal(a, b)
    for field in ("load", "pack_cost", "rank_cost", "room"):
        np.testing.assert_array_equal(getattr(pa, field), getattr(pb, field))


def test_fractional_lengths_are_dealt_in_floats():
    L = np.array([5.5, 3.0, 2.0, 1.0])
    packing = pack_fill_module.Packing.empty(1, 2, 8)
    out = np.full(4, -1)
    packing.seed(L, np.arange(2), out)
    assert pack_fill_module._WholeCosts.of(packing, L, np.arange(2, 4)) is None
    assert (fill_packs(L, 1, 2, 8) >= 0).all()


def test_fill_packs_places_one_item_per_pack_at_least():
    L = np.full(12, 100.0)
    assert (fill_packs(L, 3, 4, 100) >= 0).all()  # G items of the cap: one per pack


def test_no_pack_is_left_empty_when_one_rank_takes_a_long_sample():
    """A rank whose first sample is long is not served again while the others catch up; its
    other packs must still get a sample (an empty pack is an empty micro-batch: the source
    would never move past it)."""
    L = np.array([1000.0, 10.0, 10.0, 10.0])
    pack = fill_packs(L, 2, 2, 1024)
    assert (pack >= 0).all()
    assert (np.bincount(pack, minlength=4) >= 1).all(), pack


def test_every_step_is_packed_to_its_cap_with_its_exact_counts():
    lengths = _lengths()
    R, M, B = 4, 2, 2
    warm = SeqLenWarmup(start=512, full=2048, warmup_steps=6)
    caps = [pack_target(t, 2048, warm) for t in range(8)]
    plan = _plan(lengths, R=R, M=M, B=B, caps=caps)
    assert plan.steps == 8
    flat_len = np.concatenate(lengths)
    tokens = np.add.reduceat(np.minimum(flat_len[plan.ids], np.repeat(caps, R * M * B)[
        np.repeat(np.arange(8 * R * M * B), np.diff(plan.offsets))]), plan.offsets[:-1])
    assert (np.diff(plan.offsets) >= 1).all()  # no empty pack
    assert (tokens.reshape(8, -1) <= np.asarray(caps)[:, None]).all()
    assert len(np.unique(plan.ids)) == len(plan.ids)  # no sample twice in the window
    # the mix: each step's counts are step_source_counts of its own sample count, with the carry
    carry = None
    for t in range(8):
        n = int(plan.counts[t].sum())
        want, carry = step_source_counts(np.array([[0.7, 0.3]]), n, carry)
        assert plan.counts[t].tolist() == want[0].tolist()
        assert np.abs(plan.counts[t] - np.array([0.7, 0.3]) * n).max() < 1
    # tokens fill the step (the bisection's budget, less what could not be placed)
    fill = tokens.reshape(8, -1).sum(axis=1) / (np.asarray(caps) * R * M * B)
    assert fill.min() > 0.85, fill


def test_ranks_are_balanced_by_attention_cost():
    lengths = _lengths(2)
    R, M, B = 8, 4, 1
    plan = _plan(lengths, R=R, M=M, B=B, caps=(4096,) * 4)
    L = np.minimum(np.concatenate(lengths)[plan.ids], 4096)
    pc = np.add.reduceat(L + L * L / 4096, plan.offsets[:-1]).reshape(4, R, M * B)
    rank = pc.sum(axis=2)
    idle = 1 - rank.mean(axis=1) / rank.max(axis=1)
    assert idle.max() < 0.05, idle


def test_windows_continue_from_the_cursor_and_split_steps_alike():
    lengths = _lengths(3)
    whole = _plan(lengths, caps=(2048,) * 6)
    first = _plan(lengths, caps=(2048,) * 3)
    # a window of 3 steps then one more from its cursor: the same steps as one window of 6
    second = _plan(lengths, caps=(2048,) * 3, cursor=first.next_cursor)
    assert np.array_equal(np.concatenate([first.ids, second.ids]), whole.ids)
    assert np.array_equal(np.concatenate([first.counts, second.counts]), whole.counts)


def test_a_finite_epoch_ends_before_a_source_runs_out():
    lengths = [np.full(300, 100.0), np.full(200, 300.0)]
    plan = _plan(lengths, caps=(1024,) * 32, limits=[300, 200])
    assert plan.epoch_end and 0 < plan.steps < 32
    assert (plan.counts.sum(axis=0) <= [300, 200]).all()
    assert len(np.unique(plan.ids)) == len(plan.ids)


def test_bad_caps_are_refused_by_name():
    with pytest.raises(OrderingConfigError, match="pack_seq_length"):
        _plan(_lengths(), caps=(0, 2048))


def test_the_plan_is_the_same_in_another_process():
    lengths = _lengths(4)
    here = _plan(lengths, caps=(1024, 2048))
    code = (
        "import numpy as np, sys; sys.path.insert(0, 'tests');"
        "from test_planned_packs_plan import _lengths, _plan;"
        "p = _plan(_lengths(4), caps=(1024, 2048));"
        "sys.stdout.write(p.ids.tobytes().hex() + ' ' + p.offsets.tobytes().hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [here.ids.tobytes().hex(), here.offsets.tobytes().hex()]


def test_a_plan_reads_back_from_its_shared_array():
    from energon_ordering.planned.packs import PackedWindowPlan

    plan = _plan(_lengths(5), caps=(1024, 2048, 2048))
    back = PackedWindowPlan.from_array(plan.to_array(), plan.cursor)
    assert back.shape == plan.shape and back.epoch_end == plan.epoch_end
    assert back.next_cursor == plan.next_cursor
    for a, b in ((back.ids, plan.ids), (back.offsets, plan.offsets),
                 (back.counts, plan.counts), (back.caps, plan.caps)):
        assert np.array_equal(a, b)


def _pinned_packed_plans() -> bytes:
    """Packed plans of fixed inputs: two mixes, a warmup, four shapes, two windows each (64
    ranks: steps of about 900 samples, where the search starts below the token bound), and a
    window of the window mix."""
    out = []
    for seed, (R, M, B) in enumerate([(4, 2, 2), (8, 4, 1), (3, 1, 3), (64, 2, 1)]):
        lengths = _lengths(seed)
        caps = [pack_target(t, 2048, SeqLenWarmup(start=512, full=2048, warmup_steps=5))
                for t in range(6)]
        first = _plan(lengths, R=R, M=M, B=B, caps=caps[:3])
        second = _plan(lengths, R=R, M=M, B=B, caps=caps[3:], cursor=first.next_cursor)
        out += [p.to_array().tobytes() for p in (first, second)]
    # the window mix at scale: a window of about 111,000 samples, whose first count leaves
    # draws out and whose count lowered by the search's resolution packs whole
    trimodal = [sample_lengths(LENGTH_PROFILES["trimodal"], 120_000, 0)]
    window = plan_packed_window(trimodal, seed=3, cursor=PlanCursor.start(1),
                                weights=np.ones((8, 1)), caps=[8192] * 8, world_size=256,
                                micro_batch=1, micro_batches_per_step=8, mix="window")
    out.append(window.to_array().tobytes())
    return b"".join(out)


PINNED_PACKED_DIGEST = "0230d555e6199c936c1ef3a8045d2144fff4cf9e3771c059a21cbbc3d1d715ab"


def test_the_packed_plan_is_pinned_to_its_version():
    import hashlib

    from energon_ordering.planned.packs import PACKED_PLAN_VERSION

    assert PACKED_PLAN_VERSION == 5, "PACKED_PLAN_VERSION was bumped: pin the new digest here"
    assert hashlib.sha256(_pinned_packed_plans()).hexdigest() == PINNED_PACKED_DIGEST, (
        "the packed plan of the same inputs changed: bump PACKED_PLAN_VERSION "
        "(planned/packs.py) and pin the new digest")


def test_a_packed_plan_reads_only_the_lengths_it_draws(tmp_path):
    """A packed window of a few steps over a 2 x 10^7-sample lengths file (float32, mapped, as
    the length index's lengths file is) allocates what its draws need, not a float64 copy of
    every source's lengths (160 MiB here; it was made at every fetch of more draws)."""
    import tracemalloc

    path = tmp_path / "lengths.npy"
    n = 10_000_000
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n,))
    mm[:] = 300.0
    mm.flush()
    del mm
    lengths = [np.load(path, mmap_mode="r"), np.load(path, mmap_mode="r")]
    tracemalloc.start()
    try:
        plan = plan_packed_window(lengths, seed=0, cursor=PlanCursor.start(2),
                                  weights=np.full((2, 2), 0.5), caps=[4096, 4096],
                                  world_size=4, micro_batch=1, micro_batches_per_step=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert plan.counts.sum() > 0
    assert peak < 8 * 2**20, peak
