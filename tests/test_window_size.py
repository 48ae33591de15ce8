"""How many steps a plan window holds when plan_window_steps is not given (issue 32): the step
mix keeps 32, the window mix sizes its window in samples (2^20) or packs (2^17), a packed window
holds fewer packs where short samples fill a pack with many, and what the pipeline plans and
stamps is that K."""

import dataclasses

import numpy as np
import pytest

from energon_ordering import OrderingConfig
from energon_ordering.errors import OrderingConfigError
from energon_ordering.pipeline.plan import (PLANNED_SOURCE, BuildArgs, Source, packed_step_note,
                                            packed_window_steps, plan_pipeline, run_weight_rows,
                                            run_window_steps, window_repeat_note)
from energon_ordering.pipeline.stamp import pipeline_stamp
from energon_ordering.planned.window import DEFAULT_WINDOW_STEPS
from energon_ordering.planned.window_size import (MAX_WINDOW_MIX_STEPS, STEP_MIX_PACKED_SAMPLES,
                                                  WINDOW_MIX_CAPPED_SAMPLES,
                                                  WINDOW_MIX_PACKED_SAMPLES, WINDOW_MIX_PACKS,
                                                  WINDOW_MIX_SAMPLES, default_window_steps,
                                                  packed_samples_per_pack,
                                                  packed_step_over_budget, steps_within_an_epoch,
                                                  window_epoch_draws)

PLANNED = dict(length_sort_mode="planned", length_sort_placement="pre-encode",
               length_sort_pool_holds="keys")


@pytest.mark.parametrize("g, k", [
    (1, 128), (32, 128), (4096, 128),     # up to 2^19 samples: at most 128 steps
    (8192, 64),                           # 2^19 samples
    (16384, 32), (32768, 32),             # at least 32 up to 2^20 samples
    (16384 * 8 * 4, 2), (1 << 22, 1),     # fewer only beyond (32 steps: 2^24 ids, 1.4 GiB)
])
def test_the_step_mix_holds_half_a_million_samples_32_to_128_steps(g, k):
    assert default_window_steps("step", g) == k


@pytest.mark.parametrize("g, k", [(1, 32), (4096, 32), (8192, 16), (16384 * 8, 1)])
def test_the_packed_step_mix_keeps_32_steps_up_to_2_17_packs(g, k):
    assert default_window_steps("step", g, packed=True) == k


@pytest.mark.parametrize("g, k, capped_k", [
    (2 * 1 * 4, MAX_WINDOW_MIX_STEPS, MAX_WINDOW_MIX_STEPS),  # 2 ranks, M 1, B 4: 32,768 samples
    (8 * 2 * 4, MAX_WINDOW_MIX_STEPS, MAX_WINDOW_MIX_STEPS),  # 8 ranks, M 2: 262,144 samples
    (256 * 2 * 4, 2048, 512),             # 256 ranks: 2^22 / 2,048 (capped 2^20 / 2,048)
    (1024 * 8 * 4, 128, 32),              # 1,024 ranks, M 8 (capped: the step mix's 32)
    (16384 * 1 * 4, 64, 16),              # 16,384 ranks, M 1
    (16384 * 8 * 4, 8, 2),                # 16,384 ranks, M 8: a fixed 32 would be over 2^24
    (1 << 23, 1, 1),                      # a step over the target: one step per window
])
def test_the_window_mix_holds_about_four_million_samples_or_one_under_caps(g, k, capped_k):
    """2^22 samples (the plan built in its own memory), 2^20 under the warmup's caps (whose
    planner holds about 40 bytes a sample), at most 4,096 steps, at least one."""
    assert default_window_steps("window", g) == k
    assert k * g <= max(WINDOW_MIX_SAMPLES, g)
    assert default_window_steps("window", g, capped=True) == capped_k
    assert capped_k * g <= max(WINDOW_MIX_CAPPED_SAMPLES, g)


def test_packed_window_mix_counts_packs():
    assert default_window_steps("window", 1024 * 8, packed=True) == 16
    assert default_window_steps("window", 16384 * 1, packed=True) == 8
    assert default_window_steps("window", 8 * 2, packed=True) == MAX_WINDOW_MIX_STEPS
    assert 16 * 1024 * 8 == WINDOW_MIX_PACKS


