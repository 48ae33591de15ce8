"""A plan window draws no source of repeating data beyond its size (found by review, 7 December
2026).

A window sorts its draws by length, so the copies of a sample drawn twice in one window (one
length) end up side by side, in one optimizer step. The default window of the window mix held
4,096 steps: on a dataset of 22,000 samples at 32 a step that drew every sample about 6 times,
and 39% of each step's samples were copies of another of its samples. The default window now
holds at most the steps in which no source is drawn beyond its size (read off the length
index at build, stamped); a window the user gives is kept and named in a warning when it draws
a source twice or more.

Real prepared datasets with length indexes and real loaders of 2 ranks, compared by what the
model sees: the samples (keys, packed documents) of each optimizer step over all ranks.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from energon_ordering import OrderingConfig
from energon_ordering.inspect.rank_simulation import planned_window_steps, run_ranks
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.planned.window_size import packed_samples_per_pack, steps_within_an_epoch

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402
from test_planned_source import _readers  # noqa: E402

R, B, PACK_B, CAP = 2, 3, 1, 1024
SIZES, WEIGHTS = (120, 40), (0.7, 0.3)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return indexed_synthetic(
        tmp_path_factory.mktemp("window_within_epoch"),
        [SourceSpec("web", SIZES[0], "short", weight=WEIGHTS[0]),
         SourceSpec("code", SIZES[1], "long", weight=WEIGHTS[1])],
        shard_size=20)


def _config(mix: str, pack: bool, **kw) -> OrderingConfig:
    return OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                          length_sort_pool_holds="keys", seed=3, planned_mix=mix,
                          **({"pack_seq_length": CAP} if pack else {}), **kw)


def _loader_kw(pack: bool) -> dict:
    return dict(batch_size=PACK_B if pack else B, packing_buffer_size=16 if pack else None,
                task_encoder_factory=IndexedSyntheticTaskEncoder)


def _epoch_steps(data, pack: bool) -> int:
    """The steps in which no source is drawn beyond its size, from the length index."""
    per_step = R * (PACK_B if pack else B)
    if pack:
        readers = _readers(data)
        lengths = [[r.visit(i)[2] for i in range(len(r))] for r in readers]
        per_step *= packed_samples_per_pack(lengths, [WEIGHTS], CAP)
    return steps_within_an_epoch(SIZES, [WEIGHTS], per_step)


@pytest.mark.parametrize("mix, pack", [("window", False), ("step", False), ("window", True)],
                         ids=["window-padded", "step-padded", "window-packed"])
def test_the_default_window_holds_no_sample_twice_in_a_step(data, mix, pack):
    cfg = _config(mix, pack)
    k = planned_window_steps(data, cfg, world_size=R, **_loader_kw(pack))
    assert k == _epoch_steps(data, pack) < cfg.window_steps(R, PACK_B if pack else B, pack)
    records = run_ranks(data, ordering=cfg, world_size=R, steps=k, **_loader_kw(pack))
    # the first window starts every source's epoch: none of its samples is drawn twice
    for step in range(k):
        keys = [key for rank in records for key in rank[step].keys]
        assert len(keys) == len(set(keys)), f"optimizer step {step} holds a sample twice"


def test_a_given_window_beyond_a_sources_size_is_named(data, caplog):
    cfg = _config("window", False, plan_window_steps=64)
    with caplog.at_level(logging.WARNING, logger="energon_ordering"):
        records = run_ranks(data, ordering=cfg, world_size=1, steps=1, batch_size=B,
                            task_encoder_factory=IndexedSyntheticTaskEncoder)
    assert records[0]
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "'web': 120 samples, about 134 drawn a window" in text
    assert "'code': 40 samples, about 58 drawn a window" in text
    assert f"plan_window_steps <= {steps_within_an_epoch(SIZES, [WEIGHTS], B)}" in text


def test_finite_data_keeps_the_mixs_window(data):
    """One finite epoch draws each sample once, whatever the window."""
    cfg = _config("window", False)
    k = planned_window_steps(data, cfg, world_size=R, repeat=False, **_loader_kw(False))
    assert k == cfg.window_steps(R, B)
