"""``advise``: the prediction model against brute force and against ``inspect`` on real pipelines;
the per-step source grouping; the CLI."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from energon_ordering import OrderingConfig
from energon_ordering.cli import main
from energon_ordering.planned.window_size import default_window_steps, steps_within_an_epoch
from energon_ordering.errors import OrderingConfigError
from energon_ordering.inspect.advise import (
    LengthPopulation,
    load_population,
    order_positions,
    predict_order,
    vector_straggler_idle,
)
from energon_ordering.inspect.diagnostics import histogram_dispersion, sources_by_step, straggler_idle
from energon_ordering.inspect.inspection import measure
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, run_ranks
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.pool.order import POOL_ORDERS, pool_seed
import sys

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """web (short, ~200 tokens) and code (uniform, 500), 6,400 each, with length indexes: 1,600
    samples per rank at 8 ranks, so 400 micro-batches of 4 stay within one epoch."""
    root = tmp_path_factory.mktemp("advise")
    return indexed_synthetic(
        root, [SourceSpec("web", 6400, "short"), SourceSpec("code", 6400, "uniform")],
        shard_size=64, workers=2)


# ---- the model, pure ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(POOL_ORDERS))
def test_order_positions_are_the_sorted_ranks_the_pool_emits(mode):
    # The model runs the order function on ranks 0..N-1; that must be the sorted rank of what
    # the pool emits for ANY lengths (ties included).
    rng = random.Random(1)
    lengths = [rng.choice([100, 200, 300, 5000]) + rng.random() * (i % 3) for i in range(96)]
    emitted = POOL_ORDERS[mode](lengths, pool_seed(7, 2, 1), 4)
    positions = order_positions(mode, 96, 4, 7, 2, 1)
    assert [lengths[i] for i in emitted] == [sorted(lengths)[p] for p in positions]


def test_vector_idle_equals_the_diagnostics_definition():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 6000, size=(8, 50, 4)).astype(float)
    steps = [[list(lengths[r, s]) for r in range(8)] for s in range(50)]
    assert vector_straggler_idle(lengths) == pytest.approx(straggler_idle(steps), rel=1e-12)


@pytest.mark.parametrize("m", [1, 5])
def test_advise_measures_lost_compute_as_inspect_does(m):
    """advise's idle per optimizer step and padding by tokens of ``lengths[rank, mb, i]`` are
    inspect's (inspection.measure over the same micro-batches as records)."""
    from energon_ordering.inspect.advise import step_straggler_idle
    from energon_ordering.inspect.lost_compute import padding_by_tokens
    from energon_ordering.inspect.rank_simulation import BatchRecord

    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 6000, size=(8, 50, 4)).astype(float)
    records = [[BatchRecord(tuple(map(str, range(4))), tuple(int(x) for x in b), ("x",) * 4)
                for b in rank] for rank in lengths]
    got = measure(records, period_batches=8, micro_batches_per_step=m)
    assert step_straggler_idle(lengths, m) == pytest.approx(got.idle_per_step, rel=1e-12)
    assert padding_by_tokens(lengths) == pytest.approx(got.padding_by_tokens, rel=1e-12)


def _brute_force_idle(pop, mode, pool, ranks, steps, b, seed=0):
    """Each rank fills real pools with iid draws and applies the real order function."""
    rng = np.random.default_rng(seed)
    per_rank = []
    for _ in range(ranks):
        emitted = []
        k = 0
        while len(emitted) < steps * b:
            pool_lengths = list(rng.choice(pop.lengths, size=pool))
            order = POOL_ORDERS[mode](pool_lengths, pool_seed(0, k, 0), b)
            emitted.extend(pool_lengths[i] for i in order)
            k += 1
        per_rank.append(np.array(emitted[: steps * b]).reshape(steps, b))
    return vector_straggler_idle(np.stack(per_rank))


@pytest.mark.parametrize("mode", sorted(POOL_ORDERS))
def test_order_statistics_model_matches_brute_force(mode):
    rng = np.random.default_rng(3)
    lengths = np.sort(np.concatenate([rng.normal(300, 75, 5000), rng.normal(4000, 800, 1500)]).clip(1))
    pop = LengthPopulation(lengths, np.zeros(len(lengths), dtype=np.int64), ("x",), "test")
    model = predict_order(pop, mode=mode, pool_size=256, batch_size=4, ranks=(8,), step_ranks=8,
                          steps=3000).idle[8]
    brute = _brute_force_idle(pop, mode, 256, 8, 3000, 4)
    assert model == pytest.approx(brute, abs=0.01)
    off = predict_order(pop, mode="off", pool_size=0, batch_size=4, ranks=(8,), step_ranks=8,
                        steps=3000).idle[8]
    assert off > 3 * model  # the pool's effect is visible, not noise


