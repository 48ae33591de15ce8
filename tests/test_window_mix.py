"""``planned_mix="window"`` (energon_ordering/planned/window_mix.py): a window's samples banded by
length over its steps. Pure numpy: no loss or duplication over many windows (deferred samples
included), every window's mix within one sample, the schedule's zeros and the warmup's caps
held per step, deterministic, ``"step"`` unchanged, and less lost compute than ``"step"`` at one
micro-batch per step."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest

from energon_ordering.errors import OrderingConfigError
from energon_ordering.inspect.synthetic import LENGTH_PROFILES, sample_lengths
from energon_ordering.mixture.step_counts import step_source_counts
from energon_ordering.planned import window_mix
from energon_ordering.planned.balance import balance_window, sample_cost
from energon_ordering.planned.cursor import PlanCursor, draws
from energon_ordering.planned.mix import PLANNED_MIXES, check_planned_mix
from energon_ordering.planned.sample_ids import SampleIds
from energon_ordering.planned.window import (
    plan_samples,
    plan_window,
    window_draws,
    window_weights,
)

R, M, B = 4, 1, 2
G = R * M * B
K = 8


def _lengths() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(16, 4000, 700), rng.integers(100, 9000, 300), rng.integers(8, 600, 900)]


def _weights(window: int) -> np.ndarray:
    """``[K, 3]``: source 2 switches off and source 1 on inside windows 1 and 3 (zeros)."""
    t = np.arange(window * K, (window + 1) * K)
    w = np.stack([np.full(len(t), 0.5), np.where((t >= 12) & (t < 28), 0.0, 0.3),
                  np.where(t < 12, 0.2, np.where(t >= 28, 0.0, 0.5))], axis=1)
    return w / w.sum(axis=1, keepdims=True)


def _caps(window: int) -> np.ndarray | None:
    """A sequence-length warmup over the first three windows, then no cap."""
    if window >= 3:
        return None
    return np.linspace(300, 9000, 3 * K).astype(np.int64)[window * K:(window + 1) * K]


def _run(windows: int, *, seed: int = 5, caps=_caps, mix: str = "window", lengths=None):
    lengths = _lengths() if lengths is None else lengths
    cursor = PlanCursor.start(len(lengths))
    plans = []
    for w in range(windows):
        plan = plan_window(lengths, seed=seed, cursor=cursor, weights=_weights(w), window_steps=K,
                           world_size=R, micro_batch=B, micro_batches_per_step=M, mix=mix,
                           caps=caps(w))
        plans.append(plan)
        cursor = plan.next_cursor
    return plans


def _multiset(a: np.ndarray) -> np.ndarray:
    return np.sort(np.asarray(a, dtype=np.int64).reshape(-1))


def test_no_sample_lost_or_repeated_over_many_windows() -> None:
    lengths = _lengths()
    sizes = [len(x) for x in lengths]
    plans = _run(12)
    assert any(p.next_cursor.deferred for p in plans[:3])  # the warmup defers some samples
    assert not plans[-1].next_cursor.deferred  # and later windows place them
    offsets = SampleIds.of(sizes).offsets
    last = plans[-1].next_cursor
    drawn = np.concatenate([draws(5, s, n, 0, last.drawn[s]) + offsets[s]
                            for s, n in enumerate(sizes)])
    placed = np.concatenate([p.ids.reshape(-1) for p in plans])
    assert np.array_equal(_multiset(placed), _multiset(drawn))
    for p in plans:  # each window holds what its cursors say (the check of a shared plan)
        assert p.ids.shape == (K, R, M, B)
        assert np.array_equal(_multiset(p.ids), plan_samples(sizes, 5, p.cursor, p.next_cursor))


def test_every_window_within_one_sample_of_its_weights_sum() -> None:
    integral = np.zeros(3)
    counted = np.zeros(3)
    for w, p in enumerate(_run(12)):
        want = _weights(w).sum(axis=0) * G
        assert np.abs(p.counts.sum(axis=0) - want).max() < 1, w
        assert (p.counts.sum(axis=1) == G).all()
        integral += want
        counted += p.counts.sum(axis=0)
        assert np.abs(counted - integral).max() < 1, w  # cumulative: the carry


def test_schedule_zeros_and_warmup_caps_hold_per_step() -> None:
    lengths = _lengths()
    ids = SampleIds.of([len(x) for x in lengths])
    every = np.concatenate(lengths)
    for w, p in enumerate(_run(12)):
        src, _ = ids.split(p.ids.reshape(K, -1))
        weights = _weights(w)
        assert (weights[np.arange(K)[:, None], src] > 0).all(), w
        assert np.array_equal(p.counts, np.stack([np.bincount(s, minlength=3) for s in src]))
        caps = _caps(w)
        if caps is not None:
            assert (every[p.ids].reshape(K, -1).max(axis=1) <= caps).all(), w
    # the step mix places the same windows without deferring anything
    assert all(not p.next_cursor.deferred for p in _run(4, mix="step"))


def test_a_full_deferral_places_samples_over_their_cap_never_drops_them(monkeypatch) -> None:
    monkeypatch.setattr(window_mix, "MAX_DEFERRED", 3)
    lengths = _lengths()
    sizes = [len(x) for x in lengths]
    plans = _run(6)
    assert max(len(p.next_cursor.deferred) for p in plans) <= 3
    every = np.concatenate(lengths)
    over = [(every[p.ids].reshape(K, -1).max(axis=1) > _caps(w)).any() for w, p in
            enumerate(plans[:3])]
    assert any(over)  # more than 3 samples fit no step: some exceed their step's cap
    offsets = SampleIds.of(sizes).offsets
    last = plans[-1].next_cursor
    drawn = np.concatenate([draws(5, s, n, 0, last.drawn[s]) + offsets[s]
                            for s, n in enumerate(sizes)])
    placed = np.concatenate([p.ids.reshape(-1) for p in plans] + [np.array(last.deferred)])
    assert np.array_equal(_multiset(placed), _multiset(drawn))


def test_window_plans_are_deterministic_and_seeded() -> None:
    a, b, c = _run(4), _run(4), _run(4, seed=6)
    for x, y in zip(a, b):
        assert np.array_equal(x.ids, y.ids) and x.next_cursor == y.next_cursor
    assert not all(np.array_equal(x.ids, z.ids) for x, z in zip(a, c))


def test_a_window_without_caps_is_one_band_per_step_in_shuffled_order() -> None:
    lengths = [sample_lengths(LENGTH_PROFILES["trimodal"], 20_000, 0)]
    w = window_weights([1.0], 0, 16)
    plan = plan_window(lengths, seed=1, cursor=PlanCursor.start(1), weights=w, window_steps=16,
                       world_size=8, micro_batch=4, micro_batches_per_step=1, mix="window")
    L = lengths[0][plan.ids].reshape(16, -1)
    lo, hi = L.min(axis=1), L.max(axis=1)
    order = np.argsort(lo, kind="stable")
    assert (hi[order][:-1] <= lo[order][1:]).all()  # the steps' length ranges do not overlap
    assert not np.array_equal(order, np.arange(16))  # and are not laid out shortest first
    drawn = window_draws([len(lengths[0])], 1, PlanCursor.start(1), plan.counts)
    assert np.array_equal(_multiset(plan.ids), _multiset(drawn))


#: sha256 of :func:`_step_digest`'s windows (their samples, counts and cursors), computed with
#: the code before ``mix`` existed (commit 8c283ef). The arrangement of a window's samples is
#: balance_window's (pinned by tests/test_planned_order.py with PLAN_VERSION; compared below).
STEP_DIGEST = "1d36d7f959b3cfbf373a23b45ca422d9ad0047380f44bafc60f88a9d776f6776"


def _step_digest(**mix) -> str:
    rng = np.random.default_rng(7)
    lengths = [rng.integers(16, 4000, 500), rng.integers(100, 9000, 300),
               rng.integers(8, 600, 900)]
    h = hashlib.sha256()
    for r, m, b in ((4, 1, 2), (2, 3, 4)):
        cursor = PlanCursor.start(3)
        for _ in range(3):
            t = np.linspace(0, 1, 6)[:, None]
            w = np.hstack([0.5 - 0.3 * t, 0.2 + 0.3 * t, np.where(t < 0.5, 0.3, 0.0)])
            w /= w.sum(axis=1, keepdims=True)
            plan = plan_window(lengths, seed=11, cursor=cursor, weights=w, window_steps=6,
                               world_size=r, micro_batch=b, micro_batches_per_step=m, **mix)
            h.update(np.sort(plan.ids, axis=None).tobytes())  # the arrangement: balance.py's
            h.update(plan.counts.tobytes())
            c = plan.next_cursor
            h.update(repr((c.window, c.drawn, c.carry)).encode())
            cursor = c
    return h.hexdigest()


def test_step_mix_is_todays_plan() -> None:
    assert _step_digest(mix="step") == _step_digest() == STEP_DIGEST
    # and it is the composition of the step counts, the draws and balance_window
    lengths = _lengths()
    w = _weights(1)
    plan = plan_window(lengths, seed=2, cursor=PlanCursor.start(3), weights=w, window_steps=K,
                       world_size=R, micro_batch=B, micro_batches_per_step=2, mix="step",
                       caps=np.full(K, 100))
    counts, _ = step_source_counts(w, R * 2 * B, None)
    gid = window_draws([len(x) for x in lengths], 2, PlanCursor.start(3), counts)
    L = np.concatenate(lengths)[gid]
    src = np.repeat(np.arange(3), counts.sum(axis=0))
    pos = balance_window(sample_cost(L), src, counts, world_size=R, micro_batch=B,
                         micro_batches_per_step=2, lengths=L)
    assert np.array_equal(plan.ids, gid[pos.transpose(0, 2, 1, 3)])


@pytest.mark.parametrize("bad", ["pool", "Window", None, 1])
def test_a_bad_mix_names_planned_mix_and_the_allowed_values(bad) -> None:
    with pytest.raises(OrderingConfigError, match=r"planned_mix = .*'step', 'window'"):
        check_planned_mix(bad)
    with pytest.raises(OrderingConfigError, match=r"planned_mix = "):
        plan_window(_lengths(), seed=0, cursor=PlanCursor.start(3), weights=_weights(0),
                    window_steps=K, world_size=R, micro_batch=B, micro_batches_per_step=M,
                    mix=bad)
    assert PLANNED_MIXES == ("step", "window")


@pytest.mark.parametrize("caps", [np.full(K - 1, 100), np.full(K, 0), np.full(K, 1.5)])
def test_bad_caps_are_refused(caps) -> None:
    with pytest.raises(OrderingConfigError, match=r"caps = .*one int >= 1 per step"):
        plan_window(_lengths(), seed=0, cursor=PlanCursor.start(3), weights=_weights(0),
                    window_steps=K, world_size=R, micro_batch=B, micro_batches_per_step=M,
                    mix="window", caps=caps)


def _heavy_tailed(n: int, seed: int) -> np.ndarray:
    """tools/bench_planned.py's: 10% of samples around 6,000 tokens, the rest around 500."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.1
    return np.where(long, rng.lognormal(np.log(6000), 0.3, n),
                    rng.lognormal(np.log(500), 0.6, n)).clip(16, 32768).astype(np.int64)


