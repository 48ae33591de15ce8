"""The energon-ordering CLI through click's CliRunner: every command and every user error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from energon_ordering import __version__
from energon_ordering.cli import main
from energon_ordering.packaged_recipes import recipe_dir, recipe_names

RECIPES = Path(__file__).parent.parent / "recipes"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_ok(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, path


@pytest.fixture
def runner():
    return CliRunner()


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "total_steps": 60,
        "blend_policy": "deterministic",
        "mixture_schedule": {"phases": [
            {"until": 0.5, "weights": {"web": 0.6, "code": 0.3, "curated": 0.1}},
            {"until": 1.0, "weights": {"web": 0.2, "code": 0.2, "curated": 0.6}}]},
        "seq_length_warmup": {"start": 128, "full": 1024, "warmup_steps": 20},
        "length_sort_pool_size": 32,
        "length_sort_mode": "batch",
    }))
    return path


def test_help_and_version(runner):
    res = runner.invoke(main, ["-h"])
    assert res.exit_code == 0 and "demo" in res.output and "check-resume" in res.output
    res = runner.invoke(main, ["--version"])
    assert res.exit_code == 0 and __version__ in res.output
    for cmd in ("demo", "plan", "inspect", "check-resume", "index"):
        res = runner.invoke(main, [cmd, "-h"])
        assert res.exit_code == 0 and "[default:" in res.output, cmd


def test_plan_with_source_sizes(runner, tmp_path):
    res = runner.invoke(main, ["plan", str(RECIPES / "slm_350m_20b.yaml"), "--total-steps", "19073",
                               "--global-batch-size", "512", "--source-sizes",
                               "web=40000000,code=5000000,books=2000000,curated=200000",
                               "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "17,164" in res.output and "17,165" in res.output  # the anneal boundary, both sides
    assert "curated" in res.output and "!" in res.output  # curated repeats > 4 epochs
    assert "warning: implied epochs above 4.0" in res.output
    assert "max_seq_len" in res.output and "2,048" in res.output
    assert "Sequence packing: buffer of 256 samples, packs of 2,048 tokens" in res.output
    assert "500 packs per loader worker after packing" in res.output
    _png_ok(tmp_path / "plan.png")


def test_plan_with_metadataset(runner, three_sources, recipe, tmp_path):
    res = runner.invoke(main, ["plan", str(recipe), "--total-steps", "60", "--global-batch-size", "32",
                               "--metadataset", str(three_sources), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "2,000" in res.output and "500" in res.output  # sizes read from the metadataset
    _png_ok(tmp_path / "plan.png")


def test_plan_errors(runner, tmp_path, recipe):
    res = runner.invoke(main, ["plan", str(tmp_path / "nope.yaml"), "--total-steps", "10",
                               "--global-batch-size", "8"])
    assert res.exit_code == 2 and "does not exist" in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("length_sort_mode: sorted\n")
    res = runner.invoke(main, ["plan", str(bad), "--total-steps", "10", "--global-batch-size", "8"])
    assert res.exit_code == 2 and "length_sort_mode = 'sorted' is unknown" in res.output
    res = runner.invoke(main, ["plan", str(recipe), "--total-steps", "0", "--global-batch-size", "8"])
    assert res.exit_code == 2 and "--total-steps" in res.output
    res = runner.invoke(main, ["plan", str(recipe), "--total-steps", "60", "--global-batch-size", "8",
                               "--source-sizes", "web=lots"])
    assert res.exit_code == 2 and "NAME=SAMPLES" in res.output
    res = runner.invoke(main, ["plan", str(recipe), "--total-steps", "60", "--global-batch-size", "8",
                               "--source-sizes", "web=10"])
    assert res.exit_code == 2 and "no size for ['code', 'curated']" in res.output


def test_inspect(runner, three_sources, recipe, tmp_path):
    res = runner.invoke(main, ["inspect", str(three_sources), "--recipe", str(recipe), "--ranks", "4",
                               "--steps", "40", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for row in ("straggler idle", "padding waste", "tokens per step", "dispersion",
                "keys on two ranks (must be 0)", "sawtooth"):
        assert row in res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("keys on two ranks"))
    assert line.split()[-2:] == ["0", "0"]
    _png_ok(tmp_path / "inspect.png")


def test_inspect_with_your_own_task_encoder(runner, three_sources, recipe, tmp_path):
    res = runner.invoke(main, ["inspect", str(three_sources), "--recipe", str(recipe), "--ranks", "2",
                               "--steps", "20", "--out", str(tmp_path), "--task-encoder",
                               "energon_ordering.inspect.synthetic_task:SyntheticTaskEncoder"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["inspect", str(three_sources), "--recipe", str(recipe),
                               "--task-encoder", "energon_ordering.inspect.synthetic:SourceSpec"])
    assert res.exit_code == 2 and "OrderingTaskEncoder mixin" in res.output
    res = runner.invoke(main, ["inspect", str(three_sources), "--recipe", str(recipe),
                               "--task-encoder", "no_such_module:X"])
    assert res.exit_code == 2 and "cannot import it" in res.output


def test_inspect_errors(runner, three_sources, recipe, tmp_path):
    res = runner.invoke(main, ["inspect", str(three_sources), "--recipe", str(recipe), "--ranks", "0"])
    assert res.exit_code == 2 and "--ranks" in res.output
    res = runner.invoke(main, ["inspect", str(tmp_path / "missing"), "--recipe", str(recipe)])
    assert res.exit_code == 2 and "does not exist" in res.output
    other = tmp_path / "other.yaml"
    other.write_text("mixture_schedule: {sources: {web: {weight: 1}, books: {weight: 1}}}\n")
    res = runner.invoke(main, ["inspect", str(three_sources), "--recipe", str(other), "--steps", "5"])
    assert res.exit_code == 2 and "no dataset for ['books']" in res.output


def test_check_resume(runner, three_sources, recipe):
    res = runner.invoke(main, ["check-resume", str(three_sources), "--recipe", str(recipe),
                               "--cut", "13", "--steps", "40"])
    assert res.exit_code == 0, res.output
    assert "the next 27 micro-batches are identical" in res.output


def test_check_resume_errors(runner, three_sources, recipe):
    res = runner.invoke(main, ["check-resume", str(three_sources), "--recipe", str(recipe),
                               "--cut", "50", "--steps", "40"])
    assert res.exit_code == 2 and "cut 50 must be below --steps 40" in res.output
    res = runner.invoke(main, ["check-resume", str(three_sources), "--recipe", str(recipe)])
    assert res.exit_code == 2 and "--cut" in res.output


@pytest.mark.slow  # the demo on 4 real rank pipelines, pool off and on, with a cut
def test_demo_end_to_end_small(runner, tmp_path):
    res = runner.invoke(main, ["demo", "--out", str(tmp_path), "--ranks", "4", "--steps", "60",
                               "--scale", "0.2"])
    assert res.exit_code == 0, res.output
    assert "pool off" in res.output and "pool 256 (batch)" in res.output
    assert "Implied epochs" in res.output
    assert "are identical" in res.output
    for term in ("lost compute: ", "straggler idle: ", "per optimizer step: ",
                 "per micro-batch: ", "padding waste: ", "source histogram dispersion:",
                 "sawtooth at shard period:", "Why the mix is noisy with the pool"):
        assert term in res.output
    assert "results.json" in res.output and "MB, reused by the next run" in res.output
    results = json.loads((tmp_path / "results.json").read_text())
    off, on = results["pool off"], results["pool 256 (batch)"]
    # the per-step dispersion: the pool reorders by length, so steps are clumped by source
    assert on["step_histogram_dispersion"] > off["step_histogram_dispersion"] > 0
    assert on["straggler_idle"] < off["straggler_idle"]
    assert on["lost_compute"] < off["lost_compute"]
    for run in (on, off):
        assert run["lost_compute"] == pytest.approx(run["idle_per_step"]
                                                    + run["padding_by_tokens"])
    assert on["overlapping_keys"] == off["overlapping_keys"] == 0
    assert results["resume_identical"] is True
    _png_ok(tmp_path / "inspect.png")
    _png_ok(tmp_path / "plan.png")


def test_demo_bad_recipe(runner, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq_length_warmup: {start: 100, full: 50, warmup_steps: 3}\n")
    res = runner.invoke(main, ["demo", "--out", str(tmp_path), "--recipe", str(bad)])
    assert res.exit_code == 2 and "start = 100 > full = 50" in res.output


def _make_flaky():
    """A task encoder that is NOT deterministic: it skips samples by a process-wide counter, so a
    restored run skips different samples than the uninterrupted one (what check-resume catches)."""
    from megatron.energon import SkipSample, stateless

    from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder

    class _Flaky(SyntheticTaskEncoder):
        calls = 0

        @stateless
        def encode_sample(self, sample):
            type(self).calls += 1
            if type(self).calls % 7 == 0:
                raise SkipSample()
            return super().encode_sample(sample)

    return _Flaky


Flaky = _make_flaky()


def test_check_resume_reports_the_first_mismatch(runner, three_sources, tmp_path):
    plain = tmp_path / "plain.yaml"
    plain.write_text("seed: 3\n")
    res = runner.invoke(main, ["check-resume", str(three_sources), "--recipe", str(plain), "--cut", "5",
                               "--steps", "30", "--task-encoder", "test_cli:Flaky"])
    assert res.exit_code == 1, res.output
    assert "resume check FAILED: first mismatch at micro-batch" in res.output
    assert "expected [" in res.output and "got [" in res.output


def test_lean_pool_user_flow_index_then_check_resume(runner, tmp_path):
    # A user's flow: index the prepared data with the default estimator, then check that a
    # pre-encode recipe resumes exactly on it (inspect/check-resume use the same estimator).
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    make_synthetic_dataset(tmp_path / "data", [SourceSpec("web", 96, "trimodal")], shard_size=16)
    data = tmp_path / "data" / "web"
    lean = tmp_path / "lean.yaml"
    lean.write_text("length_sort_pool_size: 32\nlength_sort_mode: batch\nplacement: pre-encode\n")
    res = runner.invoke(main, ["check-resume", str(data), "--recipe", str(lean), "--cut", "5",
                               "--steps", "20"])
    assert res.exit_code == 2 and "energon-ordering index" in res.output  # no index yet
    res = runner.invoke(main, ["index", str(data), "--tokens-per-media", "64"])
    assert res.exit_code == 0, res.output
    table = res.stdout[res.stdout.index("dataset"):].splitlines()
    assert table[2].split()[:2] == ["web", "96"], res.stdout
    assert table[4] == "each index is written to <dataset>/.nv-meta/"
    # named after what computed it (here the estimating encoder), so indexes can sit side by side
    assert table[5] == ("  as energon_ordering_lengths.energon_ordering.inspect.length_estimate."
                        "LengthEstimateTaskEncoder.sqlite")
    assert table[6] == f"datasets in {data.parent}"  # only this line holds a path of yours
    assert max(map(len, table[:5])) <= 100, res.stdout
    res = runner.invoke(main, ["check-resume", str(data), "--recipe", str(lean), "--cut", "5",
                               "--steps", "20", "--tokens-per-media", "64", "--num-workers", "2"])
    assert res.exit_code == 0, res.output
    assert "the next 15 micro-batches are identical" in res.output
    res = runner.invoke(main, ["inspect", str(data), "--recipe", str(lean), "--ranks", "2",
                               "--steps", "10", "--tokens-per-media", "64",
                               "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "pool 32 (batch)" in res.output and "pool off" in res.output


# ---- every wrong input: one `Error:` line, exit code 2, no traceback, before any work --------


def _one_error_line(res, *needles: str) -> str:
    """The whole output is one line `Error: ...` (no traceback, no usage, no table before it)."""
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), res.exception  # not an uncaught error
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert "Traceback" not in res.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def wrong_inputs(tmp_path, recipe):
    folder = tmp_path / "just_a_folder"
    folder.mkdir()
    (folder / "a.txt").write_text("not a dataset\n")
    typo = tmp_path / "typo.yaml"
    demo = yaml.safe_load((RECIPES / "demo.yaml").read_text())
    phases = demo["mixture_schedule"]["phases"]
    phases[0]["weights"] = {("captoin" if k == "caption" else k): v
                            for k, v in phases[0]["weights"].items()}
    typo.write_text(yaml.safe_dump(demo))
    odd_pool = tmp_path / "odd_pool.yaml"
    odd_pool.write_text(recipe.read_text().replace("length_sort_pool_size: 32",
                                                   "length_sort_pool_size: 30"))
    no_total = tmp_path / "no_total.yaml"
    no_total.write_text("mixture_schedule: {phases: [{until: 100, weights: {web: 1}}]}\n")
    return {"folder": folder, "typo": typo, "odd_pool": odd_pool, "no_total": no_total}


def test_a_folder_that_is_not_a_dataset(runner, wrong_inputs, recipe):
    folder = str(wrong_inputs["folder"])
    for args in (["inspect", folder, "--recipe", str(recipe)],
                 ["check-resume", folder, "--recipe", str(recipe), "--cut", "1"],
                 ["index", folder]):
        _one_error_line(runner.invoke(main, args), f"{folder} is not a prepared Energon dataset",
                        "energon prepare")
    # a metadataset that lists it
    meta = wrong_inputs["folder"].parent / "meta.yaml"
    meta.write_text(yaml.safe_dump({"__module__": "megatron.energon", "__class__": "MetadatasetV2",
                                    "splits": {"train": {"blend": [{"weight": 1, "path": folder}]}}}))
    _one_error_line(runner.invoke(main, ["inspect", str(meta), "--recipe", str(recipe)]),
                    f"{meta} is not a prepared Energon dataset", "energon prepare")


def test_a_recipe_where_the_metadataset_belongs(runner, recipe):
    for args in (["inspect", str(recipe), "--recipe", str(recipe)],
                 ["check-resume", str(recipe), "--recipe", str(recipe), "--cut", "1"],
                 ["index", str(recipe)],
                 ["plan", str(recipe), "--global-batch-size", "8", "--metadataset", str(recipe)]):
        line = _one_error_line(runner.invoke(main, args), f"{recipe} is a recipe",
                               "energon prepare")
        assert ("pass it as --recipe" in line) == (args[0] in ("inspect", "check-resume"))


def test_a_pool_that_is_not_a_multiple_of_the_micro_batch_fails_before_any_run(
        runner, three_sources, wrong_inputs, tmp_path):
    res = runner.invoke(main, ["inspect", str(three_sources), "--recipe",
                               str(wrong_inputs["odd_pool"]), "--out", str(tmp_path / "o")])
    _one_error_line(res, "length_sort_pool_size = 30 is not a multiple of",
                    "--batch-size 4", "28 or 32")
    assert not (tmp_path / "o").exists()  # nothing ran, nothing written
    res = runner.invoke(main, ["check-resume", str(three_sources), "--recipe",
                               str(wrong_inputs["odd_pool"]), "--cut", "2"])
    _one_error_line(res, "length_sort_pool_size = 30 is not a multiple of")
    # the demo says so before it writes its dataset
    res = runner.invoke(main, ["demo", "--out", str(tmp_path / "d"), "--batch-size", "3"])
    _one_error_line(res, "length_sort_pool_size = 256 is not a multiple of", "--batch-size 3")
    assert not (tmp_path / "d").exists()


def test_plan_rejects_bad_source_sizes_before_printing(runner, recipe, tmp_path):
    for sizes, needle in (("web=10", "no size for ['code', 'curated']"),
                          ("web=lots", "expected NAME=SAMPLES"),
                          (",", "no sizes given")):
        res = runner.invoke(main, ["plan", str(recipe), "--global-batch-size", "8",
                                   "--source-sizes", sizes, "--out", str(tmp_path)])
        _one_error_line(res, needle)
    assert not (tmp_path / "plan.png").exists()


def _usage_error_line(res) -> str:
    """A click usage error: exit code 2, usage lines, then one line `Error: ...`."""
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit), res.exception
    lines = res.output.strip().splitlines()
    assert lines[0].startswith("Usage: ") and lines[-1].startswith("Error: "), res.output
    assert sum(ln.startswith("Error: ") for ln in lines) == 1 and "Traceback" not in res.output
    return lines[-1]


def test_a_recipe_name_typo_gets_did_you_mean(runner, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = ", ".join(recipe_names())
    res = runner.invoke(main, ["plan", "llava_pretrian", "--global-batch-size", "64"])
    assert _usage_error_line(res) == (
        "Error: Invalid value for 'RECIPE': recipe 'llava_pretrian' does not exist: no such file "
        f"(from {os.getcwd()}) and no packaged recipe of that name. Did you mean "
        f"'llava_pretrain'? Give a path to a YAML recipe or one of the packaged names: {names}.")
    res = runner.invoke(main, ["demo", "--recipe", "dmeo.yaml", "--out", str(tmp_path / "d")])
    assert _usage_error_line(res) == (
        "Error: Invalid value for '--recipe': recipe 'dmeo.yaml' does not exist: no such file "
        f"(from {os.getcwd()}) and no packaged recipe of that name. Did you mean 'demo'? Give a "
        f"path to a YAML recipe or one of the packaged names: {names}.")
    assert not (tmp_path / "d").exists()


@pytest.fixture
def llava_sources_in_part(tmp_path):
    """A metadataset with three of llava_pretrain's five sources."""
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    return make_synthetic_dataset(tmp_path / "some", [SourceSpec("caption", 30, "short"),
                                                      SourceSpec("vqa", 20, "short"),
                                                      SourceSpec("ocr", 10, "short")],
                                  shard_size=10)


