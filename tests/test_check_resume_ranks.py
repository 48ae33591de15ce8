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
from energon_ordering.inspect.model_steps import compare_model_steps, model_steps
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
        f"{resume_mbps}: the next 7 optimizer steps show the model the same {samples} samples, "
        "each step the same ones at the same token lengths in the same packs\n")


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
    (["--cut", "2", "--steps", "13"], r"--steps 13 ends inside optimizer step 6 "
                                      r"\(micro_batches_per_step 2\); .* use --steps 12 or 14\.$"),
])
def test_a_cut_or_end_off_the_plan_grid_is_refused(data, tmp_path, args, match):
    res = _check(data, _recipe(tmp_path, micro_batches_per_step=2), "--ranks", "2",
                 "--resume-ranks", "4", *args)
    assert res.exit_code == 2
    assert res.output.startswith("Error: ") and len(res.output.strip().splitlines()) == 1
    assert re.search(match, res.output.strip()), res.output


# -- the comparison itself: what the model sees --------------------------------------------------


def _mb(*docs: str, packs: tuple[int, ...] = ()) -> BatchRecord:
    """A micro-batch of ``"key:tokens"`` documents; ``packs``: documents per pack."""
    keys = tuple(d.split(":")[0] for d in docs)
    lengths = tuple(int(d.split(":")[1]) for d in docs)
    at, pack_lengths = 0, []
    for n in packs:
        pack_lengths.append(lengths[at:at + n])
        at += n
    return BatchRecord(keys, lengths, (), tuple(pack_lengths))


#: The uninterrupted run: 2 ranks x 1 micro-batch per step, steps 2 and 3 after the cut.
RUN = [[_mb("a:5", "b:7"), _mb("e:3", "f:4")], [_mb("c:6", "d:2"), _mb("g:8", "h:1")]]


def test_the_comparison_accepts_a_step_re_dealt_over_ranks_and_micro_batches():
    # resumed on 1 rank x 2 micro-batches: step 2's samples on other micro-batches, re-ordered
    got = [[_mb("d:2", "a:5"), _mb("c:6", "b:7"), _mb("h:1", "g:8"), _mb("e:3", "f:4")]]
    assert compare_model_steps(model_steps(RUN, 1), model_steps(got, 2), first_step=2) is None


@pytest.mark.parametrize("got, micro_batches, where, reason", [
    # a sample moved to the next step (each window still holds the same samples)
    ([[_mb("a:5", "b:7"), _mb("c:6", "e:3"), _mb("d:2", "f:4"), _mb("g:8", "h:1")]], 2,
     (2, 0, 1), "optimizer step 2: 1 samples missing ['d'], 1 extra or repeated ['e'] (rank 0 "
     "micro-batch 1 holds e)"),
    # the same samples, one cut to another length (another warmup cap)
    ([[_mb("a:5", "b:7"), _mb("e:3", "f:4")], [_mb("c:6", "d:2"), _mb("g:5", "h:1")]], 1,
     (3, 1, 0), "optimizer step 3, rank 1 micro-batch 0: sample g has 5 tokens, 8 in the "
                "uninterrupted run (cut to another cap)"),
    # a step missing at the end
    ([[_mb("a:5", "b:7")], [_mb("c:6", "d:2")]], 1,
     (3, None, None), "optimizer step 3: missing, the resumed run ends after 1 steps of 2"),
])
def test_the_comparison_names_the_first_differing_step_and_where(got, micro_batches, where,
                                                                 reason):
    mismatch = compare_model_steps(model_steps(RUN, 1), model_steps(got, micro_batches),
                                   first_step=2)
    assert mismatch is not None
    assert (mismatch.step, mismatch.rank, mismatch.micro_batch) == where
    assert mismatch.reason == reason


def test_the_comparison_sees_pack_boundaries():
    packed = [[_mb("a:5", "b:7", "c:6", packs=(2, 1))], [_mb("d:2", "e:3", packs=(1, 1))]]
    regrouped = [[_mb("a:5", "b:7", "c:6", packs=(1, 2))], [_mb("d:2", "e:3", packs=(1, 1))]]
    re_dealt = [[_mb("d:2", "c:6", packs=(1, 1))], [_mb("e:3", "a:5", "b:7", packs=(1, 2))]]
    expected = model_steps(packed, 1)
    assert compare_model_steps(expected, model_steps(re_dealt, 1), first_step=0) is None
    mismatch = compare_model_steps(expected, model_steps(regrouped, 1), first_step=0)
    assert mismatch is not None and (mismatch.step, mismatch.rank, mismatch.micro_batch) == (0, 0, 0)
    assert mismatch.reason == ("optimizer step 0, rank 0 micro-batch 0: pack ['a'], the "
                               "uninterrupted run packs a in ['a', 'b']")


def test_ranks_without_resume_ranks_checks_each_rank_at_its_size(data, tmp_path):
    res = _check(data, _recipe(tmp_path, micro_batches_per_step=2), "--ranks", "2", "--cut", "3",
                 "--steps", "10")
    assert res.exit_code == 0, res.output
    assert res.output == ("resume check: cut at micro-batch 3 on each of 2 ranks, restored from "
                          "save_state_rank(): the next 7 micro-batches are identical\n")


# -- elastic resume under the sequence-length warmup (issue 31) --------------------------------

#: Caps 64 .. 512 tokens over 8 steps: the "short" source (~200 tokens) is cut at the start,
#: and each step's cap differs from step 0's.
WARMUP = {"start": 64, "full": 512, "warmup_steps": 8, "multiple_of": 8}


@pytest.mark.parametrize("packing", [False, True])
def test_an_elastic_resume_inside_the_warmup_keeps_each_steps_cuts(data, tmp_path, packing):
    """Cut at optimizer step 2 of 8 warmup steps, resumed on 2 ranks from 4: the resumed
    samples (and packs) carry the cap of their step, not step 0's (a warmup that restarted at
    step 0 after the restore cut them to 64 tokens and failed this check)."""
    fields = dict(micro_batches_per_step=1, seq_length_warmup=WARMUP)
    if packing:
        fields.update(packing_buffer_size=32, pack_seq_length=512)
    res = _check(data, _recipe(tmp_path, **fields), "--ranks", "4", "--resume-ranks", "2",
                 "--cut", "2", "--steps", "8")
    assert res.exit_code == 0, res.output
    assert "optimizer steps show the model the same" in res.output


def test_the_packaged_planned_recipe_resumes_onto_other_ranks(data):
    """``--recipe planned`` (the packaged planned recipe, by name, as the docs show it) is what
    ``--resume-ranks`` needs: a cut inside the first plan window, resumed on half the ranks."""
    res = _check(data, Path("planned"), "--ranks", "4", "--resume-ranks", "2", "--cut", "3")
    assert res.exit_code == 0, res.output
    assert res.output.startswith(
        "resume check: cut at micro-batch 3 = optimizer step 3 on 4 ranks x 1 micro-batches per "
        "step, restored from save_state_rank() onto 2 ranks x 2: the next "), res.output
    assert res.output.endswith(
        "each step the same ones at the same token lengths in the same packs\n"), res.output
