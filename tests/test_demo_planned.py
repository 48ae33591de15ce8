"""The planned order in ``inspect`` (a planned recipe runs, its column names the mode and its
mix granularity) and in the demo (a third run beside no pool and the pool, at the planned_mix
that loses the least compute at the demo's shape); the tables lead with lost compute."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from energon_ordering.cli import main
from energon_ordering.cli.demo import DEMO_SOURCES, winning_mix
from energon_ordering.cli.recipe import load_recipe
from energon_ordering.cli.inspect import as_planned, planned_repeats, pool_off
from energon_ordering.planned.window_size import default_window_steps, steps_within_an_epoch
from energon_ordering.inspect.rank_simulation import BatchRecord
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering import OrderingConfig

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

RECIPES = Path(__file__).parent.parent / "recipes"

TE = "energon_ordering.inspect.synthetic_task:IndexedSyntheticTaskEncoder"


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    return indexed_synthetic(
        tmp_path_factory.mktemp("planned_inspect"),
        [SourceSpec("web", 96, "short", weight=0.75), SourceSpec("code", 32, "long", weight=0.25)],
        shard_size=32)


def test_inspect_runs_a_planned_recipe_and_names_its_mode(indexed, tmp_path):
    recipe = tmp_path / "planned.yaml"
    recipe.write_text(yaml.safe_dump({
        "length_sort_mode": "planned", "length_sort_placement": "pre-encode",
        "length_sort_pool_holds": "keys", "plan_window_steps": 4, "micro_batches_per_step": 2}))
    # 2 ranks x 24 micro-batches of 4: 192 samples of 128, so both sources wrap
    res = CliRunner().invoke(main, ["inspect", str(indexed), "--recipe", str(recipe), "--ranks",
                                    "2", "--steps", "24", "--out", str(tmp_path),
                                    "--task-encoder", TE])
    assert res.exit_code == 0, res.output
    header = next(line for line in res.output.splitlines()  # not the progress lines
                  if line.startswith(" ") and line.lstrip().startswith("pool off"))
    # no planned_mix and no schedule: "auto" plans per window
    assert "planned (K=4, window)" in header and "pool 0" not in header
    overlap = next(line for line in res.output.splitlines() if line.startswith("keys on two"))
    assert overlap.split()[-2:] == ["0", "0*"], overlap
    assert "planned (K=4, window): length_sort_mode: planned, planned_mix: window" in res.output
    rows = [line.split("  ")[0] for line in res.output.splitlines()]
    for row in ("lost compute (idle/step + padding/tokens)", "straggler idle, per optimizer step",
                "straggler idle, per micro-batch", "padding waste, by tokens",
                "padding waste, mean per micro-batch"):
        assert row in rows, res.output
    assert (tmp_path / "inspect.png").stat().st_size > 10_000


def test_inspect_runs_a_window_mix_recipe(indexed, tmp_path):
    recipe = tmp_path / "window.yaml"
    recipe.write_text(yaml.safe_dump({
        "length_sort_mode": "planned", "length_sort_placement": "pre-encode",
        "length_sort_pool_holds": "keys", "plan_window_steps": 4, "planned_mix": "window"}))
    res = CliRunner().invoke(main, ["inspect", str(indexed), "--recipe", str(recipe), "--ranks",
                                    "2", "--steps", "16", "--out", str(tmp_path),
                                    "--task-encoder", TE])
    assert res.exit_code == 0, res.output
    header = next(line for line in res.output.splitlines()
                  if line.startswith(" ") and line.lstrip().startswith("pool off"))
    assert header.split()[-3:] == ["planned", "(K=4,", "window)"], header
    assert "planned (K=4, window): length_sort_mode: planned, planned_mix: window" in res.output


def test_the_planned_run_takes_the_mix_asked_for():
    recipe = Path(__file__).parent.parent / "recipes" / "demo.yaml"
    cfg = OrderingConfig.from_yaml(recipe)
    window = as_planned(cfg, "window")
    assert window.planned and window.planned_mix == "window"
    assert as_planned(cfg).planned_mix == "auto"
    assert as_planned(window, "step").planned_mix == "step"
    assert as_planned(window).plan_window_steps == window.plan_window_steps
    # the pool-off run of a window recipe drops the planned order's own settings
    off = pool_off(window)
    assert not off.planned and off.planned_mix == "auto"


def test_winning_mix_is_the_one_advise_predicts_loses_least(indexed):
    cfg = OrderingConfig.from_yaml(Path(__file__).parent.parent / "recipes" / "demo.yaml")
    mix, lost = winning_mix(indexed, cfg, ranks=2, batch_size=4, steps=32)
    assert set(lost) == {"step", "window"} and all(0 <= v for v in lost.values())
    assert mix == min(lost, key=lost.get)


def test_inspect_runs_a_planned_recipe_with_packing(indexed, tmp_path):
    recipe = tmp_path / "planned_packs.yaml"
    recipe.write_text(yaml.safe_dump({
        "length_sort_mode": "planned", "length_sort_placement": "pre-encode",
        "length_sort_pool_holds": "keys", "plan_window_steps": 4, "micro_batches_per_step": 2,
        "packing_buffer_size": 32, "pack_seq_length": 2048}))
    res = CliRunner().invoke(main, ["inspect", str(indexed), "--recipe", str(recipe), "--ranks",
                                    "2", "--steps", "8", "--batch-size", "1", "--out",
                                    str(tmp_path), "--task-encoder", TE])
    assert res.exit_code == 0, res.output
    header = next(line for line in res.output.splitlines()
                  if line.startswith(" ") and line.lstrip().startswith("pool off"))
    assert "planned (K=4, window)" in header
    overlap = next(line for line in res.output.splitlines() if line.startswith("keys on two"))
    assert overlap.split()[-1] == "0*", overlap  # the planned run drew no sample twice


def _records(keys_per_rank):
    return [[BatchRecord(keys=tuple(keys), sources=tuple(k.split("-")[0] for k in keys),
                         lengths=tuple(1 for _ in keys)) for keys in rank]
            for rank in keys_per_rank]


def test_planned_repeats_counts_samples_drawn_more_often_than_their_epochs(indexed):
    cfg = OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                         length_sort_pool_holds="keys", plan_window_steps=1)
    # one step of 2 ranks x 1 x 2: 1.5 web, 0.5 code drawn at most: one epoch of each
    fine = _records([[["web-1", "code-1"]], [["web-2", "web-3"]]])
    assert planned_repeats(str(indexed), cfg, fine, ranks=2, batch_size=2) == 0
    twice = _records([[["web-1", "code-1"]], [["web-1", "web-3"]]])
    assert planned_repeats(str(indexed), cfg, twice, ranks=2, batch_size=2) == 1


@pytest.mark.slow  # the demo on 4 real rank pipelines, three runs, with a cut (about 30 s)
def test_demo_shows_the_planned_order_as_a_third_run(tmp_path):
    res = CliRunner().invoke(main, ["demo", "--out", str(tmp_path), "--ranks", "4", "--steps",
                                    "64", "--scale", "0.2"])
    assert res.exit_code == 0, res.output
    assert "building the length index of 4 source(s) for the planned run" in res.output
    results = json.loads((tmp_path / "results.json").read_text())
    # the planned run's mix: the one advise's prediction says loses the least at this shape
    lost = results["predicted_lost_compute"]
    mix = min(lost, key=lost.get)
    assert f"planned run: planned_mix: {mix}, the granularity that loses the least" in res.output
    # the demo's shape, 4 ranks x 1 x 4: its default window, at most one epoch of each source
    # of the data at --scale 0.2 under the recipe's schedule (the build reads it off the index)
    schedule = load_recipe(str(RECIPES / "demo.yaml")).mixture_schedule
    sizes = {n: max(1, round(c * 0.2)) for n, c, _ in DEMO_SOURCES}
    bound = steps_within_an_epoch([sizes[s] for s in schedule.sources],
                                  schedule.weights_table(schedule.piece_ends()), 4 * 1 * 4)
    k = min(default_window_steps(mix, 4 * 1 * 4), bound)
    name = f"planned (K={k}, {mix})"
    assert results["planned_mix"] == {name: mix}
    header = next(line for line in res.output.splitlines()  # not the progress lines
                  if line.startswith(" ") and line.lstrip().startswith("pool off"))
    assert header.split() == ["pool", "off", "pool", "256", "(batch)", "planned", f"(K={k},",
                              f"{mix})"]
    plan, off, pool = results[name], results["pool off"], results["pool 256 (batch)"]
    assert f"It loses {100 * plan['lost_compute']:.1f}% of compute" in res.output
    assert plan["overlapping_keys"] == 0 and results["resume_identical"] is True
    assert plan["lost_compute"] < off["lost_compute"]
    # at the demo's shape (one micro-batch per step) the planned run loses less than the pool
    assert plan["lost_compute"] < pool["lost_compute"], (plan, pool)
    # the next run reuses the data and its indexes
    again = CliRunner().invoke(main, ["demo", "--out", str(tmp_path), "--ranks", "2", "--steps",
                                      "32", "--scale", "0.2"])
    assert again.exit_code == 0 and "building the length index" not in again.output


@pytest.mark.slow  # the demo on 4 real rank pipelines, three runs, packing (about 30 s)
def test_demo_plans_the_packs_of_a_packing_recipe(tmp_path):
    recipe = yaml.safe_load((Path(__file__).parent.parent / "recipes" / "demo.yaml").read_text())
    recipe.update(packing_buffer_size=64, pack_seq_length=8192)
    path = tmp_path / "demo_packs.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = CliRunner().invoke(main, ["demo", "--out", str(tmp_path), "--recipe", str(path),
                                    "--ranks", "4", "--steps", "24", "--scale", "0.2",
                                    "--batch-size", "1"])
    assert res.exit_code == 0, res.output
    header = next(line for line in res.output.splitlines()
                  if line.startswith(" ") and line.lstrip().startswith("pool off"))
    # planned_mix 'window' does not plan packs: the recipe's mix, said so
    # packed step: 32 steps, here fewer (one epoch of the small data's sources at most)
    found = re.search(r"planned \(K=(\d+), step\)", header)
    assert found and 1 <= int(found.group(1)) < 32, header
    assert "planned run: the recipe's planned_mix (with packing the plan builds the packs" in \
        res.output
    assert "packs per step here, each pack built to its step's cap" in res.output
