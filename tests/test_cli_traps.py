"""The CLI's traps for a new user (issue 34): every one answered in one `Error:` line (exit code
2) naming the input and the fix before any work, or, for the warnings, one short line where
there is something to say."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from energon_ordering import OrderingConfig
from energon_ordering.cli import main
from energon_ordering.cli.tables import advice_tables, measure_table
from energon_ordering.errors import LengthIndexError, OrderingConfigError
from energon_ordering.inspect.advise import (
    Advice,
    LengthPopulation,
    predict_order,
    recommend,
)
from energon_ordering.inspect.inspection import Measurement
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.length_index.build import build_length_index

from indexed_data import indexed_synthetic

SOURCES = [SourceSpec(n, 40, "short") for n in ("web", "code", "curated")]
PLANNED = {"length_sort_mode": "planned", "length_sort_placement": "pre-encode",
           "length_sort_pool_holds": "keys"}
ESTIMATE = "energon_ordering.inspect.length_estimate:LengthEstimateTaskEncoder"


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def unindexed(tmp_path_factory) -> Path:
    """A metadataset of three small sources without length indexes."""
    return make_synthetic_dataset(tmp_path_factory.mktemp("unindexed"), SOURCES, shard_size=20)


@pytest.fixture(scope="module")
def indexed(tmp_path_factory) -> Path:
    """The same sources, indexed by IndexedSyntheticTaskEncoder (not the CLI's estimate)."""
    return indexed_synthetic(tmp_path_factory.mktemp("indexed"), SOURCES, shard_size=20)


@pytest.fixture
def planned_recipe(tmp_path) -> Path:
    path = tmp_path / "planned.yaml"
    path.write_text(yaml.safe_dump(PLANNED))
    return path


def _one_error_line(res, *needles: str) -> str:
    """The whole output is one line `Error: ...` (no traceback, nothing printed before it)."""
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), res.exception
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---- the demo's planned run --------------------------------------------------------------------


def test_the_planned_run_of_a_pool_recipe_drops_what_planned_mode_refuses():
    """The demo's recipe (a deterministic blend policy) runs in the planned order too."""
    from energon_ordering.cli.inspect import as_planned

    recipe = Path(__file__).parent.parent / "recipes" / "demo.yaml"
    cfg = OrderingConfig.from_yaml(recipe)
    assert cfg.blend_policy == "deterministic"
    planned = as_planned(cfg)
    assert planned.planned and planned.blend_policy == "random"
    assert planned.mixture_schedule == cfg.mixture_schedule


# ---- --out ------------------------------------------------------------------------------------


def test_an_out_folder_that_cannot_be_written_is_refused_before_anything_is_printed(
        runner, tmp_path, unindexed):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out in ("/proc/x", str(a_file / "sub")):
        res = runner.invoke(main, ["demo", "--out", out, "--scale", "0.01"])
        _one_error_line(res, f"--out {out}: cannot write", "pass a folder you can write to")
        res = runner.invoke(main, ["inspect", str(unindexed), "--recipe", "demo", "--out", out])
        _one_error_line(res, f"--out {out}: cannot write inspect.png")
        res = runner.invoke(main, ["advise", str(unindexed), "--ranks", "2", "--micro-batch",
                                   "4", "--out", out])
        _one_error_line(res, f"--out {out}: cannot write advise.png")
    assert not (tmp_path / "a_file").is_dir()


# ---- index --name -----------------------------------------------------------------------------


def test_index_refuses_a_name_that_is_not_a_plain_name(runner, unindexed, tmp_path):
    folder = unindexed.parent / "web"
    for name in ("../../evil", "a/b", ".hidden", ".."):
        res = runner.invoke(main, ["index", str(folder), "--name", name])
        _one_error_line(res, f"--name '{name}' is not a plain name", "e.g. my_encoder")
    assert not list(unindexed.parent.parent.glob("*evil*"))
    assert not list((folder / ".nv-meta").glob("energon_ordering_lengths*"))
    with pytest.raises(LengthIndexError, match=r"name '\.\./x' is not a plain name"):
        build_length_index(folder, raw_length_fn=len, name="../x")


