"""The planned order's figures on real pipelines equal the plan's (issue 32): 8 simulated ranks,
real ``get_train_dataset`` + ``get_savable_loader`` per rank, both mix granularities with their
default windows (plan_window_steps unset), one micro-batch and two per step. What the ranks'
micro-batches hold (keys, lengths) is what :func:`plan_window` planned, so idle per
micro-batch, idle per optimizer step and padding by tokens measured on the pipelines are the
plan's, to the last bit."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from energon_ordering import OrderingConfig
from energon_ordering.inspect.lost_compute import (idle_per_micro_batch, idle_per_step,
                                                   micro_batch_costs, padding_by_tokens)
from energon_ordering.inspect.rank_simulation import planned_window_steps, run_ranks
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.window import plan_window, window_weights
from energon_ordering.planned.window_size import default_window_steps, steps_within_an_epoch

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402
from test_planned_source import _readers  # noqa: E402

R, B, STEPS = 8, 4, 6


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two indexed sources of other lengths (web: short, code: long; 0.7 / 0.3)."""
    return indexed_synthetic(
        tmp_path_factory.mktemp("planned_figures"),
        [SourceSpec("web", 160, "short", weight=0.7), SourceSpec("code", 96, "long", weight=0.3)],
        shard_size=32)


def _figures(lengths: np.ndarray, m: int) -> tuple[float, float, float]:
    """``[steps, R, M, B]`` lengths -> (idle per micro-batch, idle per step, padding by tokens)."""
    costs = micro_batch_costs(lengths)
    return idle_per_micro_batch(costs), idle_per_step(costs), padding_by_tokens(lengths)


@pytest.mark.parametrize("mix", ["step", "window"])
@pytest.mark.parametrize("m", [1, 2])
def test_pipeline_figures_are_the_plans(data, mix, m):
    cfg = OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                         length_sort_pool_holds="keys", micro_batches_per_step=m, seed=7,
                         planned_mix=mix)
    records = run_ranks(data, ordering=cfg, world_size=R, steps=STEPS * m, batch_size=B,
                        task_encoder_factory=IndexedSyntheticTaskEncoder)
    # what the model saw: [steps, R, M, B] lengths, and the keys
    seen = np.array([[[records[r][t * m + i].lengths for i in range(m)] for r in range(R)]
                     for t in range(STEPS)], dtype=np.float64)
    seen_keys = [[records[r][b].keys for b in range(STEPS * m)] for r in range(R)]
    # the plan of the same steps, from the length index
    readers = _readers(data)
    lengths = [np.array([rd.visit(i)[2] for i in range(len(rd))]) for rd in readers]
    offsets = np.concatenate(([0], np.cumsum([len(x) for x in lengths])))
    # the default window, on this small repeating data at most one epoch of each source
    k = min(default_window_steps(mix, R * m * B),
            steps_within_an_epoch([len(x) for x in lengths], [[0.7, 0.3]], R * m * B))
    assert k < (128 if mix == "step" else 4096)
    assert k == planned_window_steps(data, cfg, world_size=R, batch_size=B,
                                     task_encoder_factory=IndexedSyntheticTaskEncoder)
    cursor, windows = PlanCursor.start(2), []
    while sum(len(w) for w in windows) < STEPS:
        plan = plan_window(lengths, seed=7, cursor=cursor,
                           weights=window_weights(np.array([0.7, 0.3]), len(windows), k),
                           window_steps=k, world_size=R, micro_batch=B,
                           micro_batches_per_step=m, mix=mix)
        windows.append(plan.ids)
        cursor = plan.next_cursor
    ids = np.concatenate(windows)[:STEPS]
    src = np.searchsorted(offsets, ids, side="right") - 1
    planned = np.array([lengths[s][g - offsets[s]] for s, g in zip(src.ravel(), ids.ravel())],
                       dtype=np.float64).reshape(ids.shape)
    local = ids - offsets[src]
    keys = [[tuple(readers[int(src[t, r, i, j])].key(int(local[t, r, i, j])) for j in range(B))
             for t in range(STEPS) for i in range(m)] for r in range(R)]
    assert seen_keys == keys
    assert np.array_equal(seen, planned)
    assert _figures(seen, m) == _figures(planned, m)
