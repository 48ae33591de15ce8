"""ScheduledBlendDataset on real prepared multi-source datasets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from megatron.energon import WorkerConfig, get_train_dataset
from megatron.energon.wrappers.base import BaseWrapperDataset
from megatron.energon.wrappers.shuffle_buffer_dataset import ShuffleBufferDataset

from energon_ordering import OrderingConfig, OrderingConfigError, StateMismatchError
from energon_ordering.inspect.diagnostics import rank_overlap, switch_lag
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, record_batch, resume, run_with_cuts
from energon_ordering.mixture.scheduled_blend import ScheduledBlendDataset
from energon_ordering.mixture.schedule import MixtureSchedule
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder


SOURCES = ("web", "code", "curated")

# Three phases with a ramp: switches at steps 30 and 60 (micro-batches / 2 with mbps=2).
PHASED = {
    "total_steps": 100,
    "phases": [
        {"until": 0.3, "weights": {"web": 0.6, "code": 0.3, "curated": 0.1}},
        {"until": 0.6, "weights": {"web": 0.2, "code": 0.6, "curated": 0.2}},
        {"until": 1.0, "ramp_steps": 10, "weights": {"web": 0.2, "code": 0.2, "curated": 0.6}},
    ],
}


def _take(loader, n):
    it = iter(loader)
    out = [record_batch(next(it)) for _ in range(n)]
    del it
    close_loader(loader)
    return out


def _counts(records, source):
    return np.array([sum(s == source for s in r.sources) for r in records])


def _run_realized(meta, policy, steps, batch_size=4):
    sched = MixtureSchedule.from_dict({
        "total_steps": steps,
        "phases": [
            {"until": 0.25, "weights": {"web": 0.6, "code": 0.3, "curated": 0.1}},
            {"until": 0.5, "weights": {"web": 0.1, "code": 0.8, "curated": 0.1}},
            {"until": 1.0, "ramp_steps": steps // 4, "weights": {"web": 0.3, "code": 0.1, "curated": 0.6}},
        ],
    })
    cfg = OrderingConfig(mixture_schedule=sched, blend_policy=policy)
    records = _take(build_train_loader(meta, ordering=cfg, batch_size=batch_size), steps)
    target = sched.weights_table(np.arange(steps)) * batch_size  # expected samples per step
    return records, target


@pytest.fixture(scope="module")
def realized(three_sources):
    # 20,000 samples per policy: 5,000 steps of micro-batch 4, one micro-batch per step.
    return {p: _run_realized(three_sources, p, 5000) for p in ("deterministic", "random")}


WINDOW = 50  # steps = 200 samples


def _window_devs(records, target):
    devs = []
    for i, src in enumerate(SOURCES):
        c = _counts(records, src)
        for lo in range(0, len(records), WINDOW):
            devs.append((src, lo, c[lo:lo + WINDOW].sum() - target[lo:lo + WINDOW, i].sum(),
                         target[lo:lo + WINDOW, i]))
    return devs


@pytest.mark.slow  # 20,000 samples per policy through a real pipeline
def test_deterministic_policy_tracks_the_schedule_within_two_samples(realized):
    records, target = realized["deterministic"]
    assert sum(len(r.keys) for r in records) == 20_000
    worst = max(abs(d) for _, _, d, _ in _window_devs(records, target))
    # any window: |realised - target| < 2 samples (the deviation of every prefix is < 1)
    assert worst < 2.0, worst
    for i, src in enumerate(SOURCES):
        prefix = np.cumsum(_counts(records, src)) - np.cumsum(target[:, i])
        assert np.abs(prefix).max() < 1.0 + 1e-9, src


@pytest.mark.slow  # 20,000 samples per policy through a real pipeline
def test_random_policy_tracks_the_schedule_within_binomial_noise(realized):
    records, target = realized["random"]
    z = []
    for src, lo, dev, t in _window_devs(records, target):
        p = t / 4
        sigma = np.sqrt((4 * p * (1 - p)).sum())  # per-draw Bernoulli variances add up
        z.append(dev / sigma)
    z = np.array(z)
    # 300 windows x sources: bound each at 4.5 sigma (P(any exceeds) ~ 2e-3 under the
    # binomial model; the stream is seeded, so this is reproducible) and the spread at ~1.
    assert np.abs(z).max() < 4.5, np.abs(z).max()
    assert 0.7 < z.std() < 1.3, z.std()
    # the random draws differ from the deterministic ones
    assert [r.sources for r in records] != [r.sources for r in realized["deterministic"][0]]


def _cut_and_resume(meta, cfg, *, num_workers, total, cuts, horizon):
    """Runs ``total`` micro-batches, saving at ``cuts``; each resume is compared over the
    ``horizon`` micro-batches after its cut (each cut sits just before or on a switch, so the
    horizon crosses it)."""
    def make():
        return build_train_loader(meta, ordering=cfg, num_workers=num_workers, batch_size=4)

    full, states = run_with_cuts(make, total, cuts)
    for cut, state in states.items():
        resumed = resume(make, state, min(horizon, total - cut))
        for i, (a, b) in enumerate(zip(full[cut:], resumed)):
            assert a == b, f"cut {cut}: first mismatch at batch {cut + i}"
    return full


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("pool", [0, 32])
@pytest.mark.parametrize("policy", ["random", "deterministic"])
def test_exact_resume_across_phase_boundaries(three_sources, num_workers, pool, policy):
    cfg = OrderingConfig(mixture_schedule=PHASED, micro_batches_per_step=2, blend_policy=policy,
                         length_sort_pool_size=pool, length_sort_mode="batch")
    # switches at steps 30 and 60 = micro-batches 60 and 120; cuts around both
    full = _cut_and_resume(three_sources, cfg, num_workers=num_workers, total=136,
                           cuts=(0, 57, 60, 61, 119, 123), horizon=16)
    if pool == 0 and num_workers == 0:
        # no pool, no lag: the switch lands exactly at micro-batch 60 (step 30)
        web = _counts(full, "web")
        code = _counts(full, "code")
        assert web[:60].sum() > code[:60].sum() and code[60:120].sum() > 2 * web[60:120].sum()


@pytest.mark.slow  # 8 real rank pipelines
def test_eight_ranks_never_share_a_sample(three_sources):
    cfg = OrderingConfig(mixture_schedule=PHASED, length_sort_pool_size=16,
                         length_sort_mode="batch", blend_policy="random")
    keys = []
    for rank in range(8):
        loader = build_train_loader(three_sources, ordering=cfg, rank=rank, world_size=8,
                                    num_workers=1, batch_size=4)
        # 20 micro-batches = 80 samples per rank: within the first epoch of every source's
        # share (curated: 500 / 8 = 62 samples per rank, drawn at <= 0.6 of 80 = 48)
        keys.append([k for r in _take(loader, 20) for k in r.keys])
    assert rank_overlap(keys) == set()
    assert all(len(set(k)) == len(k) for k in keys)


def test_samples_carry_their_source(three_sources):
    cfg = OrderingConfig(mixture_schedule=PHASED)
    for r in _take(build_train_loader(three_sources, ordering=cfg), 30):
        for key, src in zip(r.keys, r.sources):
            assert key.startswith(src + "-")


def _chain(ds):
    out = [ds]
    while isinstance(ds, BaseWrapperDataset):
        if len(ds.datasets) != 1:
            out.append(ds)
            break
        ds = ds.dataset
        out.append(ds)
    return out


def test_blend_sits_after_per_source_shuffle_buffers(three_sources):
    te = SyntheticTaskEncoder()
    te.ordering = OrderingConfig(mixture_schedule=PHASED, length_sort_pool_size=8)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_train_dataset(three_sources, batch_size=4, worker_config=wc, task_encoder=te,
                           shuffle_buffer_size=16, max_samples_per_sequence=8)
    blend = _chain(ds)[-1]
    assert isinstance(blend, ScheduledBlendDataset)
    assert blend.source_names == SOURCES
    assert not any(isinstance(d, ShuffleBufferDataset) for d in _chain(ds)[:-1])
    for inner in blend.datasets:
        assert isinstance(inner, ShuffleBufferDataset) and inner.size == 16


def test_source_names_fall_back_to_the_dataset_folder(three_sources, tmp_path):
    root = Path(three_sources).parent
    meta = tmp_path / "meta.yaml"
    meta.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        + "".join(f"      - weight: 1\n        path: {root / s}\n" for s in SOURCES)
    )
    records = _take(build_train_loader(meta, ordering=OrderingConfig(mixture_schedule=PHASED)), 20)
    assert {s for r in records for s in r.sources} == set(SOURCES)


def test_schedule_and_metadataset_must_name_the_same_sources(three_sources):
    bad = {"sources": {"web": {"weight": 1}, "books": {"weight": 1}}}
    with pytest.raises(OrderingConfigError, match=r"no dataset for \['books'\].*not in the schedule: \['code', 'curated'\]"):
        build_train_loader(three_sources, ordering=OrderingConfig(mixture_schedule=bad))
    typo = {"sources": {"web": {"weight": 1}, "code": {"weight": 1}, "curatd": {"weight": 1}}}
    with pytest.raises(OrderingConfigError, match=r"no dataset for \['curatd'\].*unknown source "
                                                  r"'curatd' \(did you mean 'curated'\?\)"):
        build_train_loader(three_sources, ordering=OrderingConfig(mixture_schedule=typo))


def test_restore_under_another_schedule_raises_unless_allowed(three_sources):
    cfg = OrderingConfig(mixture_schedule=PHASED)
    _, states = run_with_cuts(lambda: build_train_loader(three_sources, ordering=cfg), 6, [5])
    state = states[5]
    other = {**PHASED, "phases": [PHASED["phases"][0], PHASED["phases"][2]]}
    fp_old = MixtureSchedule.from_dict(PHASED).fingerprint
    fp_new = MixtureSchedule.from_dict(other).fingerprint
    with pytest.raises(StateMismatchError,
                       match=rf"schedule_fingerprint: saved '{fp_old}' != configured '{fp_new}'.*allow_schedule_change"):
        build_train_loader(three_sources, ordering=OrderingConfig(mixture_schedule=other)).restore_state_rank(state)
    allowed = build_train_loader(
        three_sources, ordering=OrderingConfig(mixture_schedule=other, allow_schedule_change=True))
    allowed.restore_state_rank(state)
    assert len(_take(allowed, 3)) == 3


PERIOD = 37  # steps between switches: not a multiple of a pool's 16 batches, so the
SWITCHES = 14  # switches land at many offsets within the pool's emission cycle


def _alternating_schedule():
    a = {"web": 0.6, "code": 0.3, "curated": 0.1}
    b = {"web": 0.2, "code": 0.2, "curated": 0.6}
    return {"phases": [{"until": PERIOD * (k + 1), "weights": a if k % 2 == 0 else b}
                       for k in range(SWITCHES + 1)]}


def _switch_lags(meta, pool, compensate):
    sched = _alternating_schedule()
    cfg = OrderingConfig(mixture_schedule=sched, blend_policy="deterministic",
                         length_sort_pool_size=pool, length_sort_mode="batch",
                         schedule_lag_compensation=compensate)
    steps = PERIOD * (SWITCHES + 1)
    records = _take(build_train_loader(meta, ordering=cfg, batch_size=4), steps)
    shares = _counts(records, "curated") / 4
    target = MixtureSchedule.from_dict(sched).weights_table(np.arange(steps))[:, 2]
    half = PERIOD // 2
    return np.array([
        switch_lag(shares[k * PERIOD - half : k * PERIOD + half],
                   target[k * PERIOD - half : k * PERIOD + half])
        for k in range(1, SWITCHES + 1)
    ])


def test_pool_delays_switches_and_lag_compensation_centres_them(three_sources):
    assert np.abs(_switch_lags(three_sources, 0, True)).max() < 0.5
    late = _switch_lags(three_sources, 64, False)
    compensated = _switch_lags(three_sources, 64, True)
    # Pool of 64 = 16 micro-batches, filled at once: a switch reaches the batches at the next
    # fill, 0..16 batches late (mean ~8); compensation evaluates each fill at its mean
    # emission step, so a switch lands within +-8 batches and ~0 on average. (Each window
    # also cuts through pools whose permuted chunks spread a source unevenly: +-3 batches.)
    assert (late >= -3).all() and (late <= 19).all(), late
    assert 5 < late.mean() < 11, late
    assert (np.abs(compensated) <= 11).all(), compensated
    assert abs(compensated.mean()) < 2.0, compensated


def test_epochized_metadataset_is_refused_with_a_schedule(three_sources, tmp_path):
    root = Path(three_sources).parent
    meta = tmp_path / "epochized.yaml"
    meta.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
        "    blend_epochized:\n"
        + "".join(f"      - repetitions: 2\n        path: {root / s}\n" for s in SOURCES)
    )
    with pytest.raises(OrderingConfigError, match=r"entries \['web', 'code', 'curated'\] use `blend_epochized`"):
        build_train_loader(meta, ordering=OrderingConfig(mixture_schedule=PHASED))


def test_finite_sources_are_each_read_once_then_the_blend_ends(three_sources):
    cfg = OrderingConfig(mixture_schedule=PHASED, blend_policy="deterministic")
    loader = build_train_loader(three_sources, ordering=cfg, repeat=False, shuffle_buffer_size=None)
    keys = [k for batch in loader for k in record_batch(batch).keys]
    close_loader(loader)
    assert len(keys) == len(set(keys)) == 2000 + 2000 + 500  # exhausted sources drop out
    assert {k.rsplit("-", 1)[0] for k in keys} == set(SOURCES)