def test_plan_names_the_sources_a_metadataset_lacks(runner, llava_sources_in_part, tmp_path):
    meta = str(llava_sources_in_part)
    res = runner.invoke(main, ["plan", "llava_pretrain", "--metadataset", meta,
                               "--global-batch-size", "64", "--out", str(tmp_path)])
    assert _one_error_line(res) == (
        f"Error: --metadataset {meta} has no source ['interleaved', 'sft_quality'] of the "
        "recipe's mixture schedule. The metadataset's sources: caption, vqa, ocr (each entry's "
        "`subflavors: {source: NAME}`, else its folder name); the recipe's: caption, vqa, ocr, "
        "interleaved, sft_quality. Name the metadataset's entries after the recipe's sources, or "
        "pass the samples per source instead of --metadataset: --source-sizes "
        "caption=30,vqa=20,ocr=10,interleaved=N,sft_quality=N (N: samples of that source).")
    assert not (tmp_path / "plan.png").exists()


def test_plan_names_the_sources_source_sizes_lacks(runner, tmp_path):
    res = runner.invoke(main, ["plan", "llava_pretrain", "--source-sizes", "caption=100,vqa=20",
                               "--global-batch-size", "64", "--out", str(tmp_path)])
    assert _one_error_line(res) == (
        "Error: --source-sizes has no size for ['ocr', 'interleaved', 'sft_quality']; the "
        "recipe's mixture schedule draws from caption, vqa, ocr, interleaved, sft_quality: give "
        "every one, e.g. --source-sizes caption=100,vqa=20,ocr=N,interleaved=N,sft_quality=N "
        "(N: samples of that source).")
    assert not (tmp_path / "plan.png").exists()


