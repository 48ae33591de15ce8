"""Length indexes per length function, and bad input around them (issue 12).

Several indexes side by side (named after what computed them), chosen by the config, a warning
on any mismatch; an index elsewhere for a read-only dataset; a sample that fails to decode named
or skipped and counted; leftovers of a killed build removed; a corrupt file refused on open; and
the command line's one-line errors.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from energon_ordering import LengthIndexError, OrderingConfig, OrderingConfigError
from energon_ordering.cli import main
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder, SyntheticTaskEncoder
from energon_ordering.length_index.build import build_length_index
from energon_ordering.length_index.index import (
    INDEX_FILE,
    _host,
    LengthIndex,
    index_path,
    length_index_files,
    write_length_index,
)

SYNTH = "energon_ordering.inspect.synthetic_task.SyntheticTaskEncoder"


@pytest.fixture
def ds(tmp_path):
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 48, "trimodal")], shard_size=16)
    return tmp_path / "web"


def _one_line_error(result) -> str:
    """The CLI failed with exit code 2 (a user error) and exactly one ``Error:`` line, no
    traceback (a progress bar's label may precede it on stderr)."""
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "Traceback" not in result.output and result.output.endswith(errors[0] + "\n")
    return errors[0]


def _double_raw(raw):
    return 2.0 * len(raw["txt"].split())


def _raising_raw(raw):
    raise RuntimeError("tokenizer not loaded")


def _pre_encode(ds, te=IndexedSyntheticTaskEncoder, **cfg):
    config = OrderingConfig(length_sort_pool_size=8, length_sort_placement="pre-encode", **cfg)
    return build_train_loader(ds, ordering=config, task_encoder_factory=te,
                              shuffle_buffer_size=None)


def test_indexes_of_several_length_functions_sit_side_by_side(ds):
    build_length_index(ds, task_encoder=IndexedSyntheticTaskEncoder())
    build_length_index(ds, raw_length_fn=_double_raw)
    build_length_index(ds, raw_length_fn=_double_raw, name="tok-b")
    names = set(length_index_files(ds))
    assert names == {
        "energon_ordering.inspect.synthetic_task.IndexedSyntheticTaskEncoder",
        "test_length_index_choice._double_raw",
        "tok-b",
    }
    # By default the encoder's own index; no warning.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close_loader(_pre_encode(ds))
    # The config chooses another one: used, with a warning naming both.
    with pytest.warns(UserWarning, match=r"computed by raw_length_fn .*_double_raw, not by task "
                                         r"encoder .*IndexedSyntheticTaskEncoder"):
        close_loader(_pre_encode(ds, length_index="tok-b"))
    with pytest.raises(LengthIndexError, match=r"energon_ordering_lengths.nope.sqlite does not "
                                               r"exist \(OrderingConfig.length_index = 'nope'\)"):
        _pre_encode(ds, length_index="nope")


def test_an_encoder_of_the_running_script_is_pointed_at_build_length_index(ds):
    """An encoder defined in the script that runs (``__main__``, as in a ``train.py``) cannot be
    named to ``energon-ordering index --task-encoder``: the warning names the Python call."""
    main_encoder = type("TrainTE", (IndexedSyntheticTaskEncoder,), {"__module__": "__main__"})
    build_length_index(ds, raw_length_fn=_double_raw, name="tok-b")
    with pytest.warns(UserWarning) as caught:
        close_loader(_pre_encode(ds, te=main_encoder, length_index="tok-b"))
    text = " ".join(str(w.message) for w in caught)
    assert (f"build one in your training script with `energon_ordering.build_length_index("
            f"'{ds}', task_encoder=TrainTE())`") in text, text
    assert "--task-encoder __main__" not in text


def test_several_indexes_and_none_of_this_encoder_is_refused(ds):
    build_length_index(ds, raw_length_fn=_double_raw, name="a")
    build_length_index(ds, raw_length_fn=_double_raw, name="b")
    with pytest.raises(LengthIndexError, match=r"several length indexes \['a', 'b'\].*"
                                               r"OrderingConfig.length_index = NAME"):
        _pre_encode(ds)


def test_index_replaced_under_a_running_job_is_refused(ds):
    build_length_index(ds, raw_length_fn=_double_raw, name="x")
    index = LengthIndex.open(ds, "x")
    write_length_index(ds, [(f"web-{i:08d}", 1.0) for i in range(48)], computed_by="other",
                       name="x")
    with pytest.raises(LengthIndexError, match=r"was replaced while this job reads it"):
        index.length("web-00000000")


def test_index_dir_for_a_read_only_dataset(ds, tmp_path):
    out = tmp_path / "indexes"
    result = CliRunner().invoke(main, ["index", str(ds), "--task-encoder",
                                       "energon_ordering.inspect.synthetic_task:IndexedSyntheticTaskEncoder",
                                       "--index-dir", str(out)])
    assert result.exit_code == 0, result.output
    assert not length_index_files(ds), "nothing written into the dataset"
    assert length_index_files(ds, out)
    with pytest.raises(LengthIndexError, match=r"no length index"):
        _pre_encode(ds)
    close_loader(_pre_encode(ds, length_index_dir=str(out)))
    # A place the index cannot be written to: one line naming the option.
    blocker = tmp_path / "file"
    blocker.write_text("")
    bad = CliRunner().invoke(main, ["index", str(ds), "--raw-length-fn",
                                    "test_length_index_choice:_double_raw",
                                    "--index-dir", str(blocker / "sub")])
    line = _one_line_error(bad)
    assert "cannot write" in line and "--index-dir" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_dataset_gives_a_clear_error(ds):
    meta = ds / ".nv-meta"
    meta.chmod(0o555)
    try:
        with pytest.raises(LengthIndexError, match=r"cannot write .*--index-dir"):
            build_length_index(ds, raw_length_fn=_double_raw)
    finally:
        meta.chmod(0o755)


def test_a_sample_that_fails_is_named_or_skipped_and_counted(ds):
    with pytest.raises(LengthIndexError, match=r"sample 'web-\d{8}' \(shard .*\) failed in "
                                               r"--raw-length-fn: RuntimeError: tokenizer not "
                                               r"loaded.*--skip-bad-samples"):
        build_length_index(ds, raw_length_fn=_raising_raw)
    (built,) = build_length_index(ds, raw_length_fn=_raising_raw, skip_bad_samples=True)
    assert len(built.skipped) == 48 and built.summary.samples == 48
    assert LengthIndex.open(ds).length(built.skipped[0]) == 0.0
    runner = CliRunner()
    result = runner.invoke(main, ["index", str(ds), "--raw-length-fn",
                                  "test_length_index_choice:_raising_raw"])
    assert "failed in --raw-length-fn" in _one_line_error(result)
    result = runner.invoke(main, ["index", str(ds), "--raw-length-fn",
                                  "test_length_index_choice:_raising_raw", "--skip-bad-samples"])
    assert result.exit_code == 0 and "skipped 48 sample(s)" in result.output


def test_leftovers_of_a_killed_build_are_removed(ds):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    # Named as a build on this host names it (host and PID); not locked: the build is gone.
    leftover = index_path(ds).with_name(f"{INDEX_FILE}.tmp-{_host()}-{dead.stdout.strip()}")
    leftover.write_bytes(b"partial")
    build_length_index(ds, raw_length_fn=_double_raw)
    assert not leftover.exists()


def test_a_corrupt_index_is_refused_when_opened(ds):
    (built,) = build_length_index(ds, raw_length_fn=_double_raw)
    path = built.summary.path
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 2 * page
    data[page + 8 : page + 200] = os.urandom(192)  # garble the second page (a b-tree page)
    path.write_bytes(bytes(data))
    with pytest.raises(LengthIndexError, match=r"unreadable or corrupt"):
        LengthIndex.open(ds)


def test_empty_split_is_one_line(ds):
    result = CliRunner().invoke(main, ["index", str(ds), "--split-part", "val", "--raw-length-fn",
                                       "test_length_index_choice:_double_raw"])
    line = _one_line_error(result)
    assert "split 'val'" in line and "no samples" in line


def test_plan_out_unwritable_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    recipe = next(p for p in sorted((__import__("pathlib").Path(__file__).parent.parent
                                     / "recipes").glob("*.yaml")) if "slm" in p.name)
    result = CliRunner().invoke(main, ["plan", str(recipe), "--total-steps", "19073",
                                       "--global-batch-size", "64", "--source-sizes",
                                       "web=1000,code=1000,books=1000,curated=1000",
                                       "--out", str(blocker / "sub")])
    line = _one_line_error(result)
    assert line.startswith("Error: --out ") and "writable" in line


def test_pool_larger_than_a_workers_share_is_refused(ds):
    cfg = OrderingConfig(length_sort_pool_size=10**6)
    with pytest.raises(OrderingConfigError, match=r"length_sort_pool_size = 1000000 is larger than "
                                                  r"a loader worker's share of the data \(24 "
                                                  r"samples per epoch"):
        build_train_loader(ds, ordering=cfg, num_workers=2)
    # Finite data: the pool simply holds the whole share.
    close_loader(build_train_loader(ds, ordering=cfg, repeat=False))

