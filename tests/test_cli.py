"""The energon-ordering CLI through click's CliRunner: every command and every user error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from energon_ordering import __version__
from energon_ordering.cli import main

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
    assert "17,165" in res.output and "17,166" in res.output  # the anneal boundary, both sides
    assert "curated" in res.output and "!" in res.output  # curated repeats > 4 epochs
    assert "warning: implied epochs above 4.0" in res.output
    assert "max_seq_len" in res.output and "2,048" in res.output
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
    assert res.exit_code == 1 and "length_sort_mode = 'sorted' is unknown" in res.output
    res = runner.invoke(main, ["plan", str(recipe), "--total-steps", "0", "--global-batch-size", "8"])
    assert res.exit_code == 2 and "--total-steps" in res.output
    res = runner.invoke(main, ["plan", str(recipe), "--total-steps", "60", "--global-batch-size", "8",
                               "--source-sizes", "web=lots"])
    assert res.exit_code == 2 and "NAME=SAMPLES" in res.output
    res = runner.invoke(main, ["plan", str(recipe), "--total-steps", "60", "--global-batch-size", "8",
                               "--source-sizes", "web=10"])
    assert res.exit_code == 1 and "no size for ['code', 'curated']" in res.output


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
    assert res.exit_code == 1 and "no dataset for ['books']" in res.output


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


def test_demo_end_to_end_small(runner, tmp_path):
    res = runner.invoke(main, ["demo", "--out", str(tmp_path), "--ranks", "4", "--steps", "60",
                               "--scale", "0.2"])
    assert res.exit_code == 0, res.output
    assert "pool off" in res.output and "pool 256 (batch)" in res.output
    assert "Implied epochs" in res.output
    assert "are identical" in res.output
    results = json.loads((tmp_path / "results.json").read_text())
    off, on = results["pool off"], results["pool 256 (batch)"]
    assert on["straggler_idle"] < off["straggler_idle"]
    assert on["overlapping_keys"] == off["overlapping_keys"] == 0
    assert results["resume_identical"] is True
    _png_ok(tmp_path / "inspect.png")
    _png_ok(tmp_path / "plan.png")


def test_demo_bad_recipe(runner, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq_length_warmup: {start: 100, full: 50, warmup_steps: 3}\n")
    res = runner.invoke(main, ["demo", "--out", str(tmp_path), "--recipe", str(bad)])
    assert res.exit_code == 1 and "start = 100 > full = 50" in res.output


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
    assert res.exit_code == 1 and "energon-ordering index" in res.output  # no index yet
    res = runner.invoke(main, ["index", str(data), "--tokens-per-media", "64"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["check-resume", str(data), "--recipe", str(lean), "--cut", "5",
                               "--steps", "20", "--tokens-per-media", "64", "--num-workers", "2"])
    assert res.exit_code == 0, res.output
    assert "the next 15 micro-batches are identical" in res.output
    res = runner.invoke(main, ["inspect", str(data), "--recipe", str(lean), "--ranks", "2",
                               "--steps", "10", "--tokens-per-media", "64",
                               "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "pool 32 (batch)" in res.output and "pool off" in res.output