def test_short_samples_make_a_packed_window_hold_fewer_packs():
    """A packed window's planning holds about 53 bytes a sample (the step mix's of one step,
    beside the window's ids): at most 2^20 samples, whatever the packs hold."""
    g = 1024 * 8
    # the benchmark's mixes hold 5-9 samples a pack: about what the packs hold
    assert default_window_steps("window", g, packed=True, samples_per_pack=6.8) == 16
    assert default_window_steps("window", g, packed=True, samples_per_pack=8.5) == 15
    assert default_window_steps("step", g, packed=True, samples_per_pack=6.8) == 16
    assert default_window_steps("step", g, packed=True, samples_per_pack=8.5) == 15
    # 217-token samples in 8,192-token packs: 38 a pack
    spp = 8192 / 217
    k = default_window_steps("window", g, packed=True, samples_per_pack=spp)
    assert k == 3 and k * g * spp <= WINDOW_MIX_PACKED_SAMPLES < (k + 1) * g * spp
    k = default_window_steps("step", g, packed=True, samples_per_pack=spp)
    assert k == 3 and k * g * spp <= STEP_MIX_PACKED_SAMPLES < (k + 1) * g * spp
    # at least one step; padded plans count samples already
    assert default_window_steps("window", 16384 * 8, packed=True, samples_per_pack=spp) == 1
    assert default_window_steps("window", 64, samples_per_pack=100) == default_window_steps(
        "window", 64)
    for bad in (0.5, float("nan")):
        with pytest.raises(ValueError, match=f"samples_per_pack = {bad}"):
            default_window_steps("window", 64, packed=True, samples_per_pack=bad)


def test_samples_per_pack_is_the_shortest_weighted_mean_of_the_cut_lengths():
    short, long = np.full(1000, 100), np.full(500, 2000)
    assert packed_samples_per_pack([short, long], [[1, 0]], 800) == 8
    assert packed_samples_per_pack([short, long], [[0, 1]], 800) == 1  # cut: one a pack
    assert packed_samples_per_pack([short, long], [[1, 1]], 800) == pytest.approx(800 / 450)
    # the most over the rows (a schedule's): the row that draws the short source most
    rows = [[0, 1], [3, 1], [1, 1]]
    assert packed_samples_per_pack([short, long], rows, 800) == pytest.approx(800 / 275)
    # at most most_read evenly spaced samples of a source are read
    x = np.arange(1, 10**6 + 1)
    assert packed_samples_per_pack([x], [[1]], 10**7, most_read=1000) == pytest.approx(
        10**7 / x.mean(), rel=1e-3)
    for bad in ([[1]], [[-1, 2]], [[0, 0]], [[np.nan, 1]]):
        with pytest.raises(ValueError, match="weights of shape"):
            packed_samples_per_pack([short, long], bad, 800)


def test_the_run_weights_are_the_blend_or_the_schedules_piece_ends():
    args = BuildArgs(batch_size=1, world_size=8, packing_buffer_size=16,
                     sources=(Source(name="b", weight=1.0), Source(name="a", weight=3.0)))
    cfg = OrderingConfig(**PLANNED, pack_seq_length=800)
    assert run_weight_rows(cfg, args).tolist() == [[1.0, 3.0]]
    # a schedule's rows in the metadataset's source order, at the ends of its pieces
    ramp = OrderingConfig(**PLANNED, pack_seq_length=800, total_steps=100, mixture_schedule={
        "phases": [{"until": 0.5, "weights": {"a": 1, "b": 0}},
                   {"until": 1.0, "ramp_steps": 10, "weights": {"a": 1, "b": 3}}]})
    rows = run_weight_rows(ramp, args)
    assert rows[0].tolist() == [0.0, 1.0] and rows[-1].tolist() == [0.75, 0.25]
    # the shortest mean over the run is at one of them: b's 100-token samples at 3 / 4
    lengths = [np.full(64, 100), np.full(64, 700)]
    assert packed_samples_per_pack(lengths, rows, 800) == pytest.approx(800 / 250)
    k_blend = packed_window_steps(cfg, args, lengths)
    assert packed_window_steps(ramp, args, lengths) <= k_blend
    given = OrderingConfig(**PLANNED, pack_seq_length=800, plan_window_steps=7)
    assert packed_window_steps(given, args, lengths) == 7