# ---- a folder holding a metadataset -----------------------------------------------------------


def test_a_folder_holding_a_metadataset_points_at_it(runner, unindexed, tmp_path):
    folder = unindexed.parent  # like the demo's energon_ordering_demo/data_5200
    for args in (["inspect", str(folder), "--recipe", "demo", "--out", str(tmp_path)],
                 ["check-resume", str(folder), "--recipe", "demo", "--cut", "1"],
                 ["advise", str(folder), "--ranks", "2", "--micro-batch", "4",
                  "--out", str(tmp_path)]):
        _one_error_line(runner.invoke(main, args), f"{folder} is not a prepared Energon dataset",
                        f"did you mean {'DATASET' if args[0] == 'advise' else 'METADATASET'} "
                        f"{folder / 'metadataset.yaml'}?")


# ---- recipes and sizes ------------------------------------------------------------------------


def test_a_negative_source_size_names_the_option(runner, tmp_path):
    recipe = Path(__file__).parent.parent / "recipes" / "slm_350m_20b.yaml"
    res = runner.invoke(main, ["plan", str(recipe), "--global-batch-size", "8", "--source-sizes",
                               "web=-5,code=10,books=10,curated=10", "--out", str(tmp_path)])
    line = _one_error_line(res, "--source-sizes 'web=-5'", "web=SAMPLES with SAMPLES >= 1")
    assert "implied_epochs" not in line


