"""Eight simulated data-parallel ranks (real WorkerConfig pipelines) stepped together."""

from __future__ import annotations

import pytest

from energon_ordering import OrderingConfig
from energon_ordering.inspect.diagnostics import padding_waste, straggler_idle
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, lengths_by_step, record_batch, run_ranks

pytestmark = pytest.mark.slow  # the 8-rank validation: 8 real rank pipelines per configuration

WORLD = 8
STEPS = 96


def _idle(records):
    steps = lengths_by_step(records)
    assert len(steps) == STEPS
    return straggler_idle(steps)


def _padding(records):
    return padding_waste([b.lengths for rank in records for b in rank])


@pytest.fixture(scope="module")
def measured(align_dataset):
    def run(pool, mode="batch", num_workers=1):
        cfg = OrderingConfig(length_sort_pool_size=pool, length_sort_mode=mode, seed=5)
        return run_ranks(align_dataset, ordering=cfg, world_size=WORLD, steps=STEPS,
                         num_workers=num_workers, batch_size=4)

    return {
        "off": run(0),
        "sample": run(64, "sample"),
        "batch": run(64, "batch"),
        "batch_w2": run(64, "batch", num_workers=2),
    }


def test_ranks_are_disjoint(measured):
    for name, records in measured.items():
        keys = [set(k for b in rank for k in b.keys) for rank in records]
        for a in range(WORLD):
            for b in range(a + 1, WORLD):
                assert not keys[a] & keys[b], f"{name}: ranks {a} and {b} share samples"


def test_pool_cuts_straggler_idle(measured):
    off, sample, batch = (_idle(measured[k]) for k in ("off", "sample", "batch"))
    assert off > 0.3, f"the trimodal mix should make unsorted ranks wait a lot, got {off:.3f}"
    assert sample < 0.6 * off, f"sample mode: idle {sample:.3f} vs {off:.3f} without pool"
    assert batch < 0.5 * off, f"batch mode: idle {batch:.3f} vs {off:.3f} without pool"
    assert batch <= sample + 0.02


def test_batch_mode_removes_padding(measured):
    off, sample, batch = (_padding(measured[k]) for k in ("off", "sample", "batch"))
    assert batch < 0.1 < 0.3 < min(off, sample), (off, sample, batch)


def test_two_workers_align_as_well_as_one(measured):
    one, two = _idle(measured["batch"]), _idle(measured["batch_w2"])
    assert two <= one + 0.03, f"num_workers=2 idle {two:.3f} vs num_workers=1 {one:.3f}"
    assert two < 0.5 * _idle(measured["off"])


def test_rank_dependent_seed_would_destroy_alignment(align_dataset, measured):
    # The counterfactual that motivates the rank-independent seed: give every rank its own
    # seed and the pools are permuted differently, so ranks no longer meet at equal quantiles.
    records = []
    for rank in range(WORLD):
        cfg = OrderingConfig(length_sort_pool_size=64, length_sort_mode="batch", seed=rank)
        loader = build_train_loader(align_dataset, ordering=cfg, rank=rank, world_size=WORLD,
                                    num_workers=1, batch_size=4)
        it = iter(loader)
        records.append([record_batch(next(it)) for _ in range(STEPS)])
        del it
        close_loader(loader)
    assert _idle(records) > _idle(measured["batch"]) + 0.1