def test_a_packed_step_over_the_window_budget_is_named_with_its_memory():
    """A window is at least one step and a step is planned at once: where one step of packs
    alone holds more samples than the budget, the build says so, with the peak and the fix."""
    # 16,384 ranks x 8 packs of 217-token samples (37.8 a pack of 8,192 tokens): 4.9 million
    assert packed_step_over_budget("window", 16384 * 8, 37.8) == pytest.approx(16384 * 8 * 37.8)
    assert packed_step_over_budget("step", 16384 * 8, 37.8) is not None
    assert packed_step_over_budget("window", 1024 * 8, 37.8) is None  # 310,000: within
    assert packed_step_over_budget("window", WINDOW_MIX_PACKED_SAMPLES, 1.0) is None
    assert packed_step_over_budget("window", WINDOW_MIX_PACKED_SAMPLES, 1.01) is not None
    cfg = OrderingConfig(**PLANNED, pack_seq_length=8192, micro_batches_per_step=8)
    big = BuildArgs(batch_size=1, world_size=16384, packing_buffer_size=64,
                    sources=(Source(name="chat", weight=1.0),))
    note = packed_step_note(cfg, big, 37.8)
    assert "131,072 packs" in note and "4,954,522 samples" in note
    assert "peaks near 250 MiB" in note and "micro_batches_per_step" in note
    assert packed_step_note(cfg, dataclasses.replace(big, world_size=1024), 37.8) is None


def test_bad_inputs_are_named():
    with pytest.raises(OrderingConfigError, match="planned_mix = 'bands'"):
        default_window_steps("bands", 64)
    with pytest.raises(ValueError, match="draws_per_step = 0"):
        default_window_steps("window", 0)


def test_the_config_leaves_the_window_mixs_k_to_the_global_batch():
    cfg = OrderingConfig(**PLANNED, planned_mix="window", micro_batches_per_step=2)
    assert cfg.plan_window_steps is None
    assert cfg.window_steps(8, 4) == MAX_WINDOW_MIX_STEPS
    assert cfg.window_steps(1024, 4) == 512
    assert cfg.window_steps(1024, 1, packed=True) == 64
    # under a sequence-length warmup's caps the window mix holds a quarter of the samples
    warm = dataclasses.replace(cfg, seq_length_warmup={"start": 64, "full": 4096,
                                                       "warmup_steps": 100})
    assert warm.window_steps(1024, 4) == 128 and warm.window_steps(8, 4) == 4096
    # round trip keeps "not given"
    assert OrderingConfig.from_dict(cfg.to_dict()).plan_window_steps is None
    given = OrderingConfig(**PLANNED, planned_mix="window", plan_window_steps=48)
    assert given.window_steps(8, 4) == 48
    step = OrderingConfig(**PLANNED, planned_mix="step")
    assert step.plan_window_steps is None and step.window_steps(8, 4) == 128
    assert step.window_steps(8192, 4) == DEFAULT_WINDOW_STEPS
    # a step config turned to the window mix sizes its window anew (nothing was given)
    assert dataclasses.replace(step, planned_mix="window").window_steps(8, 4) == 4096
    with pytest.raises(OrderingConfigError, match="length_sort_mode = 'planned' only"):
        OrderingConfig().window_steps(8, 4)


@pytest.mark.parametrize("packing", [None, 16])
def test_the_pipeline_plans_and_stamps_the_resolved_window(packing):
    cfg = OrderingConfig(**PLANNED, planned_mix="window", micro_batches_per_step=2,
                         pack_seq_length=None if packing is None else 256)
    args = BuildArgs(batch_size=4, world_size=512, packing_buffer_size=packing,
                     sources=(Source(name="a"),))
    plan = plan_pipeline(cfg, args)
    k = dict(plan.stage(PLANNED_SOURCE).settings)["window_steps"]
    assert k == default_window_steps("window", 512 * 2 * 4, packed=packing is not None) < 4096
    assert pipeline_stamp(plan, length_indexes=None)["plan_window_steps"] == k
    # the same global batch on other ranks (an elastic resume): the same window
    other = plan_pipeline(cfg, BuildArgs(batch_size=4, world_size=256, packing_buffer_size=packing,
                                         sources=(Source(name="a"),)))
    cfg2 = OrderingConfig(**PLANNED, planned_mix="window", micro_batches_per_step=4,
                          pack_seq_length=None if packing is None else 256)
    same = plan_pipeline(cfg2, BuildArgs(batch_size=4, world_size=256, packing_buffer_size=packing,
                                         sources=(Source(name="a"),)))
    assert dict(same.stage(PLANNED_SOURCE).settings)["window_steps"] == k
    assert dict(other.stage(PLANNED_SOURCE).settings)["window_steps"] != k  # half the batch