def _lost(lens: np.ndarray) -> tuple[float, float]:
    """(straggler idle per optimizer step, padding by tokens) of ``[steps, R, M, B]`` lengths
    (DESIGN.md's definitions; cost L + L^2/4096)."""
    rank = sample_cost(lens).sum(axis=(2, 3))
    idle = float(np.mean(1 - rank.mean(axis=1) / rank.max(axis=1)))
    full = lens.shape[3] * lens.max(axis=3)
    return idle, float((full - lens.sum(axis=3)).sum() / full.sum())


@pytest.mark.parametrize("name", ["trimodal", "heavy"])
def test_window_mix_loses_less_compute_than_step_mix_at_one_micro_batch(name: str) -> None:
    """8 ranks, M = 1, B = 4, K = 64 (2,048 samples per window), 8 windows."""
    if name == "trimodal":
        lengths, weights = [sample_lengths(LENGTH_PROFILES["trimodal"], 100_000, 0)], [1.0]
    else:
        lengths = [_heavy_tailed(100_000, 1), (3 * _heavy_tailed(100_000, 2)).clip(16, 32768)]
        weights = [0.7, 0.3]
    every = np.concatenate(lengths).astype(np.float64)
    got = {}
    for mix in ("step", "window"):
        cursor, lens = PlanCursor.start(len(lengths)), []
        for w in range(8):
            plan = plan_window(lengths, seed=0, cursor=cursor,
                               weights=window_weights(weights, w, 64), window_steps=64,
                               world_size=8, micro_batch=4, micro_batches_per_step=1, mix=mix)
            lens.append(every[plan.ids])
            cursor = plan.next_cursor
        got[mix] = _lost(np.concatenate(lens))
    step, window = sum(got["step"]), sum(got["window"])
    assert window < step, got
    assert got["window"][1] <= 0.02, got



