"""``advise`` predicts the planned order beside the pools (issue 23) at both mix granularities
(issue 32: ``planned_mix`` step and window): computed from the same lengths, ranked with the
pools by lost compute (idle per optimizer step + padding by tokens), recommended only when
every dataset has a length index, one line otherwise."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np

from energon_ordering.planned.window_size import default_window_steps, steps_within_an_epoch
import pytest
from click.testing import CliRunner

from energon_ordering.cli import main
from energon_ordering.cli.tables import advice_tables
from energon_ordering.inspect.advise import (
    Advice,
    CostPerSample,
    LengthPopulation,
    OrderPrediction,
    best_planned,
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


@pytest.fixture(scope="module")
def window(heavy_pop):
    """The planned order of the same lengths with planned_mix: window."""
    return predict_planned(heavy_pop, batch_size=B, ranks=(8, R), step_ranks=R,
                           micro_batches_per_step=M, steps=256, mix="window")


def test_planned_row_idles_less_than_the_batch_pool_at_64_ranks(predictions):
    pools, planned = predictions
    batch = {p.pool_size: p for p in pools if p.mode == "batch"}
    k = default_window_steps("step", R * M * B)  # 2^19 samples would be 256 steps: at most 128
    assert planned.has_index and planned.name == f"planned (K={k}, step)" and k == 128
    assert planned.idle[R] < batch[10_000].idle[R] / 2, (planned.idle, batch[10_000].idle)
    assert planned.idle[R] < 0.01 and planned.padding < 0.02
    # the plan is exact per step: every source within one sample of weight x G, at every R
    assert all(w < 1.0 for w in planned.worst_step_samples.values())
    assert max(w for _, w in planned.step_share_pp.values()) < 0.1  # percentage points
    assert planned.plan_seconds[R] > 0 and planned.steps[R] % planned.window_steps == 0


def test_predictions_give_idle_per_step_and_padding_by_tokens(heavy_pop, predictions, window):
    """Idle per optimizer step sums each rank's 8 micro-batches (another figure than per
    micro-batch: heavy micro-batches weigh more, their imbalances partly cancel); padding by
    tokens weighs the long micro-batches (higher than the mean of ratios on this heavy tail);
    lost compute is their sum, for the pools and both planned mixes."""
    pools, planned = predictions
    for p in [*pools, planned, window]:
        assert set(p.idle_step) == set(p.idle) == {8, R}
        assert p.idle_step[R] != pytest.approx(p.idle[R], rel=1e-3), p.name
        assert p.lost(R) == pytest.approx(p.idle_step[R] + p.padding_tokens)
    off = pools[0]
    assert off.padding_tokens > off.padding
    # one micro-batch per step: the two idles are one figure
    one = predict_order(heavy_pop, mode="batch", pool_size=1_000, batch_size=B, ranks=(8,),
                        step_ranks=8, steps=64)
    assert one.idle_step[8] == pytest.approx(one.idle[8], rel=1e-12)


def test_step_idle_of_known_lengths():
    from energon_ordering.inspect.advise import step_straggler_idle

    # 2 ranks, 2 micro-batches of one sample: per micro-batch each step is unbalanced, the
    # sums per step are equal
    lengths = np.array([[[4096.0], [0.0]], [[0.0], [4096.0]]])
    assert step_straggler_idle(lengths, 2) == 0.0
    assert step_straggler_idle(lengths, 1) == pytest.approx(0.5)


def test_window_mix_is_predicted_and_holds_the_window(window, predictions):
    _, step = predictions
    # the window mix's default window holds about 2^22 samples of this global batch
    k = default_window_steps("window", R * M * B)
    assert window.mix == "window" and window.name == f"planned (K={k}, window)"
    assert window.window_steps == k and k * R * M * B <= 1 << 22
    assert all(w < 1.0 for w in window.worst_window_samples.values())
    assert window.worst_mix_samples is window.worst_window_samples
    assert step.worst_mix_samples is step.worst_step_samples
    with pytest.raises(Exception, match="mix = 'bands' is unknown"):
        planned_run([np.arange(1, 9)], [1.0], world_size=2, micro_batch=2,
                    micro_batches_per_step=1, steps=1, window_steps=1, mix="bands")


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


def _pool(size: int, idle: float, padding: float, idle_step: float,
          padding_tokens: float) -> OrderPrediction:
    nan = float("nan")
    return OrderPrediction("batch", size, {8: idle}, padding, nan, nan, {}, {8: idle_step},
                           padding_tokens)


def test_recommend_ranks_by_idle_per_step_plus_padding_by_tokens():
    """A pool that looks better per micro-batch and by the mean padding ratio loses more per
    optimizer step and by tokens: the other is recommended, and the reason gives both parts."""
    looks_good = _pool(100, idle=0.01, padding=0.01, idle_step=0.05, padding_tokens=0.05)
    pays_less = _pool(200, idle=0.04, padding=0.04, idle_step=0.01, padding_tokens=0.02)
    rec, reason = recommend([looks_good, pays_less], _costs(), ranks=8, memory_budget=2**30,
                            share=1_000)
    assert rec == ("pre-encode", "keys", "batch", 200), reason
    assert reason.startswith("loses 3.0% of compute at 8 ranks (idle per optimizer step 1.0% + "
                             "padding by tokens 2.0%)")
    # --no-measure recommends too, from the same figures
    rec, reason = recommend([looks_good, pays_less], [], ranks=8, memory_budget=2**30,
                            share=1_000)
    assert rec == ("post-encode", "raw", "batch", 200) and "--no-measure" in reason


def test_recommend_picks_the_mix_that_loses_less(predictions, window):
    pools, step = predictions
    kw = dict(ranks=R, memory_budget=2**30, share=10_000)
    best = best_planned([step, window], R)
    other = window if best is step else step
    rec, reason = recommend(pools, _costs(), planned=[step, window], **kw)
    assert rec == ("pre-encode", "keys", "planned", 0), reason
    assert reason.startswith(f"planned_mix: {best.mix} loses {100 * best.lost(R):.1f}% of compute")
    assert f"planned_mix: {other.mix} {100 * other.lost(R):.1f}%" in reason
    # a mix without its index is not compared
    no_index = dataclasses.replace(best, has_index=False)
    _, reason = recommend(pools, _costs(), planned=[no_index, other], **kw)
    assert reason.startswith(f"planned_mix: {other.mix} ")
    # --no-measure: the planned order is recommended from idle and padding alone
    rec, reason = recommend(pools, [], planned=[step, window], **kw)
    assert rec[2] == "planned" and reason.endswith("(--no-measure: from idle and padding alone)")


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
    # worse per optimizer step (what it is ranked by), though better per micro-batch
    worse = dataclasses.replace(planned, idle_step={r: 0.5 for r in planned.idle},
                                idle={r: 0.0 for r in planned.idle})
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
    assert re.search(rf"planned \(K={planned.window_steps}, step\) .* needs a length index",
                     advice_tables(adv))
    assert planned_note(_advice(heavy_pop, pools, planned, None)) is None


def test_the_tables_show_the_planned_rows_their_mix_and_their_cost(heavy_pop, predictions,
                                                                    window):
    pools, planned = predictions
    adv = dataclasses.replace(
        _advice(heavy_pop, pools, planned, ("pre-encode", "keys", "planned", 0)),
        planned_mixes=(planned, window))
    text = advice_tables(adv)
    header = next(line for line in text.splitlines() if line.startswith("order"))
    assert header.split()[:6] == ["order", "lost", "64*", "idle/step", "idle/mb", "pad/tok"]
    for p in (planned, window):
        row = next(line for line in text.splitlines() if line.startswith(p.name))
        assert row.rstrip().endswith("yes (index)")
        cells = row[len(p.name):].split()
        assert cells[:5] == [f"{100 * v:.1f}%" for v in (
            p.lost(R), p.idle_step[R], p.idle[R], p.padding_tokens, p.padding)], row
        assert f"{p.name}: length_sort_mode: planned, planned_mix: {p.mix}" in text
        assert f"{p.name}: no pool (no pool memory" in text
    # the rank-count table: idle per optimizer step at 8 and 64 ranks
    assert "idle per optimizer step at each rank count (* requested):" in text
    row = [line for line in text.splitlines() if line.startswith(window.name)][1]
    assert row.split()[-2:] == [f"{100 * window.idle_step[n]:.1f}%" for n in (8, R)]
    assert "worst step at 64 ranks: a source's count" in text and "pool off:" in text
    assert "worst window: " in text and "ms per step" in text
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
    for mix in ("step", "window"):  # each mix's default window at 64 ranks x 8 x 4, at most
        # one epoch of each 1,600-sample source (here one step: a source's share of a step
        # is 1,024 samples)
        k = min(default_window_steps(mix, 64 * 8 * 4),
                steps_within_an_epoch([1600, 1600], [[1, 1]], 64 * 8 * 4))
        assert re.search(rf"planned \(K={k}, {mix}\) .* yes \(index\)", res.output)
    assert re.search(r"recommended: length_sort_mode: planned, planned_mix: (step|window), "
                     "length_sort_placement: pre-encode, length_sort_pool_holds: keys",
                     res.output)
    assert planned_requirements() in res.output
    assert "planned order: not recommended" not in res.output
