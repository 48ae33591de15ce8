"""``energon-ordering check-resume --resume-ranks``: a planned run saved on R ranks and resumed
on R2 ranks with the same global batch (issue 23), through click's CliRunner on a real prepared
metadataset with length indexes; the refusals; and that the comparison catches a difference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from energon_ordering.cli import main
from energon_ordering.inspect import inspection
from energon_ordering.inspect.inspection import compare_elastic_steps
from energon_ordering.inspect.rank_simulation import BatchRecord
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

K = 4  # plan_window_steps: a cut at optimizer step 1 re-plans the rest of window 0


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two sources (web: short, code: long; 0.7 / 0.3) indexed as a user would, with
    ``energon-ordering index`` (the estimate check-resume measures with by default)."""
    root = tmp_path_factory.mktemp("resume_ranks")
    meta = make_synthetic_dataset(
        root,
        [SourceSpec("web", 160, "short", weight=0.7), SourceSpec("code", 96, "long", weight=0.3)],
        shard_size=32,
    )
    res = CliRunner().invoke(main, ["index", str(meta)])
    assert res.exit_code == 0, res.output
    return meta


def _recipe(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "length_sort_mode": "planned", "placement": "pre-encode", "length_sort_pool_holds": "keys",
        "seed": 5, "plan_window_steps": K, **fields}))
    return path


def _check(data: Path, recipe: Path, *args: str):
    return CliRunner().invoke(main, ["check-resume", str(data), "--recipe", str(recipe), *args])


@pytest.mark.parametrize("ranks, mbps, resume_ranks, resume_mbps", [(4, 1, 2, 2), (2, 2, 4, 1)])
def test_resume_onto_other_ranks_passes(data, tmp_path, ranks, mbps, resume_ranks, resume_mbps):
    recipe = _recipe(tmp_path, micro_batches_per_step=mbps)
    res = _check(data, recipe, "--ranks", str(ranks), "--resume-ranks", str(resume_ranks),
                 "--cut", str(mbps))  # optimizer step 1, inside plan window 0
    assert res.exit_code == 0, res.output
    # default --steps: through window 1, so steps 1..7 (the re-planned tail and a whole window)
    samples = 7 * ranks * mbps * 4
    assert res.output == (
        f"resume check: cut at micro-batch {mbps} = optimizer step 1 on {ranks} ranks x {mbps} "
        f"micro-batches per step, restored from save_state_rank() onto {resume_ranks} ranks x "
        f"{resume_mbps}: the next 7 optimizer steps hold the same {samples} samples, none lost "
        "or twice; each plan window the same samples, each step the same count per source\n")


def test_the_check_fails_when_the_resumed_stream_differs(data, tmp_path, monkeypatch):
    """The real runs, with the resumed rank 0's last micro-batch replaced by its first one: the
    check must see samples repeated and lost, and exit 1."""
    real_resume = inspection.resume

    def resume_repeating(*args, **kwargs):
        records = real_resume(*args, **kwargs)
        return records[:-1] + records[:1]

    monkeypatch.setattr(inspection, "resume", resume_repeating)
    res = _check(data, _recipe(tmp_path, micro_batches_per_step=1), "--ranks", "4",
                 "--resume-ranks", "2", "--cut", "1")
    assert res.exit_code == 1, res.output
    assert res.output.startswith("resume check FAILED: ")
    assert res.output.endswith("(cut at micro-batch 1 = optimizer step 1 on 4 ranks x 1 "
                               "micro-batches per step, resumed onto 2 ranks x 2)\n")


def test_a_pool_recipe_is_refused(data, tmp_path):
    recipe = tmp_path / "pool.yaml"
    recipe.write_text("length_sort_pool_size: 32\nlength_sort_mode: batch\n")
    res = _check(data, recipe, "--ranks", "2", "--resume-ranks", "1", "--cut", "2")
    assert res.exit_code == 2
    assert res.output.strip() == (
        "Error: --resume-ranks 1 needs a planned recipe, and the recipe has length_sort_mode: "
        "batch (only a planned state continues at another data-parallel size); set "
        "length_sort_mode: planned in the recipe, or drop --resume-ranks.")