def test_demo_checks_the_recipe_sources_before_writing_data(runner, tmp_path):
    recipe = recipe_dir() / "llava_pretrain.yaml"
    res = runner.invoke(main, ["demo", "--recipe", "llava_pretrain", "--out", str(tmp_path / "d")])
    assert _one_error_line(res) == (
        f"Error: --recipe {recipe}: its mixture schedule draws from ['interleaved', "
        "'sft_quality'], which the demo's synthetic dataset does not have (its sources: caption, "
        "vqa, ocr, curated); pass a recipe whose schedule uses only those sources (e.g. --recipe "
        f"demo), or run `energon-ordering inspect METADATASET --recipe {recipe}` on a dataset that "
        "has its sources.")
    assert not (tmp_path / "d").exists()  # nothing written


def test_a_typo_in_a_phase_names_the_unknown_source(runner, wrong_inputs, three_sources):
    res = runner.invoke(main, ["plan", str(wrong_inputs["typo"]), "--global-batch-size", "8"])
    _one_error_line(res, "phase 0: unknown source 'captoin' (did you mean 'caption'?)")
    res = runner.invoke(main, ["inspect", str(three_sources), "--recipe", str(wrong_inputs["typo"])])
    _one_error_line(res, "unknown source 'captoin' (did you mean 'caption'?)")