def test_random_schedules_and_caps_keep_every_invariant() -> None:
    """Random weights with zeros (1-4 sources), random warmup caps, random shapes: the schedule's
    zeros per step, every window within one sample, no sample lost or repeated."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        S, K_ = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        r, m, b = (int(x) for x in rng.integers(1, 4, 3))
        lengths = [rng.integers(1, 3000, int(rng.integers(1, 200))) for _ in range(S)]
        sizes = [len(x) for x in lengths]
        cursor, placed = PlanCursor.start(S), []
        for _ in range(6):
            w = rng.dirichlet(np.full(S, 0.3), K_) * (rng.random((K_, S)) > 0.3)
            w[w.sum(axis=1) == 0, 0] = 1
            w /= w.sum(axis=1, keepdims=True)
            caps = np.sort(rng.integers(200, 3000, K_)) if rng.random() < 0.5 else None
            p = plan_window(lengths, seed=trial, cursor=cursor, weights=w, window_steps=K_,
                            world_size=r, micro_batch=b, micro_batches_per_step=m, mix="window",
                            caps=caps)
            src, _ = SampleIds.of(sizes).split(p.ids.reshape(K_, -1))
            assert (w[np.arange(K_)[:, None], src] > 0).all(), trial
            assert np.abs(p.counts.sum(axis=0) - w.sum(axis=0) * r * m * b).max() < 1, trial
            assert np.array_equal(_multiset(p.ids), plan_samples(sizes, trial, cursor,
                                                                 p.next_cursor))
            placed.append(p.ids.reshape(-1))
            cursor = p.next_cursor
        offsets = SampleIds.of(sizes).offsets
        drawn = np.concatenate([draws(trial, s, n, 0, cursor.drawn[s]) + offsets[s]
                                for s, n in enumerate(sizes)])
        held = np.array(cursor.deferred, dtype=np.int64)
        assert np.array_equal(_multiset(np.concatenate(placed + [held])), _multiset(drawn))

# ---- packed ------------------------------------------------------------------------------------


def _packed_run(lengths, weights_of, caps, windows: int, mix: str, *, R=4, M=1, B=2):
    from energon_ordering.planned.packs import plan_packed_window

    cursor, plans = PlanCursor.start(len(lengths)), []
    for w in range(windows):
        plan = plan_packed_window(lengths, seed=4, cursor=cursor, weights=weights_of(w),
                                  caps=caps, world_size=R, micro_batch=B,
                                  micro_batches_per_step=M, mix=mix)
        plans.append(plan)
        cursor = plan.next_cursor
    return plans


def _packed_tokens(plan, every: np.ndarray) -> np.ndarray:
    """``[steps, R M B]`` tokens of every pack (samples cut to the step's cap)."""
    R, M, B = plan.shape
    cut = np.minimum(every[plan.ids], np.repeat(plan.caps, np.diff(plan.offsets)
                                                .reshape(plan.steps, -1).sum(axis=1)))
    return np.add.reduceat(cut, plan.offsets[:-1]).reshape(plan.steps, R * M * B) \
        if len(cut) else np.zeros((plan.steps, R * M * B))


def test_packed_window_mix_loses_nothing_and_holds_each_window_within_one_sample() -> None:
    lengths = _lengths()
    sizes = [len(x) for x in lengths]
    every = np.concatenate(lengths)
    const = np.array([0.5, 0.2, 0.3])
    plans = _packed_run(lengths, lambda w: np.tile(const, (K, 1)), [4096] * K, 6, "window")
    for p in plans:
        got = _multiset(p.ids)
        drawn = np.array(p.next_cursor.drawn) - np.array(p.cursor.drawn)
        assert np.array_equal(got, _multiset(window_draws(sizes, 4, p.cursor, drawn)))
        n = int(p.counts.sum())
        assert np.abs(p.counts.sum(axis=0) - const * n).max() < 1
        tokens = _packed_tokens(p, every)
        assert (tokens <= 4096).all() and (np.diff(p.offsets) > 0).all()
    step = _packed_run(lengths, lambda w: np.tile(const, (K, 1)), [4096] * K, 1, "step")[0]
    assert not np.array_equal(plans[0].ids, step.ids)  # planned as a window, not step by step
    # ... and the carry keeps the cumulative counts within one sample of the integral
    total = sum(int(p.counts.sum()) for p in plans)
    counted = sum(p.counts.sum(axis=0) for p in plans)
    assert np.abs(counted - const * total).max() < 1


@pytest.mark.parametrize("caps", [[512, 1024, 2048, 4096, 4096, 4096, 4096, 4096], [3000] * K])
def test_packed_window_mix_holds_schedule_zeros_and_warmup_caps_per_step(caps) -> None:
    lengths = _lengths()
    every = np.concatenate(lengths)
    ids = SampleIds.of([len(x) for x in lengths])
    plans = _packed_run(lengths, _weights, caps, 4, "window")
    for w, p in enumerate(plans):
        assert (_packed_tokens(p, every) <= np.asarray(caps)[:, None]).all()
        for t in range(p.steps):
            src, _ = ids.split(p.ids[p.offsets[t * 8]:p.offsets[(t + 1) * 8]])
            assert (_weights(w)[t, src] > 0).all(), (w, t)


def test_packed_window_mix_loses_less_compute_than_step_mix() -> None:
    """8 ranks, M = 1, B = 4 packs of 8,192 tokens, K = 32, the heavy-tailed two-source mix."""
    lengths = [_heavy_tailed(50_000, 1), (3 * _heavy_tailed(50_000, 2)).clip(16, 32768)]
    every = np.concatenate(lengths).astype(np.float64)
    got = {}
    for mix in ("step", "window"):
        idle, used, room = [], 0.0, 0.0
        for p in _packed_run(lengths, lambda w: window_weights([0.7, 0.3], w, 32), [8192] * 32,
                             2, mix, R=8, M=1, B=4):
            for t in range(p.steps):
                rank = []
                for r in range(8):
                    sample, _ = p.rank_step(t, r)
                    cut = np.minimum(every[sample], 8192)
                    rank.append(sample_cost(cut).sum())
                    used += cut.sum()
                idle.append(1 - np.mean(rank) / np.max(rank))
                room += 32 * 8192
        got[mix] = (float(np.mean(idle)), 1 - used / room)
    assert sum(got["window"]) < sum(got["step"]), got
    assert got["window"][1] <= 0.02, got


def test_packed_step_mix_is_the_default() -> None:
    from energon_ordering.planned.packs import plan_packed_window

    kw = dict(seed=1, cursor=PlanCursor.start(3), weights=_weights(0), caps=[2048] * K,
              world_size=R, micro_batch=B, micro_batches_per_step=M)
    a = plan_packed_window(_lengths(), **kw)
    b = plan_packed_window(_lengths(), mix="step", **kw)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.offsets, b.offsets)
    with pytest.raises(OrderingConfigError, match=r"planned_mix = 'steps'"):
        plan_packed_window(_lengths(), mix="steps", **kw)


