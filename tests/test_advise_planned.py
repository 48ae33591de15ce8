"""``advise`` predicts the planned order beside the pools (issue 23): computed from the same
lengths, recommended only when every dataset has a length index, one line otherwise."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from energon_ordering.cli import main
from energon_ordering.cli.tables import advice_tables
from energon_ordering.inspect.advise import (
    Advice,
    CostPerSample,
    LengthPopulation,
    planned_note,
    planned_requirements,
    planned_run,
    predict_order,
    predict_planned,
    recommend,
)
from energon_ordering.inspect.synthetic import SourceSpec

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

B, M, R = 4, 8, 64


def _heavy(n: int, seed: int) -> np.ndarray:
    """10% of samples around 6,000 tokens, the rest around 500 (tools/bench_planned.py's mix)."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.1
    return np.where(long, rng.lognormal(np.log(6000), 0.3, n),
                    rng.lognormal(np.log(500), 0.6, n)).clip(16, 32768).astype(np.int64)


@pytest.fixture(scope="module")
def heavy_pop() -> LengthPopulation:
    """Two sources, weights 0.5 / 0.5, the second 3x longer: sorted, as advise holds lengths."""
    ls = np.concatenate([_heavy(50_000, 1), 3 * _heavy(50_000, 2)]).astype(np.float64)
    src = np.repeat([0, 1], 50_000)
    order = np.argsort(ls, kind="stable")
    return LengthPopulation(ls[order], src[order], ("short", "long"), "length index")


@pytest.fixture(scope="module")
def predictions(heavy_pop):
    common = dict(batch_size=B, ranks=(8, R), step_ranks=R, micro_batches_per_step=M, steps=256)
    pools = [predict_order(heavy_pop, mode="off", pool_size=0, **common)]
    pools += [predict_order(heavy_pop, mode="batch", pool_size=n, **common)
              for n in (1_000, 10_000)]
    return pools, predict_planned(heavy_pop, **common)


def test_planned_row_idles_less_than_the_batch_pool_at_64_ranks(predictions):
    pools, planned = predictions
    batch = {p.pool_size: p for p in pools if p.mode == "batch"}
    assert planned.has_index and planned.name == "planned (K=32)"
    assert planned.idle[R] < batch[10_000].idle[R] / 2, (planned.idle, batch[10_000].idle)
    assert planned.idle[R] < 0.01 and planned.padding < 0.02
    # the plan is exact per step: every source within one sample of weight x G, at every R
    assert all(w < 1.0 for w in planned.worst_step_samples.values())
    assert max(w for _, w in planned.step_share_pp.values()) < 0.1  # percentage points
    assert planned.plan_seconds[R] > 0 and planned.steps[R] % planned.window_steps == 0


def test_planned_run_is_the_plan_with_exact_steps():
    lengths = [np.arange(1, 501), 10 * np.arange(1, 301)]
    run = planned_run(lengths, [0.7, 0.3], world_size=4, micro_batch=2, micro_batches_per_step=2,
                      steps=4, window_steps=2)
    assert run.lengths.shape == (4, 4, 2, 2) and run.sources.shape == (4, 4, 2, 2)
    per_step = run.sources.reshape(4, -1)
    np.testing.assert_allclose((per_step == 1).sum(axis=1), 0.3 * 16, atol=1)
    assert run.worst_step_samples < 1


def _costs() -> list[CostPerSample]:
    return [CostPerSample("pre-encode", "keys", 0.1, 1e-5, 40.0, (100, 400), 800, 0.1)]


def test_recommend_picks_planned_only_with_a_length_index(predictions):
    pools, planned = predictions
    kw = dict(ranks=R, memory_budget=2**30, share=10_000)
    rec, reason = recommend(pools, _costs(), planned=planned, **kw)
    assert rec == ("pre-encode", "keys", "planned", 0), reason
    assert "for the best pool setting, batch 10,000 pre-encode/keys" in reason
    assert "within 0." in reason and "no pool memory" in reason
    without = dataclasses.replace(planned, has_index=False)
    rec, _ = recommend(pools, _costs(), planned=without, **kw)
    assert rec == ("pre-encode", "keys", "batch", 10_000)
    assert recommend(pools, _costs(), **kw)[0] == rec  # as before without a planned row
    # no pool fits the share: planned, with an index; nothing without one
    assert recommend(pools, _costs(), planned=planned, ranks=R, memory_budget=2**30,
                     share=10)[0][2] == "planned"
    assert recommend(pools, _costs(), planned=without, ranks=R, memory_budget=2**30,
                     share=10)[0] is None


def test_a_planned_order_no_better_than_the_pool_is_not_recommended(predictions):
    pools, planned = predictions
    worse = dataclasses.replace(planned, idle={r: 0.5 for r in planned.idle})
    rec, _ = recommend(pools, _costs(), planned=worse, ranks=R, memory_budget=2**30,
                       share=10_000)
    assert rec[2] == "batch"


def _advice(heavy_pop, pools, planned, recommended) -> Advice:
    return Advice(heavy_pop, R, B, pools, _costs(), 2**30, recommended, "test", (8, R), 1,
                  1_000_000, 10_000, planned=planned, micro_batches_per_step=M)


def test_without_an_index_one_line_says_so(heavy_pop, predictions):
    pools, planned = predictions
    estimated = dataclasses.replace(heavy_pop, origin="estimate (4000 samples, X)")
    without = dataclasses.replace(planned, has_index=False)
    adv = _advice(estimated, pools, without, ("pre-encode", "keys", "batch", 10_000))
    line = planned_note(adv)
    assert line is not None and "\n" not in line
    assert line.startswith("planned order: not recommended, it needs a length index for every "
                           "dataset (the lengths here: estimate (4000 samples, X))")
    assert "energon-ordering index DATASET" in line
    assert re.search(r"planned \(K=32\) .* needs a length index", advice_tables(adv))
    assert planned_note(_advice(heavy_pop, pools, planned, None)) is None


def test_the_tables_show_the_planned_row_its_mix_and_its_cost(heavy_pop, predictions):
    pools, planned = predictions
    text = advice_tables(_advice(heavy_pop, pools, planned, ("pre-encode", "keys", "planned", 0)))
    row = next(line for line in text.splitlines() if line.startswith("planned (K=32)"))
    assert row.rstrip().endswith("yes (index)") and f"{100 * planned.idle[R]:.1f}%" in row
    assert "worst step at 64 ranks: a source's count" in text and "pool off:" in text
    assert "planned (K=32): no pool (no pool memory" in text and "ms per step" in text
    for word in ("length_sort_placement: pre-encode", "length_sort_pool_holds: keys",
                 "with packing also pack_seq_length"):
        assert word in planned_requirements()


@pytest.mark.slow  # advise end to end: lengths from the index, costs on real loaders
def test_advise_cli_recommends_planned_with_its_settings(tmp_path):
    meta = indexed_synthetic(
        tmp_path, [SourceSpec("web", 1600, "short"), SourceSpec("code", 1600, "trimodal")],
        shard_size=64)
    res = CliRunner().invoke(main, [
        "advise", str(meta), "--ranks", "64", "--micro-batch", "4", "--micro-batches-per-step",
        "8", "--steps", "256", "--out", str(tmp_path),
        "--task-encoder", "energon_ordering.inspect.synthetic_task:IndexedSyntheticTaskEncoder"])
    assert res.exit_code == 0, res.output
    assert re.search(r"planned \(K=32\) .* yes \(index\)", res.output)
    assert ("recommended: length_sort_mode: planned, length_sort_placement: pre-encode, "
            "length_sort_pool_holds: keys") in res.output
    assert planned_requirements() in res.output
    assert "planned order: not recommended" not in res.output
