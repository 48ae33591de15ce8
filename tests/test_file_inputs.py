"""Bad input read from files (recipes, schedules, metadatasets, length indexes and their flat
lengths files) and settings that cannot work is refused with one typed line naming the file or
field, the value and the fix; on the CLI with exit code 2 and one ``Error:`` line (issue 31).

Real prepared datasets and length indexes (``energon prepare`` in ``tmp_path``), real
``get_train_dataset`` + ``get_savable_loader`` pipelines.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from energon_ordering import MixtureSchedule, OrderingConfig, OrderingConfigError
from energon_ordering.cli import main
from energon_ordering.errors import LengthIndexError
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, run_ranks
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.build import build_length_index
from energon_ordering.length_index.index import LengthIndex, length_index_files
from energon_ordering.length_index.lengths_check import check_lengths_file
from energon_ordering import failed_epoch
from energon_ordering.pipeline.plan import BuildArgs, plan_pipeline
from energon_ordering.yaml_file import MAX_FILE_BYTES, load_yaml

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

PLANNED = dict(length_sort_mode="planned", length_sort_placement="pre-encode",
               length_sort_pool_holds="keys")


def planned(**kw) -> OrderingConfig:
    return OrderingConfig(**{**PLANNED, "micro_batches_per_step": 2, "plan_window_steps": 2, **kw})


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> Path:
    """Two indexed sources (web 0.7, code 0.3) and their metadataset."""
    return indexed_synthetic(
        tmp_path_factory.mktemp("file_inputs"),
        [SourceSpec("web", 64, "short", weight=0.7), SourceSpec("code", 48, "long", weight=0.3)],
        shard_size=16)


# ---- recipes and schedules (yaml_file.load_yaml: every reader) --------------------------------


def _recipe(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "recipe.yaml"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n", "~\n"])
def test_an_empty_recipe_is_refused_not_read_as_all_defaults(tmp_path, content):
    path = _recipe(tmp_path, content)
    with pytest.raises(OrderingConfigError, match=rf"{path} is empty .*every setting would "
                                                  r"silently take its default"):
        OrderingConfig.from_yaml(path)


def test_a_key_given_twice_is_refused_naming_the_key_and_lines(tmp_path):
    path = _recipe(tmp_path, "seed: 1\nlength_sort_mode: batch\nseed: 2\n")
    with pytest.raises(OrderingConfigError, match=r"gives the key 'seed' twice in one mapping "
                                                  r"\(lines 1 and 3\).*remove one"):
        OrderingConfig.from_yaml(path)
    nested = _recipe(tmp_path, "mixture_schedule:\n  total_steps: 10\n  sources:\n"
                               "    web: {weight: 1}\n    web: {weight: 2}\n")
    with pytest.raises(OrderingConfigError, match=r"the key 'web' twice .*lines 4 and 5"):
        OrderingConfig.from_yaml(nested)
    # YAML's merge key (<<) may be overridden: not a duplicate
    merged = _recipe(tmp_path, "base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n")
    assert load_yaml(merged, "test")["other"] == {"x": 3, "y": 2}


def test_a_binary_recipe_is_a_typed_error(tmp_path):
    path = _recipe(tmp_path, b"seed: 1\n\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(OrderingConfigError, match=rf"{path} is not a UTF-8 text file \(byte 8 is "
                                                  r"0x89\).*right file"):
        OrderingConfig.from_yaml(path)
    with pytest.raises(OrderingConfigError, match="not a UTF-8 text file"):
        MixtureSchedule.from_yaml(path)


@pytest.mark.parametrize("command", [
    ["plan", "{recipe}", "--global-batch-size", "8"],
    ["check-resume", "{data}", "--recipe", "{recipe}", "--cut", "2"],
])
@pytest.mark.parametrize("content, says", [(b"\x89PNG\r\n\x1a\n\xff\xfe\x00", "not a UTF-8"),
                                           (b"", "is empty"),
                                           (b"seed: 1\nseed: 2\n", "the key 'seed' twice")])
def test_the_cli_refuses_a_bad_recipe_in_one_line(tmp_path, two_sources, command, content, says):
    recipe = _recipe(tmp_path, content)
    args = [a.format(data=two_sources, recipe=recipe) for a in command]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and str(recipe) in lines[0] and says in lines[0], result.output
    assert "Traceback" not in result.output


def test_a_huge_recipe_is_refused_by_its_size_before_it_is_parsed(tmp_path):
    """200,000 phases (10 MB) were composed for 7 minutes and 1.5 GB, then blamed on aliases."""
    lines = ["total_steps: 1000000", "phases:"]
    lines += [f"  - {{until: {i + 1}, weights: {{web: 0.5, code: 0.5}}}}" for i in range(200_000)]
    path = _recipe(tmp_path, "mixture_schedule:\n" + "\n".join("  " + x for x in lines) + "\n")
    assert path.stat().st_size > 10 * 2**20 > MAX_FILE_BYTES
    with pytest.raises(OrderingConfigError, match=rf"{path} is [0-9,]+ bytes, over the limit of "
                                                  r"1,048,576 .*knots") as e:
        OrderingConfig.from_yaml(path)
    assert "alias" not in str(e.value).replace(str(path), "")


def test_many_nodes_without_aliases_are_not_blamed_on_aliases(tmp_path):
    path = _recipe(tmp_path, "phases: [" + ",".join(["1"] * 100_001) + "]\n")
    with pytest.raises(OrderingConfigError, match=r"holds more than 100,000 YAML nodes") as e:
        load_yaml(path, "test")
    assert "alias" not in str(e.value).replace(str(path), "")


def test_too_many_phases_are_refused_before_they_are_checked():
    phases = [{"until": i + 1, "weights": {"a": 1, "b": 1}} for i in range(10_001)]
    with pytest.raises(OrderingConfigError, match=r"phases: 10,001 phases, over the limit of "
                                                  r"10,000.*knots"):
        MixtureSchedule.from_dict({"phases": phases})


# ---- steps and windows that overflow or cannot be planned -----------------------------------


def test_a_total_steps_beyond_2_53_is_refused():
    """10^30 with a phased schedule was an untyped OverflowError at the first weights(step)."""
    phased = {"phases": [{"until": 0.5, "weights": {"a": 1, "b": 1}},
                         {"until": 1.0, "weights": {"a": 1, "b": 2}}]}
    with pytest.raises(OrderingConfigError, match=r"OrderingConfig.total_steps = 10{30} must be "
                                                  r">= 1 and <= 9,007,199,254,740,992 \(2\^53"):
        OrderingConfig(total_steps=10**30, mixture_schedule=phased)
    with pytest.raises(OrderingConfigError, match=r"total_steps = 10{30} is over the limit"):
        MixtureSchedule.from_dict({**phased, "total_steps": 10**30})
    with pytest.raises(OrderingConfigError, match=r"phase 0: until = 10{20} must be a step >= 1 "
                                                  r"and <= 9,007,199,254,740,992"):
        MixtureSchedule.from_dict({"phases": [{"until": 10**20, "weights": {"a": 1}}]})
    with pytest.raises(OrderingConfigError, match=r"knot step 10{20} is over the largest step"):
        MixtureSchedule.from_dict({"sources": {"a": {"weight": {"linear": {0: 1, 10**20: 2}}}}})
    # the largest accepted still evaluates
    big = OrderingConfig(total_steps=2**53, mixture_schedule=phased).mixture_schedule
    assert big.weights(2**52 + 1) is not None


@pytest.mark.parametrize("k", [10**6, 10**9, 1025])
def test_a_window_longer_than_the_limit_is_refused_by_the_config(k):
    with pytest.raises(OrderingConfigError, match=rf"plan_window_steps = {k} is over the limit of "
                                                  r"1,024.*steps squared"):
        planned(plan_window_steps=k, planned_mix="step")
    assert planned(plan_window_steps=1024, planned_mix="step").plan_window_steps == 1024


def test_a_window_plan_larger_than_a_worker_may_hold_is_refused_where_the_shape_is_known():
    cfg = planned(plan_window_steps=1024, micro_batches_per_step=16)
    args = dict(batch_size=8, world_size=256)
    with pytest.raises(OrderingConfigError, match=r"plan_window_steps = 1,024: a window plans "
                                                  r"K x R x M x B = 1,024 steps x 256 ranks x 16 "
                                                  r"micro-batches x 8 samples = 33,554,432 samples"
                                                  r".*use plan_window_steps <= 512"):
        plan_pipeline(cfg, BuildArgs(**args))
    plan_pipeline(planned(plan_window_steps=512, micro_batches_per_step=16), BuildArgs(**args))
    huge_step = BuildArgs(batch_size=2**14, world_size=2**11)
    with pytest.raises(OrderingConfigError, match=r"a single step is over it"):
        plan_pipeline(planned(plan_window_steps=1, micro_batches_per_step=1), huge_step)


# ---- settings that do nothing in the planned order ------------------------------------------


@pytest.mark.parametrize("name, value", [("length_sort_pool_ramp", True),
                                         ("length_sort_pool_ramp", False),
                                         ("blend_policy", "deterministic"),
                                         ("schedule_lag_compensation", False)])
def test_pool_and_blend_settings_are_refused_in_the_planned_order(name, value):
    with pytest.raises(OrderingConfigError, match=rf"OrderingConfig.{name} = {value!r} does "
                                                  r"nothing under length_sort_mode = 'planned'.*"
                                                  rf"Drop {name}"):
        planned(**{name: value})
    cfg = planned()  # the defaults are fine, and round-trip
    assert OrderingConfig.from_dict(cfg.to_dict()) == cfg


# ---- metadataset weights ---------------------------------------------------------------------


def test_a_negative_metadataset_weight_is_refused_in_the_planned_order(two_sources):
    """It was an untyped ``negative dimensions are not allowed`` at the first batch."""
    bad = two_sources.parent / "negative.yaml"
    bad.write_text(two_sources.read_text().replace("weight: 0.3", "weight: -1"))
    assert "weight: -1" in bad.read_text()
    with pytest.raises(OrderingConfigError, match=r"the metadataset's blend weights are .*-2.33"
                                                  r".*give every `blend:` entry a finite weight "
                                                  r">= 0"):
        run_ranks(bad, ordering=planned(), world_size=1, steps=2, batch_size=4,
                  task_encoder_factory=IndexedSyntheticTaskEncoder)


# ---- the length index and the planned order's flat lengths file -----------------------------


@pytest.fixture()
def web(tmp_path) -> Path:
    """One indexed source of 70 samples (its lengths file written by the index build)."""
    indexed_synthetic(tmp_path, [SourceSpec("web", 70, "trimodal")], shard_size=16)
    return tmp_path / "web"


def _lengths_file(folder: Path) -> Path:
    [path] = sorted((folder / ".nv-meta").glob("*.split-*.npy"))
    return path


def _damage(path: Path, how: str) -> None:
    values = np.load(path)
    if how == "half":
        np.save(path, values[: len(values) // 2])
    elif how == "double":
        np.save(path, np.concatenate([values, values]))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-40])
    elif how in ("nan", "negative"):
        values[3] = np.nan if how == "nan" else -5
        np.save(path, values)


LENGTHS_FILE_REFUSALS = {
    "half": r"holds 35 lengths, but the split of .* has 70 samples \(every epoch would silently "
            r"skip the samples it lacks\).*delete .*rebuilt from the length index",
    "double": r"holds 140 lengths, but the split of .* has 70 samples \(the plan would draw "
              r"samples the split does not have\)",
    "truncated": r"is truncated or damaged \(.*\); delete .*rebuilt from the length index",
    "nan": r"holds length nan for sample 3 .*finite number >= 0",
    "negative": r"holds length -5.0 for sample 3 .*finite number >= 0",
}


@pytest.mark.parametrize("how", list(LENGTHS_FILE_REFUSALS))
def test_a_damaged_lengths_file_is_refused(web, how):
    path = _lengths_file(web)
    check_lengths_file(path, samples=70, dataset=web)  # sound as written
    _damage(path, how)
    with pytest.raises(LengthIndexError, match=LENGTHS_FILE_REFUSALS[how]):
        check_lengths_file(path, samples=70, dataset=web)


@pytest.mark.parametrize("how", ["half", "truncated"])
def test_a_planned_run_refuses_a_damaged_lengths_file(web, how):
    """Before: half the file silently ran half an epoch; a truncated one was numpy's untyped
    ``mmap length is greater than file size``."""
    _damage(_lengths_file(web), how)
    with pytest.raises(LengthIndexError, match=LENGTHS_FILE_REFUSALS[how]):
        run_ranks(web, ordering=planned(), world_size=1, steps=None, batch_size=4, repeat=False,
                  task_encoder_factory=IndexedSyntheticTaskEncoder)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_an_index_build_refuses_a_length_that_is_not_a_finite_count(web, bad):
    def length(raw):
        return bad

    with pytest.raises(LengthIndexError, match=rf"the length of sample 'web-00000000' is {bad}; "
                                               r"it must be a finite number >= 0 \(tokens\): fix "
                                               r"raw_length_fn .*length, which computed it"):
        build_length_index(web, raw_length_fn=length, name="bad")
    assert "bad" not in length_index_files(web)


def test_index_rows_edited_in_place_are_refused_at_open(web):
    """Before: opened silently; a state saved with the old lengths restored into another
    order (its digest, unchanged, matched)."""
    index = LengthIndex.open(web)
    con = sqlite3.connect(index.path)
    con.execute("UPDATE lengths SET length = length + 100 WHERE sample_key = 'web-00000007'")
    con.commit()
    con.close()
    with pytest.raises(LengthIndexError, match=rf"{index.path} was edited after its build: its "
                                               r"rows now have content digest '[0-9a-f]+', its "
                                               rf"meta table says '{index.digest}'.*Build it with"):
        LengthIndex.open(web)


def test_a_rewrite_that_keeps_the_rows_is_accepted(web):
    index = LengthIndex.open(web)
    con = sqlite3.connect(index.path)
    con.execute("VACUUM")
    con.close()
    assert LengthIndex.open(web).digest == index.digest


# ---- the CLI: --split-part and --length-index ------------------------------------------------


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    [line] = [x for x in result.output.splitlines() if x.startswith("Error:")]
    return line


def test_index_refuses_a_split_part_the_dataset_lacks_in_one_line(web, two_sources):
    """Before: a 19-frame traceback from Energon (an assert; a KeyError for a metadataset)."""
    line = _one_error_line(CliRunner().invoke(main, ["index", str(web), "--split-part", "bogus"]))
    assert "split_part = 'bogus' (--split-part) is not a split of it; its splits are ['train', " \
           "'val', 'test']. Index the split you train on" in line
    line = _one_error_line(CliRunner().invoke(main, ["index", str(two_sources),
                                                     "--split-part", "bogus"]))
    assert f"{two_sources}: split_part = 'bogus'" in line and "splits are ['train']" in line


def test_advise_refuses_an_ambiguous_length_index_naming_the_indexes(web):
    build_length_index(web, raw_length_fn=lambda raw: 5.0, name="flat")
    args = ["advise", str(web), "--ranks", "2", "--micro-batch", "4", "--no-measure",
            "--steps", "16", "--out", str(web.parent)]
    line = _one_error_line(CliRunner().invoke(main, args))
    assert (f"{web} has several length indexes (energon_ordering.inspect.synthetic_task."
            "IndexedSyntheticTaskEncoder, flat) and none is unnamed; choose one with "
            "--length-index NAME.") in line
    line = _one_error_line(CliRunner().invoke(main, [*args, "--length-index", "nope"]))
    assert "--length-index nope: " in line and "its indexes are " in line


def test_advise_reads_the_length_index_it_is_given(web):
    build_length_index(web, raw_length_fn=lambda raw: 5.0, name="flat")
    result = CliRunner().invoke(main, ["advise", str(web), "--ranks", "2", "--micro-batch", "4",
                                       "--no-measure", "--steps", "16", "--out", str(web.parent),
                                       "--length-index", "flat"])
    assert result.exit_code == 0, result.output
    assert "lengths: length index" in result.output and "mean 5 tokens" in result.output


def test_index_takes_the_name_as_length_index_too(tmp_path):
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 32, "short")], shard_size=16)
    result = CliRunner().invoke(main, ["index", str(tmp_path / "web"), "--length-index", "est"])
    assert result.exit_code == 0, result.output
    assert list(length_index_files(tmp_path / "web")) == ["est"]


# ---- a loader iterated again after a failed iteration ----------------------------------------


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_loader_iterated_again_after_a_length_index_error_raises(web, num_workers):
    """Before: with a loader worker the second epoch was empty without a word (Energon keeps
    the finished epoch generator); without workers it went on from the pool the error broke."""
    failed_epoch.install()  # the lead installs it with the package (see the module)
    cfg = OrderingConfig(length_sort_pool_size=16, length_sort_mode="batch",
                         length_sort_placement="pre-encode", length_sort_pool_holds="keys")
    loader = build_train_loader(web, ordering=cfg, batch_size=4, num_workers=num_workers,
                                repeat=False, task_encoder_factory=IndexedSyntheticTaskEncoder)
    try:
        index = LengthIndex.open(web)
        con = sqlite3.connect(index.path)  # a row lost under the running job
        con.execute("DELETE FROM lengths WHERE sample_key = 'web-00000040'")
        con.commit()
        con.close()
        with pytest.raises(LengthIndexError, match=r"sample 'web-00000040' .* is not in"):
            list(loader)
        for _ in range(2):
            with pytest.raises(LengthIndexError, match=r"this loader's iteration stopped with "
                                                       r"LengthIndexError: .*web-00000040.*build "
                                                       r"a new loader and restore"):
                list(loader)
    finally:
        close_loader(loader)