def test_predict_order_refuses_an_inconsistent_setting():
    pop = LengthPopulation(np.arange(1.0, 10), np.zeros(9, dtype=np.int64), ("x",), "test")
    with pytest.raises(OrderingConfigError, match="mode = 'off' with pool_size = 8"):
        predict_order(pop, mode="off", pool_size=8, batch_size=4, ranks=(8,), step_ranks=8)
    with pytest.raises(OrderingConfigError, match="mode = 'nope' is unknown"):
        predict_order(pop, mode="nope", pool_size=8, batch_size=4, ranks=(8,), step_ranks=8)


def test_sources_by_step_groups_every_rank_and_micro_batch_of_a_step():
    batches = [[["a", "a"], ["b", "b"], ["a", "b"], ["a", "a"], ["x"]],
               [["b", "b"], ["a", "a"], ["b", "a"], ["b", "b"]]]
    assert sources_by_step(batches, 2) == [["a", "a", "b", "b", "b", "b", "a", "a"],
                                           ["a", "b", "a", "a", "b", "a", "b", "b"]]
    assert sources_by_step(batches, 1)[3] == ["a", "a", "b", "b"]
    # Per micro-batch the sources cluster; per step they are perfectly balanced.
    groups = sources_by_step(batches, 2)
    assert histogram_dispersion(groups, ["a", "b"]) == 0.0
    with pytest.raises(ValueError, match="micro_batches_per_step = 0"):
        sources_by_step(batches, 0)


# ---- against inspect, on real pipelines ---------------------------------------------------------


@pytest.mark.slow  # 8 real rank pipelines per case
@pytest.mark.parametrize("mode,pool", [("off", 0), ("batch", 256), ("sample", 256)])
def test_eight_rank_prediction_matches_what_inspect_measures(two_sources, mode, pool):
    # inspect's own measurement: 8 real rank pipelines (WorkerConfig(rank=r, world_size=8)),
    # 400 micro-batches of 4 (one epoch of each rank's share: the model draws independent
    # samples; a stream that repeats a small share makes a rank a persistent straggler),
    # reduced by inspection.measure. The model's sampling noise at 400 steps is ~0.3 points.
    cfg = OrderingConfig(length_sort_pool_size=pool,
                         length_sort_mode=mode if pool else "sample", seed=0)
    records = run_ranks(two_sources, ordering=cfg, world_size=8, steps=400, batch_size=4,
                        task_encoder_factory=IndexedSyntheticTaskEncoder)
    measured = measure(records, period_batches=16)
    pop = load_population(two_sources)
    assert pop.origin == "length index" and pop.source_names == ("code", "web")
    predicted = predict_order(pop, mode=mode, pool_size=pool, batch_size=4, ranks=(8,),
                              step_ranks=8, steps=4000)
    assert abs(predicted.idle[8] - measured.straggler_idle) <= 0.01, (predicted, measured)
    assert abs(predicted.idle_step[8] - measured.idle_per_step) <= 0.01
    assert abs(predicted.padding - measured.padding_waste) <= 0.02
    assert abs(predicted.padding_tokens - measured.padding_by_tokens) <= 0.02
    assert abs(predicted.dispersion_batch - measured.histogram_dispersion) <= 0.35


# ---- CLI ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def advise_run(two_sources, tmp_path_factory):
    """One ``advise`` CLI run at 8 ranks x 2 workers: a worker's share is 12,800 / 16 = 800."""
    out = tmp_path_factory.mktemp("advise_out")
    result = CliRunner().invoke(main, [
        "advise", str(two_sources), "--ranks", "8", "--micro-batch", "4", "--num-workers", "2",
        "--memory-per-worker", "64MiB", "--steps", "200", "--out", str(out),
        "--task-encoder", "energon_ordering.inspect.synthetic_task:IndexedSyntheticTaskEncoder"])
    return result, out


