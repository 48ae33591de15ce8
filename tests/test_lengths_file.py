"""The planned order's flat lengths file (``length_index.lengths_file``): built once from the
length index joined to Energon's index, then mapped read-only by every process; never stale.

Real prepared datasets and length indexes; the join it replaces is ``ByteRangeReader``'s.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
from megatron.energon import WorkerConfig, load_dataset

from energon_ordering import OrderingConfig
from energon_ordering.inspect.rank_simulation import run_ranks
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.build import build_length_index
from energon_ordering.length_index.index import LengthIndex, length_index_files
from energon_ordering.length_index import lengths_file
from energon_ordering.length_index.lengths_file import lengths_content_digest, split_lengths
from energon_ordering.pipeline.planned_source import PlannedSourceDataset, indexed_lengths
from energon_ordering.pool.byte_range_reader import ByteRangeReader


@pytest.fixture()
def web(tmp_path) -> Path:
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 70, "trimodal")], shard_size=16)
    build_length_index(tmp_path / "web", task_encoder=IndexedSyntheticTaskEncoder())
    return tmp_path / "web"


def _reader(folder: Path) -> ByteRangeReader:
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    factory = load_dataset(folder).get_datasets(
        training=True, split_part="train", worker_config=wc,
    ).datasets[0].dataset
    index = LengthIndex.open(folder)
    return ByteRangeReader(folder, [(s.name, s.count) for s in factory.shards],
                           lengths=index.path, lengths_digest=index.digest)


def _files(folder: Path) -> list[Path]:
    return sorted((folder / ".nv-meta").glob("*.split-*.npy"))


def test_the_index_build_writes_it_and_a_planned_run_maps_it(web):
    [written] = _files(web)  # written by build_length_index (`energon-ordering index`)
    mtime = written.stat().st_mtime_ns
    run_ranks(web, ordering=OrderingConfig(
        length_sort_mode="planned", length_sort_placement="pre-encode",
        length_sort_pool_holds="keys", micro_batches_per_step=2, seed=1, plan_window_steps=2),
        world_size=2, steps=4, batch_size=4, task_encoder_factory=IndexedSyntheticTaskEncoder)
    assert _files(web) == [written] and written.stat().st_mtime_ns == mtime


def test_built_once_then_mapped_with_the_joins_values(web):
    for f in _files(web):
        f.unlink()
    reader = _reader(web)
    joined, missing = reader.lengths_array()
    assert missing is None
    first = indexed_lengths(reader, web)
    [written] = _files(web)
    mtime = written.stat().st_mtime_ns
    again = indexed_lengths(_reader(web), web)
    assert isinstance(again, np.memmap) and not again.flags.writeable
    assert written.stat().st_mtime_ns == mtime  # mapped, not rebuilt
    # integer lengths are stored as float32, and equal the join's float64 values exactly
    assert again.dtype == np.float32
    assert np.array_equal(np.asarray(first, dtype=np.float64), joined)
    assert np.array_equal(np.asarray(again, dtype=np.float64), joined)


def test_other_shards_or_a_rebuilt_index_get_another_file(web):
    reader = _reader(web)
    indexed_lengths(reader, web)
    part = ByteRangeReader(web, reader.shards[:2], lengths=reader.lengths,
                           lengths_digest=reader.lengths_digest)
    assert len(indexed_lengths(part, web)) == sum(n for _, n in reader.shards[:2])
    assert len(_files(web)) == 2
    # the same index rebuilt with other values: a new digest, a new file, the new values
    [name] = length_index_files(web)
    build_length_index(web, raw_length_fn=lambda raw: 7.5, name=name)
    fresh = indexed_lengths(_reader(web), web)
    assert len(_files(web)) == 3
    assert fresh.dtype == np.float32 and set(np.asarray(fresh).tolist()) == {7.5}


def test_values_float32_cannot_hold_stay_float64(tmp_path):
    values = np.array([1.0, 2.0, 16_777_217.0, 0.1])
    out = split_lengths(tmp_path / "x.npy", lambda: values)
    assert out.dtype == np.float64 and np.array_equal(out, values)


def test_a_read_only_file_system_keeps_the_lengths_in_memory(tmp_path, monkeypatch):
    """A write that fails (a read-only file system or folder) leaves no file behind."""
    def refuse(*a, **k):
        raise PermissionError(30, "Read-only file system")
    monkeypatch.setattr(np, "save", refuse)
    out = split_lengths(tmp_path / "x.npy", lambda: np.arange(5.0))
    assert not isinstance(out, np.memmap) and np.array_equal(out, np.arange(5.0))
    assert list(tmp_path.iterdir()) == []


def test_a_pickled_planned_source_maps_its_lengths_again(web):
    reader = _reader(web)
    lengths = indexed_lengths(reader, web)
    ds = PlannedSourceDataset(
        [reader], [[]], [lengths], weights=[1.0], seed=1, window_steps=2,
        micro_batches_per_step=2, batch_size=4,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
    )
    blob = pickle.dumps(ds)
    assert b"lengths_file" in blob  # the file's path, not a copy of its values
    back = pickle.loads(blob)
    assert isinstance(back.lengths[0], np.memmap)
    assert np.array_equal(back.lengths[0], lengths)
    assert back.micro_batch_ids(0).tolist() == ds.micro_batch_ids(0).tolist()


def test_the_content_digest_follows_the_values_not_the_name_or_size(tmp_path, monkeypatch):
    """Plans a node shares are keyed by this digest: a file of the same name and size whose
    values differ (an edit in place with its modification time put back, or another file
    renamed over it) gets another digest; an unchanged file is read from its sidecar, never
    hashed again."""
    path = tmp_path / "lengths.npy"
    out = split_lengths(path, lambda: np.arange(1000.0))
    first = lengths_content_digest(out)
    same = np.arange(1000.0, dtype=np.float32)  # the file's values, in memory
    assert first == lengths_content_digest(path) == lengths_content_digest(same)
    assert (tmp_path / "lengths.npy.digest.json").is_file()
    hashed = []
    real = lengths_file._array_digest
    monkeypatch.setattr(lengths_file, "_array_digest", lambda a: (hashed.append(1), real(a))[1])
    monkeypatch.setattr(lengths_file, "_DIGESTS", {})  # as in a fresh process: the sidecar
    assert lengths_content_digest(path) == first and hashed == []
    # a slice of the map is not the file's content
    assert lengths_content_digest(out[:10]) == real(np.arange(10.0, dtype=np.float32))

    st = path.stat()
    time.sleep(0.05)  # past the file system's timestamp granularity
    with open(path, "r+b") as f:  # the same size, one value changed, the times put back
        f.seek(-4, 2)
        f.write(np.float32(7.0).tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    edited = lengths_content_digest(path)
    assert edited != first and edited == real(np.load(path))
    time.sleep(0.05)
    np.save(tmp_path / "other.npy", np.arange(1000.0, dtype=np.float32)[::-1].copy())
    os.replace(tmp_path / "other.npy", path)  # another file under the name
    assert lengths_content_digest(path) not in (first, edited)