def test_one_window_peaks_under_60_bytes_per_sample() -> None:
    """Memory (issue 32: <= 64 MiB per loader worker, 1,024 ranks, M = 8, K = 32 is 2^20
    samples): one window of 2^18 samples, trimodal (the mix that peaked highest), allocates at
    most 60 bytes per sample at its peak (tracemalloc sees numpy's buffers; measured 54, and 50
    at 2^20 samples). The gather that copied every source's candidates beside a window of ages
    peaked at 68."""
    lengths = [sample_lengths(LENGTH_PROFILES["trimodal"], 400_000, 0)]
    k, r, m, b = 32, 256, 8, 4
    tracemalloc.start()
    try:
        plan_window(lengths, seed=0, cursor=PlanCursor.start(1),
                    weights=window_weights([1.0], 0, k), window_steps=k, world_size=r,
                    micro_batch=b, micro_batches_per_step=m, mix="window")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak / (k * r * m * b) <= 60, peak / (k * r * m * b)


#: sha256 of :func:`_window_digest`'s plans (every id in place, counts and cursors), computed
#: with WINDOW_MIX_PLAN_VERSION 3 (deal_bands without re-sorting, bands tied in draw order).
WINDOW_DIGEST = "214d09ff76062788a6bc6ddca5ccaf19218fe6b3e84b77e8188e622ba9570ab3"


