"""The length index: built over a real prepared dataset, tied to its index.uuid, refused when
stale or missing, and the `energon-ordering index` / tools/build_length_index.py commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from megatron.energon import WorkerConfig, get_train_dataset

from energon_ordering import OrderingConfig
from energon_ordering.cli import main
from energon_ordering.errors import LengthIndexError
from energon_ordering.length_index.index import (
    INDEX_FILE,
    LengthIndex,
    dataset_uuid,
    index_path,
    write_length_index,
)
from energon_ordering.length_index.build import build_length_index
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, record_batch
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder, SyntheticTaskEncoder

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_dataset(tmp_path):
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 96, "trimodal")], shard_size=16)
    return tmp_path / "web"


def _encoded_lengths(path) -> dict[str, int]:
    """Every sample's encoded length, read through an ordinary (pool-less) training pipeline."""
    loader = build_train_loader(path, ordering=OrderingConfig(), repeat=False,
                                shuffle_buffer_size=None)
    lengths = {}
    for batch in loader:
        rec = record_batch(batch)
        lengths.update(zip(rec.keys, rec.lengths))
    close_loader(loader)
    return lengths


def test_index_over_a_prepared_dataset_holds_every_encoded_length(fresh_dataset):
    built = build_length_index(fresh_dataset, task_encoder=SyntheticTaskEncoder())
    assert [b.summary.samples for b in built] == [96]
    index = LengthIndex.open(fresh_dataset)
    assert index.uuid == dataset_uuid(fresh_dataset) and len(index) == 96
    # named after what computed it, so other length functions' indexes sit next to it
    assert index.path == fresh_dataset / ".nv-meta" / INDEX_FILE.replace(
        ".sqlite", ".energon_ordering.inspect.synthetic_task.SyntheticTaskEncoder.sqlite")
    want = _encoded_lengths(fresh_dataset)
    assert len(want) == 96
    assert {k: index.length(k) for k in want} == want


def test_raw_length_function_and_worker_processes_give_the_same_index(fresh_dataset):
    te = SyntheticTaskEncoder()
    build_length_index(fresh_dataset, raw_length_fn=te.ordering_raw_sample_length, workers=2)
    index = LengthIndex.open(fresh_dataset)
    assert "raw_length_fn" in index.computed_by
    assert {k: index.length(k) for k in _encoded_lengths(fresh_dataset)} == _encoded_lengths(fresh_dataset)


def test_metadataset_indexes_every_dataset(three_sources):
    built = build_length_index(three_sources, task_encoder=SyntheticTaskEncoder(), workers=2)
    assert sorted(Path(b.dataset).name for b in built) == ["code", "curated", "web"]
    assert {Path(b.dataset).name: b.summary.samples for b in built} == {
        "web": 2000, "code": 2000, "curated": 500}
    for b in built:
        assert LengthIndex.open(b.dataset).samples == b.summary.samples


def _pre_encode_pipeline(path, te_cls=IndexedSyntheticTaskEncoder):
    te = te_cls()
    te.ordering = OrderingConfig(length_sort_pool_size=16, length_sort_placement="pre-encode")
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    return get_train_dataset(path, batch_size=4, worker_config=wc, task_encoder=te,
                             shuffle_buffer_size=None, max_samples_per_sequence=None)


def test_missing_index_is_refused_with_the_command_that_builds_it(fresh_dataset):
    with pytest.raises(LengthIndexError, match=rf"no length index .*{INDEX_FILE} does not exist.*energon-ordering index {fresh_dataset}"):
        _pre_encode_pipeline(fresh_dataset)


def test_stale_index_is_refused(fresh_dataset):
    build_length_index(fresh_dataset, task_encoder=SyntheticTaskEncoder())
    old = dataset_uuid(fresh_dataset)
    # `energon prepare` again (the data changed): a new index.uuid.
    make_synthetic_dataset(fresh_dataset.parent, [SourceSpec("web", 80, "trimodal")], shard_size=16)
    new = dataset_uuid(fresh_dataset)
    assert new != old
    with pytest.raises(LengthIndexError, match=rf"stale.*index.uuid = '{old}'.*now has index.uuid = '{new}'.*energon-ordering index"):
        LengthIndex.open(fresh_dataset)
    # Refused by the pipeline too, even though this encoder has a raw length function.
    with pytest.raises(LengthIndexError, match="stale"):
        _pre_encode_pipeline(fresh_dataset, SyntheticTaskEncoder)


