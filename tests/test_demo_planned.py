"""The planned order in ``inspect`` (a planned recipe runs, its column names the mode) and in
the demo (a third run beside no pool and the pool)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from energon_ordering.cli import main
from energon_ordering.cli.inspect import planned_repeats
from energon_ordering.inspect.rank_simulation import BatchRecord
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering import OrderingConfig

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

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
    assert "planned (K=4)" in header and "pool 0" not in header
    overlap = next(line for line in res.output.splitlines() if line.startswith("keys on two"))
    assert overlap.split()[-2:] == ["0", "0*"], overlap
    assert "planned (K=4): length_sort_mode: planned" in res.output
    assert (tmp_path / "inspect.png").stat().st_size > 10_000


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
    assert "planned (K=4)" in header
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
    header = next(line for line in res.output.splitlines()  # not the progress lines
                  if line.startswith(" ") and line.lstrip().startswith("pool off"))
    assert header.split() == ["pool", "off", "pool", "256", "(batch)", "planned", "(K=32)"]
    assert "The planned run: every step holds each source's scheduled share" in res.output
    results = json.loads((tmp_path / "results.json").read_text())
    plan, off = results["planned (K=32)"], results["pool off"]
    assert plan["overlapping_keys"] == 0 and results["resume_identical"] is True
    # exact per step: the scheduled mix in every step, unlike the pool's
    assert plan["step_histogram_dispersion"] < results["pool 256 (batch)"]["step_histogram_dispersion"]
    assert plan["straggler_idle"] < off["straggler_idle"]
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
    assert "planned (K=32)" in header
    assert "packs per step here, each built to its step's cap" in res.output