def _window_digest() -> str:
    rng = np.random.default_rng(9)
    lengths = [rng.integers(16, 4000, 3000), rng.integers(100, 30000, 2000),
               np.round(rng.lognormal(5, 1, 4000), 1) + 1]  # whole and fractional lengths
    h = hashlib.sha256()
    for r, m, b, k, capped in ((4, 1, 2, 64, True), (8, 2, 4, 8, False), (16, 8, 1, 4, True),
                               (6, 1, 4, 16, False)):
        cursor = PlanCursor.start(3)
        for window in range(2):
            t = np.linspace(0, 1, k)[:, None]
            w = np.hstack([0.5 - 0.3 * t, 0.2 + 0.3 * t, np.where(t < 0.5, 0.3, 0.0)])
            w /= w.sum(axis=1, keepdims=True)
            caps = (np.linspace(128, 8192, k).astype(np.int64) if capped and window == 0
                    else None)
            plan = plan_window(lengths, seed=11, cursor=cursor, weights=w, window_steps=k,
                               world_size=r, micro_batch=b, micro_batches_per_step=m,
                               mix="window", caps=caps)
            h.update(np.ascontiguousarray(plan.ids).tobytes())
            h.update(plan.counts.tobytes())
            cursor = plan.next_cursor
            h.update(repr(cursor).encode())
    return h.hexdigest()