def test_a_mistyped_recipe_key_gets_did_you_mean(runner, tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("length_sort_pool_sise: 64\nlength_sort_mode: batch\n")
    res = runner.invoke(main, ["plan", str(recipe), "--global-batch-size", "8",
                               "--total-steps", "10", "--out", str(tmp_path)])
    _one_error_line(res, "'length_sort_pool_sise': did you mean 'length_sort_pool_size'?")
    with pytest.raises(OrderingConfigError, match="'micro_batch_per_step': did you mean "
                                                  "'micro_batches_per_step'"):
        OrderingConfig.from_dict({"micro_batch_per_step": 2})
    with pytest.raises(OrderingConfigError) as e:  # nothing close: no guess
        OrderingConfig.from_dict({"zzz": 2})
    assert "did you mean" not in str(e.value)


def test_a_metadataset_given_as_the_recipe_says_which_is_which(runner, unindexed, tmp_path):
    """The two YAML files swapped: the metadataset is named as a dataset description, not
    listed as unknown settings (__module__, __class__, splits)."""
    for args in (["plan", str(unindexed), "--global-batch-size", "8", "--out", str(tmp_path)],
                 ["inspect", str(unindexed), "--recipe", str(unindexed), "--out", str(tmp_path)]):
        line = _one_error_line(runner.invoke(main, args), "is an Energon (meta)dataset description",
                               "pass it as the dataset (METADATASET)")
        assert "unknown setting" not in line


# ---- the missing length indexes ---------------------------------------------------------------


def test_every_dataset_without_a_length_index_is_named(runner, unindexed, planned_recipe,
                                                       tmp_path):
    folders = [str(unindexed.parent / s.name) for s in SOURCES]
    for args in (["inspect", str(unindexed), "--recipe", str(planned_recipe), "--steps", "4",
                  "--out", str(tmp_path)],
                 ["check-resume", str(unindexed), "--recipe", str(planned_recipe), "--cut", "1",
                  "--steps", "2"]):
        _one_error_line(runner.invoke(main, args), "no length index for 3 dataset(s)",
                        ", ".join(folders), f"`energon-ordering index {unindexed}`")


# ---- the index computed by another encoder ----------------------------------------------------


def _run_recording(runner, args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    return res, [str(w.message) for w in caught if "was computed by" in str(w.message)]


def test_an_index_of_another_encoder_is_one_line_and_only_with_task_encoder(
        runner, indexed, planned_recipe, tmp_path):
    """The demo's data: indexed by the demo's encoder, read by the CLI's estimate. Expected,
    so silent; with --task-encoder a real mismatch: one line."""
    inspect = ["inspect", str(indexed), "--recipe", str(planned_recipe), "--ranks", "2",
               "--steps", "4", "--out", str(tmp_path)]
    check = ["check-resume", str(indexed), "--recipe", str(planned_recipe), "--cut", "2",
             "--steps", "4"]
    for args in (inspect, check):
        res, escaped = _run_recording(runner, args)
        assert escaped == [] and "UserWarning" not in res.output and "note:" not in res.output
        res, escaped = _run_recording(runner, [*args, "--task-encoder", ESTIMATE])
        assert escaped == [] and "UserWarning" not in res.output
        notes = [ln for ln in res.output.splitlines() if ln.startswith("note:")]
        assert len(notes) == 1, res.output
        assert notes[0].startswith(f"note: 3 dataset(s) of {indexed} have length indexes "
                                   "computed by IndexedSyntheticTaskEncoder, not by "
                                   f"--task-encoder {ESTIMATE}")


# ---- advise --no-measure ----------------------------------------------------------------------


def _advice(sources: tuple[str, ...], share: int, costs=()) -> Advice:
    rng = np.random.default_rng(0)
    lengths = np.sort(np.concatenate([rng.lognormal(5.3, 0.4, 2000), rng.lognormal(7, 0.3, 2000)]))
    ids = (lengths > 700).astype(np.int64) if len(sources) > 1 else np.zeros(4000, np.int64)
    pop = LengthPopulation(lengths, ids, sources, "test")
    kw = dict(batch_size=4, ranks=(8, 64), step_ranks=8, steps=64)
    preds = [predict_order(pop, mode="off", pool_size=0, **kw)]
    preds += [predict_order(pop, mode=m, pool_size=n, **kw) for m in ("batch", "sample")
              for n in (800, 1000, 10_000)]
    rec, reason = recommend(preds, list(costs), ranks=8, memory_budget=2**30, share=share)
    return Advice(pop, 8, 4, preds, list(costs), 2**30, rec, reason, (8, 64), 2, 12_800, share)


def test_advise_without_measuring_recommends_from_idle_and_padding():
    adv = _advice(("code", "web"), 1000)
    assert adv.recommended is not None
    placement, holds, mode, size = adv.recommended
    assert (placement, holds) == ("post-encode", "raw") and mode in ("batch", "sample")
    assert size <= 1000
    assert adv.reason.startswith("--no-measure: chosen from idle and padding alone")


def test_advise_no_measure_is_documented(runner):
    res = runner.invoke(main, ["advise", "-h"])
    assert "--no-measure skips that" in " ".join(res.output.split())
    assert "recommends from the predicted idle and padding alone" in " ".join(res.output.split())


@pytest.mark.slow  # advise predicts every pool size at five rank counts: ~15 s
def test_advise_no_measure_says_so(runner, unindexed, tmp_path):
    res = runner.invoke(main, ["advise", str(unindexed), "--ranks", "2", "--micro-batch", "4",
                               "--steps", "16", "--no-measure", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "recommended: length_sort_pool_size: " in res.output
    assert "--no-measure: chosen from idle and padding alone" in res.output


# ---- one source: no nan -----------------------------------------------------------------------


def test_single_source_tables_print_a_dash_not_nan():
    adv = _advice(("web",), 1000)
    text = advice_tables(adv)
    assert "nan" not in text
    row = next(ln for ln in text.splitlines() if ln.startswith("pool off"))
    assert row.split()[-2:] == ["-", "-"]  # disp/mb, disp/step
    one = Measurement(0.1, 0.2, 1000.0, float("nan"), 0.0, 0, False, {}, ("web",))
    two = Measurement(0.1, 0.2, 1000.0, 0.9, 1.1, 0, False, {}, ("web", "code"))
    table = measure_table({"pool off": one, "pool 16 (batch)": two})
    assert "nan" not in table
    row = next(ln for ln in table.splitlines() if ln.startswith("  per optimizer step"))
    assert row.split()[-2:] == ["-", "1.10"]
    assert "straggler idle, per micro-batch" in table
