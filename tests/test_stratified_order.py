"""The ``stratified`` pool order: one sample per length band per micro-batch; ranks in sync;
sources mixed per step (measured by advise's model and on real pipelines)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from energon_ordering import OrderingConfig
from energon_ordering.errors import OrderingConfigError
from energon_ordering.inspect.advise import LengthPopulation, predict_order
from energon_ordering.inspect.diagnostics import histogram_dispersion, sources_by_step
from energon_ordering.inspect.rank_simulation import run_ranks
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder
from energon_ordering.pool.order import permutation, pool_seed, stratified_order
from energon_ordering.pool.settings import PoolSettings


def test_every_micro_batch_holds_one_sample_of_each_band():
    rng = random.Random(0)
    lengths = [rng.randrange(1, 10_000) for _ in range(64)]
    order = stratified_order(lengths, seed=11, batch_size=4)
    assert sorted(order) == list(range(64))
    band = {i: r // 16 for r, i in enumerate(sorted(range(64), key=lengths.__getitem__))}
    for j in range(16):
        assert [band[i] for i in order[4 * j : 4 * j + 4]] == [0, 1, 2, 3]
    # The position inside the bands is the seeded permutation, the same in every band.
    ranked = sorted(range(64), key=lengths.__getitem__)
    perm = permutation(16, 11)
    assert [ranked.index(i) % 16 for i in order[::4]] == perm


def test_a_short_pool_emits_its_remainder_last_and_loses_nothing():
    lengths = [5, 1, 9, 3, 7, 2, 8, 4, 6, 0, 11]
    order = stratified_order(lengths, seed=1, batch_size=4)
    assert sorted(order) == list(range(11))
    assert [lengths[i] for i in order[-3:]] == sorted(lengths)[8:] == [8, 9, 11]


def test_stratified_is_rank_independent_and_deterministic():
    a = stratified_order(list(range(100, 0, -1)), pool_seed(3, 0, 0), 4)
    assert a == stratified_order(list(range(100, 0, -1)), pool_seed(3, 0, 0), 4)
    assert a != stratified_order(list(range(100, 0, -1)), pool_seed(3, 1, 0), 4)


def test_settings_need_a_batch_size_multiple():
    with pytest.raises(OrderingConfigError, match="mode = 'stratified' needs batch_size"):
        PoolSettings("X", 64, "stratified", None, 0)
    with pytest.raises(OrderingConfigError, match=r"not a multiple of batch_size = 5 \(mode='stratified'\)"):
        PoolSettings("X", 64, "stratified", 5, 0)
    with pytest.raises(ValueError, match="batch_size = None"):
        stratified_order([1, 2], 0, None)


def test_model_stratified_keeps_sync_and_mixes_sources_per_step():
    # Two sources separated by length: batch mode puts whole steps on one source.
    rng = np.random.default_rng(0)
    short, long = rng.normal(200, 40, 20_000).clip(1), rng.normal(2500, 500, 20_000).clip(1)
    lengths = np.concatenate([short, long])
    order = np.argsort(lengths, kind="stable")
    sources = np.repeat([0, 1], 20_000)[order]
    pop = LengthPopulation(lengths[order], sources, ("short", "long"), "test")
    kw = dict(pool_size=4096, batch_size=4, ranks=(8, 256), step_ranks=64, steps=400)
    pred = {m: predict_order(pop, mode=m, **kw) for m in ("batch", "sample", "stratified")}
    off = predict_order(pop, mode="off", **{**kw, "pool_size": 0})
    assert pred["batch"].dispersion_step > 20
    assert pred["stratified"].dispersion_step < 0.5
    # In sync: far below no pool, close to batch mode.
    for r in (8, 256):
        assert pred["stratified"].idle[r] < off.idle[r] / 4
        assert pred["stratified"].idle[r] < pred["batch"].idle[r] + 0.02


@pytest.mark.slow  # 8 real rank pipelines
def test_real_pipelines_in_stratified_mode_mix_sources_per_step(three_sources):
    cfg = {m: OrderingConfig(length_sort_pool_size=64, length_sort_mode=m, seed=2)
           for m in ("batch", "stratified")}
    disp = {}
    for mode, c in cfg.items():
        records = run_ranks(three_sources, ordering=c, world_size=4, steps=48, batch_size=4,
                            task_encoder_factory=SyntheticTaskEncoder)
        groups = sources_by_step([[b.sources for b in rank] for rank in records])
        disp[mode] = histogram_dispersion(groups, sorted({s for g in groups for s in g}))
    assert disp["stratified"] < disp["batch"] / 2, disp