def test_window_mix_plans_are_pinned_to_their_version() -> None:
    """Any change to the window mix's plans (which sample goes to which step, rank and
    micro-batch) must bump WINDOW_MIX_PLAN_VERSION: a state saved before it names other samples,
    and the stamp refuses it only if the version moved."""
    from energon_ordering.planned.window import WINDOW_MIX_PLAN_VERSION

    assert (WINDOW_MIX_PLAN_VERSION, _window_digest()) == (3, WINDOW_DIGEST)


def _deal_steps_every_way(L: np.ndarray, K: int, tokens: float, R: int, B: int, M: int
                          ) -> np.ndarray:
    """:func:`window_mix._deal_steps` by its definition: every dealing scored (whole, then cut
    into h = 1, 2, 4, ... parts; none skipped), the lowest score kept, ties to the earlier."""
    out = np.empty((L.shape[0], R, M, B), dtype=np.int64)
    cost = sample_cost(L)
    for s in range(L.shape[0]):
        block = cost[s].reshape(-1, B).sum(axis=1)
        dealt, rank = window_mix.deal_sorted(block[None], R, M)
        pad = B * L[s, B - 1::B].sum() - L[s].sum()
        idle = float(window_mix._idle(rank)[0])
        best = (dealt[0] * B)[..., None] + np.arange(B)
        score = idle / K + window_mix.PADDING_WEIGHT * pad / tokens
        if idle > window_mix.LEVEL_ENOUGH:
            for h in window_mix._parts(R):
                r = R // h
                col, tot = window_mix.deal_sorted(cost[s].reshape(-1, r * B), r, B)
                tot = tot.reshape(M, h, r)
                tot[1::2] = tot[1::2, ::-1]
                # each part's r B samples ascend: its r longest set its r micro-batches' widths
                part_pad = B * L[s].reshape(M * h, r * B)[:, -r:].sum() - L[s].sum()
                got = float(window_mix._idle(tot.sum(axis=0).reshape(1, R))[0]) / K + (
                    window_mix.PADDING_WEIGHT * part_pad / tokens)
                if got < score:
                    pos = (col.reshape(M, h, r, B)
                           + (np.arange(M * h) * (r * B)).reshape(M, h, 1, 1))
                    pos[1::2] = pos[1::2, ::-1]
                    best, score = pos.reshape(M, R, B).transpose(1, 0, 2), got
        out[s] = best
    return out


@pytest.mark.parametrize("R,B,M", [(8, 4, 2), (64, 4, 8), (32, 2, 1), (6, 3, 4)])
def test_cut_dealings_tried_most_promising_first_keep_the_best_of_every_way(R, B, M) -> None:
    """Trying each step's cut dealings lowest bound first, and skipping those whose bound is
    over the best score, keeps the dealing of the lowest score, ties to the earlier: the same
    positions as scoring every way, on heavy tails (cut dealings win), narrow bands (whole
    wins) and mixes of both."""
    rng = np.random.default_rng(R * 100 + M)
    G = R * M * B
    rows = [np.sort(rng.lognormal(np.log(600), 1.2, G).clip(16, 32768).round()),  # heavy tail
            np.sort(rng.integers(900, 1000, G)).astype(np.float64),  # one narrow band
            np.sort(np.where(rng.random(G) < 0.05, 20000, rng.integers(100, 200, G))
                    ).astype(np.float64),
            np.sort(rng.integers(16, 8192, G)).astype(np.float64)]
    L = np.stack(rows * 3)
    K = 4
    tokens = float(L.sum())
    got = window_mix._deal_steps(L, K, tokens, R, B, M)
    assert np.array_equal(got, _deal_steps_every_way(L, K, tokens, R, B, M))