def test_each_mix_refuses_its_own_largest_window():
    ok = OrderingConfig(**PLANNED, planned_mix="window", plan_window_steps=4096)
    assert ok.window_steps(2, 4) == 4096
    with pytest.raises(OrderingConfigError, match="over the window mix's limit of 4,096"):
        OrderingConfig(**PLANNED, planned_mix="window", plan_window_steps=4097)
    with pytest.raises(OrderingConfigError, match="over the limit of 1,024"):
        OrderingConfig(**PLANNED, planned_mix="step", plan_window_steps=1025)


def test_a_window_draws_each_source_of_repeating_data_within_its_size():
    """Found by review (7 December 2026): a default window of 4,096 steps of 32 samples drew
    22,000 samples 6 times over, and its sort by length put a sample's copies (one length) in
    one optimizer step. On repeating data the default window holds at most the steps in which
    no source is drawn beyond its size."""
    # 20,000 + 2,000 samples at 10 : 1, 32 a step: each source's epoch is 687.5 steps
    assert window_epoch_draws([20000, 2000], [[10, 1]], 32, 1) == pytest.approx(
        [32 * 10 / 11 / 20000, 32 / 11 / 2000])
    assert steps_within_an_epoch([20000, 2000], [[10, 1]], 32) == 687
    assert steps_within_an_epoch([20000, 20000], [[10, 1]], 32) == 687  # the heavier decides
    # a schedule's rows: the most a source is weighted over the run
    assert steps_within_an_epoch([1000, 1000], [[1, 0], [1, 1]], 10) == 100
    assert steps_within_an_epoch([1000, 0], [[1, 0]], 10) == 100  # an unweighted source
    assert steps_within_an_epoch([100, 100], [[1, 1]], 8) == 25  # exactly one epoch
    assert steps_within_an_epoch([10], [[1]], 32) == 1  # smaller than a step: at least one
    with pytest.raises(ValueError, match="weights of shape"):
        window_epoch_draws([10, 10], [[1.0]], 8, 1)
    with pytest.raises(ValueError, match="sizes >= 0"):
        window_epoch_draws([-1], [[1.0]], 8, 1)


def test_the_build_bounds_the_default_window_by_the_sources_sizes_and_names_a_given_one():
    args = BuildArgs(batch_size=4, world_size=8, sources=(Source(name="web", weight=10.0),
                                                          Source(name="curated", weight=1.0)))
    lengths = [np.full(20000, 300), np.full(2000, 900)]
    cfg = OrderingConfig(**PLANNED, planned_mix="window")
    assert cfg.window_steps(8, 4) == MAX_WINDOW_MIX_STEPS  # from the global batch alone
    assert run_window_steps(cfg, args, lengths, False) == 687
    assert window_repeat_note(cfg, args, lengths, 687) is None
    step = dataclasses.replace(cfg, planned_mix="step")
    assert run_window_steps(step, args, lengths, False) == 128  # within an epoch already
    # finite data draws each sample once an epoch: the window is not bounded
    finite = dataclasses.replace(args, repeat=False)
    assert run_window_steps(cfg, finite, lengths, False) == MAX_WINDOW_MIX_STEPS
    # packed: the samples a step draws are its packs times the most samples a pack holds
    assert run_window_steps(cfg, dataclasses.replace(args, packing_buffer_size=8), lengths,
                            True, samples_per_pack=4.0) == 687 // 4
    # a given window is kept, and named where it draws a source twice or more
    given = OrderingConfig(**PLANNED, planned_mix="window", plan_window_steps=2048)
    assert run_window_steps(given, args, lengths, False) == 2048
    note = window_repeat_note(given, args, lengths, 2048)
    assert "'curated': 2,000 samples, about 5,958 drawn a window" in note
    assert "'web'" in note and "plan_window_steps <= 687" in note
    # a source smaller than its share of one step repeats in any window
    tiny = [np.full(20000, 300), np.full(2, 900)]
    assert run_window_steps(cfg, args, tiny, False) == 1
    assert "smaller than what one optimizer step draws of it" in window_repeat_note(
        cfg, args, tiny, 1)