def test_plan_needs_total_steps_from_the_recipe_or_the_flag(runner, wrong_inputs, tmp_path):
    res = runner.invoke(main, ["plan", str(wrong_inputs["no_total"]), "--global-batch-size", "8"])
    _one_error_line(res, "has no total_steps", "--total-steps N")
    res = runner.invoke(main, ["plan", str(wrong_inputs["no_total"]), "--global-batch-size", "8",
                               "--total-steps", "500", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output


def test_plan_takes_total_steps_from_the_recipe_and_the_flag_overrides_it(runner, tmp_path):
    demo = str(RECIPES / "demo.yaml")  # total_steps: 300, phase 1 from 0.7 with a 20-step ramp
    out = tmp_path / "new" / "folder"  # created, as inspect and advise create theirs
    res = runner.invoke(main, ["plan", demo, "--global-batch-size", "32", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "plan.png").is_file()
    rows = {ln.split()[0]: ln for ln in res.stdout.splitlines() if ln[:1].isdigit()}
    assert "last step of phase 0" in rows["209"]
    assert "phase 1: ramp of 20 steps starts" in rows["210"]
    assert "ramp ends: phase 1 weights" in rows["229"] and "0.400" in rows["229"]
    assert "last step" in rows["299"]
    assert "Mixture schedule of demo.yaml" in res.stdout
    res = runner.invoke(main, ["plan", demo, "--global-batch-size", "32", "--total-steps", "1000",
                               "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    rows = {ln.split()[0]: ln for ln in res.stdout.splitlines() if ln[:1].isdigit()}
    assert "last step of phase 0" in rows["699"] and "ramp ends" in rows["719"]  # 0.7 of 1,000
    assert "last step" in rows["999"]