def test_index_of_another_version_is_refused(fresh_dataset):
    import sqlite3

    build_length_index(fresh_dataset, task_encoder=SyntheticTaskEncoder())
    con = sqlite3.connect(LengthIndex.open(fresh_dataset).path)
    con.execute("UPDATE meta SET value = '999' WHERE name = 'index_version'")
    con.commit()
    con.close()
    with pytest.raises(LengthIndexError, match=r"index_version = '999'.*reads version 1"):
        LengthIndex.open(fresh_dataset)


def test_a_sample_missing_from_the_index_names_its_key(fresh_dataset):
    write_length_index(fresh_dataset, [("web-00000000", 10.0)], computed_by="test")
    cfg = OrderingConfig(length_sort_pool_size=16, length_sort_placement="pre-encode")
    loader = build_train_loader(fresh_dataset, ordering=cfg, task_encoder_factory=IndexedSyntheticTaskEncoder)
    with pytest.raises(LengthIndexError, match=r"sample 'web-000000\d\d' of .* is not in .*--split-part"):
        next(iter(loader))
    close_loader(loader)


def test_duplicate_keys_and_bad_lengths_are_refused(fresh_dataset):
    with pytest.raises(LengthIndexError, match=r"sample key 'a' occurs twice"):
        write_length_index(fresh_dataset, [("a", 1), ("b", 2), ("a", 3)], computed_by="test")
    with pytest.raises(LengthIndexError, match=r"length of sample 'b' is nan"):
        write_length_index(fresh_dataset, [("a", 1), ("b", float("nan"))], computed_by="test")
    assert not index_path(fresh_dataset).exists(), "a failed build leaves no index behind"


def test_not_a_prepared_dataset(tmp_path):
    with pytest.raises(LengthIndexError, match=r"index.uuid does not exist.*energon prepare"):
        dataset_uuid(tmp_path)


def test_index_built_by_another_encoder_warns(fresh_dataset):
    # the estimator `energon-ordering index` uses by default, not the training encoder
    build_length_index(fresh_dataset, task_encoder=LengthEstimateTaskEncoder())
    with pytest.warns(UserWarning, match=r"computed by task encoder .*LengthEstimateTaskEncoder.*--task-encoder"):
        _pre_encode_pipeline(fresh_dataset)


def test_cli_index_command(fresh_dataset):
    result = CliRunner().invoke(main, ["index", str(fresh_dataset), "--task-encoder",
                                       "energon_ordering.inspect.synthetic_task:SyntheticTaskEncoder"])
    assert result.exit_code == 0, result.output
    assert "96" in result.output and "energon_ordering_lengths." in result.output
    assert LengthIndex.open(fresh_dataset).computed_by.endswith("SyntheticTaskEncoder")
    bad = CliRunner().invoke(main, ["index", str(fresh_dataset), "--raw-length-fn", "os:nope"])
    assert bad.exit_code != 0 and "--raw-length-fn" in bad.output


def test_build_length_index_tool(fresh_dataset):
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "build_length_index.py"), str(fresh_dataset),
         "--task-encoder", "energon_ordering.inspect.synthetic_task:SyntheticTaskEncoder"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert LengthIndex.open(fresh_dataset).samples == 96


class PilOnlyEncoder(SyntheticTaskEncoder):
    """Megatron-LM's examples/multimodal encoder calls ``image.convert(...)``: it needs the PIL
    images its loader asks Energon for (``image_decode="pil"``)."""

    def encode_sample(self, sample):
        sample.image.convert("RGB")
        return super().encode_sample(sample)


def test_cli_index_decodes_images_as_the_loader_does(fresh_dataset):
    args = ["index", str(fresh_dataset), "--task-encoder", "test_length_index:PilOnlyEncoder"]
    torch_images = CliRunner().invoke(main, args)
    assert torch_images.exit_code != 0 and "convert" in torch_images.output
    pil = CliRunner().invoke(main, [*args, "--image-decode", "pil"])
    assert pil.exit_code == 0, pil.output
    assert LengthIndex.open(fresh_dataset).samples == 96