def test_a_global_batch_that_does_not_split_is_refused(data, tmp_path):
    res = _check(data, _recipe(tmp_path, micro_batches_per_step=1), "--ranks", "4",
                 "--resume-ranks", "3", "--cut", "1")
    assert res.exit_code == 2
    assert res.output.strip() == (
        "Error: --resume-ranks 3: the global batch of --ranks 4 x micro_batches_per_step 1 = 4 "
        "micro-batches per step does not split over 3 ranks (an elastic resume keeps the global "
        "batch); use --resume-ranks 1, 2, 4.")


@pytest.mark.parametrize("args, match", [
    (["--cut", "3"], r"--cut 3 lies inside optimizer step 1 \(micro_batches_per_step 2\), .* "
                     r"use --cut 2 or 4\.$"),
    (["--cut", "2", "--steps", "12"], r"--steps 12 ends inside a plan window \(plan_window_steps"
                                      r" 4 x micro_batches_per_step 2 = 8 micro-batches\); .* "
                                      r"use --steps 8 or 16\.$"),
])
def test_a_cut_or_end_off_the_plan_grid_is_refused(data, tmp_path, args, match):
    res = _check(data, _recipe(tmp_path, micro_batches_per_step=2), "--ranks", "2",
                 "--resume-ranks", "4", *args)
    assert res.exit_code == 2
    assert res.output.startswith("Error: ") and len(res.output.strip().splitlines()) == 1
    assert re.search(match, res.output.strip()), res.output


# -- the comparison itself ---------------------------------------------------------------------


def _steps(*steps: str) -> list[list[tuple[str, str]]]:
    """``"web1 code2"`` per optimizer step -> (key, source) pairs."""
    return [[(k, k.rstrip("0123456789")) for k in step.split()] for step in steps]


UNINTERRUPTED = _steps("web1 code1", "web2 web3", "web4 code2", "web5 web6")  # steps 2..5


def test_the_comparison_accepts_a_window_re_dealt_over_its_steps():
    # window 1 = steps 2-3 and window 2 = steps 4-5 (window_steps 2): within a window the
    # samples may move between steps as long as each step keeps its count per source
    got = _steps("web2 code1", "web1 web3", "web6 code2", "web5 web4")
    assert compare_elastic_steps(UNINTERRUPTED, got, first_step=2, window_steps=2) is None


@pytest.mark.parametrize("got, reason", [
    # one sample moved across a window boundary: each step's counts per source still agree
    (_steps("web1 code1", "web2 web4", "web3 code2", "web5 web6"),
     "plan window 1 (optimizer steps 2-3): 1 samples missing ['web3'], 1 extra or repeated "
     "['web4']"),
    # a sample twice, another lost
    (_steps("web1 code1", "web2 web3", "web4 code2", "web5 web5"),
     "plan window 2 (optimizer steps 4-5): 1 samples missing ['web6'], 1 extra or repeated "
     "['web5']"),
    # the same samples per window, but a step's mix changed
    (_steps("web1 web2", "code1 web3", "web4 code2", "web5 web6"),
     "optimizer step 2: samples per source {'code': 1, 'web': 1} expected, got {'web': 2}"),
    (UNINTERRUPTED[:3], "3 optimizer steps resumed, 4 expected"),
])
def test_the_comparison_catches_a_different_stream(got, reason):
    mismatch = compare_elastic_steps(UNINTERRUPTED, got, first_step=2, window_steps=2)
    assert mismatch is not None and mismatch.reason == reason


def test_batch_records_become_steps_with_their_sources():
    # rank 0 and 1, one micro-batch per step each: a step lists rank 0's samples, then rank 1's
    records = [[BatchRecord(("web1",), (3,), ("web",)), BatchRecord(("code1",), (9,), ("code",))],
               [BatchRecord(("web2",), (4,), ()), BatchRecord(("web3",), (5,), ("web",))]]
    assert inspection._step_samples(records, 1) == [[("web1", "web"), ("web2", "-")],
                                                    [("code1", "code"), ("web3", "web")]]


def test_ranks_without_resume_ranks_checks_each_rank_at_its_size(data, tmp_path):
    res = _check(data, _recipe(tmp_path, micro_batches_per_step=2), "--ranks", "2", "--cut", "3",
                 "--steps", "10")
    assert res.exit_code == 0, res.output
    assert res.output == ("resume check: cut at micro-batch 3 on each of 2 ranks, restored from "
                          "save_state_rank(): the next 7 micro-batches are identical\n")