@pytest.mark.slow
def test_advise_cli_prints_the_table_recommends_and_plots(advise_run):
    result, out_dir = advise_run
    assert result.exit_code == 0, result.output
    out = result.output
    assert "dataset: 12,800 samples; lengths: length index" in out and "sources code, web" in out
    for row in ("pool off", "batch 800", "batch 1,000", "sample 1,000", "stratified 1,000",
                "batch 1,000,000"):
        assert row in out
    header = next(line for line in out.splitlines() if line.startswith("order  "))
    assert header.split() == ["order", "lost", "8*", "idle/step", "idle/mb", "pad/tok",
                              "pad/mb", "disp/mb", "disp/step", "accepted"]
    assert "idle per optimizer step at each rank count (* requested):" in out
    assert re.search(r"order +8\* +64 +256 +1,024\n", out)
    # each mix's default window at 8 ranks x 1 x 4, at most one epoch of the 6,400-sample
    # sources (400 steps; the prediction's population draws the weights, so within a step)
    bound = steps_within_an_epoch([6400, 6400], [[1, 1]], 8 * 1 * 4)
    for mix in ("step", "window"):
        found = re.search(rf"planned \(K=(\d+), {mix}\) .* yes \(index\)", out)
        assert found, mix
        k = int(found.group(1))
        assert k == default_window_steps(mix, 8 * 1 * 4) or abs(k - bound) <= 1, (mix, k)
    assert "pre-encode/keys" in out and "post-encode/encoded" in out
    # the planned order, window mix, loses least here (every dataset has a length index)
    assert "recommended: length_sort_mode: planned, planned_mix: window" in out
    # Absolute per-step mix, defined, and stratified described by what it does.
    assert "pp typical/worst: code" in out and "typical = median step" in out
    assert "mixes sources" not in out
    assert (out_dir / "advise.png").stat().st_size > 10_000


@pytest.mark.slow
def test_advise_recommends_only_pools_the_package_accepts(advise_run, two_sources):
    # 8 ranks x 2 workers over 12,800 samples: a worker's share is 800; a 1,000 pool needs
    # 16,000 samples, and is refused by the package exactly as advise says.
    result, _ = advise_run
    assert result.exit_code == 0, result.output
    assert re.search(r"batch 1,000 .* needs 16,000", result.output)
    assert re.search(r"batch 800 .* yes", result.output)
    # the planned order is recommended; the best pool it is weighed against is one accepted
    m = re.search(r"for the best pool setting, (\w+) ([\d,]+) ([\w-]+)/(\w+)", result.output)
    assert m, result.output
    mode, size, placement, holds = m[1], int(m[2].replace(",", "")), m[3], m[4]
    holds = "raw" if holds in ("raw", "encoded") else holds
    assert 0 < size <= 800

    def build(pool):
        cfg = OrderingConfig(length_sort_pool_size=pool, length_sort_mode=mode,
                             length_sort_placement=placement, length_sort_pool_holds=holds)
        loader = build_train_loader(two_sources, ordering=cfg, rank=7, world_size=8,
                                    num_workers=2, batch_size=4,
                                    task_encoder_factory=IndexedSyntheticTaskEncoder)
        close_loader(loader)

    build(size)  # accepted
    with pytest.raises(OrderingConfigError, match="larger than a loader worker's share"):
        build(1000)


@pytest.mark.slow
def test_first_batch_fit_predicts_the_largest_pool_within_one_and_a_half(two_sources):
    # Fitted at 400 and 1,600 (start-up + per sample), checked by a measurement at 3,200: the
    # largest pool that fits 12,800 samples on 4 ranks x 1 worker.
    from energon_ordering.inspect.advise import measure_costs

    costs = measure_costs(two_sources, batch_size=4, pool_sizes=(400, 1600), check_pool=3200,
                          task_encoder_factory=IndexedSyntheticTaskEncoder)
    measured = [c for c in costs if not c.note]
    assert measured, costs
    for c in measured:
        assert c.check_pool == 3200 and c.startup_seconds >= 0 and c.fill_seconds >= 0
        assert 1 / 1.5 <= c.check_ratio <= 1.5, c


def test_fit_first_batch_is_a_line_clamped_at_zero():
    from energon_ordering.inspect.advise import fit_first_batch

    assert fit_first_batch([100, 1000], [1.1, 2.0]) == pytest.approx((1.0, 0.001))
    assert fit_first_batch([100, 1000], [2.0, 1.9]) == pytest.approx((1.95, 0.0))


def test_step_share_deviation_in_percentage_points():
    from energon_ordering.inspect.advise import step_share_deviation

    steps = np.array([[0, 0, 0, 1], [0, 1, 0, 1], [1, 1, 1, 1]])
    dev = step_share_deviation(steps, np.array([0.5, 0.5]))
    np.testing.assert_allclose(dev, [[25, 25], [0, 0], [50, 50]])


# ---- bounded inputs: one Error line, exit 2, before anything is allocated -----------------------


def _advise(*args):
    return CliRunner().invoke(main, ["advise", *map(str, args), "--no-measure", "--steps", "16"])


def _one_error_line(result, match):
    assert result.exit_code == 2, result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), result.output
    assert re.search(match, lines[0]), lines[0]


def test_advise_refuses_a_recipe_as_dataset():
    recipe = Path(__file__).parent.parent / "recipes" / "demo.yaml"
    _one_error_line(_advise(recipe, "--ranks", 8, "--micro-batch", 4), r"DATASET .* is a recipe")


def test_advise_refuses_a_folder_that_is_no_dataset(tmp_path):
    _one_error_line(_advise(tmp_path, "--ranks", 8, "--micro-batch", 4),
                    r"DATASET .* is not a prepared Energon dataset")


def test_advise_refuses_a_micro_batch_larger_than_the_data(small_dataset):
    _one_error_line(_advise(small_dataset, "--ranks", 8, "--micro-batch", 100000),
                    r"640 samples, fewer than one micro-batch per loader worker")


def test_advise_refuses_a_billion_ranks(small_dataset):
    _one_error_line(_advise(small_dataset, "--ranks", 1_000_000_000, "--micro-batch", 4),
                    r"1,000,000,000 ranks .* lower --ranks")


def test_advise_refuses_a_simulation_larger_than_its_memory_limit(align_dataset):
    # 4,096 samples fit 1,024 ranks x 4; 1,024 ranks x 100,000 micro-batches do not fit 4 GiB.
    r = CliRunner().invoke(main, ["advise", str(align_dataset), "--ranks", "1024", "--micro-batch",
                                  "4", "--no-measure", "--steps", "100000"])
    _one_error_line(r, r"GiB, over advise's limit .* lower --steps to")


def test_advise_refuses_blend_weights_that_are_all_zero(small_dataset, tmp_path):
    meta = tmp_path / "zero.yaml"
    meta.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        f"      - weight: 0\n        path: {small_dataset}\n"
        f"      - weight: 0.0\n        path: {small_dataset}\n")
    _one_error_line(_advise(meta, "--ranks", 8, "--micro-batch", 4), r"every blend weight .* is 0")


def test_advise_refuses_a_one_sample_dataset(tmp_path):
    root = tmp_path / "one"
    make_synthetic_dataset(root, [SourceSpec("web", 1, "short")], shard_size=1)
    _one_error_line(_advise(root / "web", "--ranks", 1, "--micro-batch", 4),
                    r"has 1 samples, fewer than one micro-batch")


def test_advise_cli_rejects_a_bad_memory_size(two_sources):
    result = CliRunner().invoke(main, ["advise", str(two_sources), "--ranks", "8",
                                       "--micro-batch", "4", "--memory-per-worker", "lots"])
    assert result.exit_code == 2
    assert "'lots': expected a size like 2GiB" in result.output


def test_without_a_length_index_lengths_are_the_estimate_inspect_uses(small_dataset):
    pop = load_population(small_dataset, estimate_samples=256,
                          task_encoder_factory=IndexedSyntheticTaskEncoder)
    assert pop.origin.startswith("estimate (256 samples, IndexedSyntheticTaskEncoder")
    assert len(pop.lengths) == 256 and np.all(np.diff(pop.lengths) >= 0)
    # The synthetic encoder's length: 64 image tokens + caption words.
    assert pop.lengths.min() >= 64


def test_the_cost_table_says_which_pools_ramp_and_what_their_first_batch_waits_for():
    from energon_ordering.cli.tables import advice_tables
    from energon_ordering.inspect.advise import Advice, CostPerSample

    lengths = np.sort(np.random.default_rng(0).lognormal(6, 0.5, 4000))
    pop = LengthPopulation(lengths, np.zeros(len(lengths), dtype=np.int64), ("web",), "test")
    preds = [predict_order(pop, mode="batch", pool_size=n, batch_size=4, ranks=(8,),
                           step_ranks=8, steps=32) for n in (1000, 10_000, 100_000)]
    cost = CostPerSample("pre-encode", "keys", 0.5, 1e-3, 40.0, (100, 400), 800, 0.9)
    adv = Advice(pop, 8, 4, preds, [cost], 2**30, None, "test", (8,), 1, 1_000_000, 125_000)
    text = advice_tables(adv)
    # a ramped pool's first batch waits for its first pool of 1,000: 0.5 + 1e-3 x 1,000 s
    assert re.search(r"pre-encode/keys +\S+ MiB, 1\.5 s +\S+ MiB, 1\.5 s +\S+ MiB, 1\.5 s", text), text
    assert "pools of 10,000 or more ramp up" in text and "first pool only, 1,000 samples" in text
    assert "ramp up" not in advice_tables(dataclasses.replace(adv, predictions=preds[:1]))
