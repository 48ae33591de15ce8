"""sqlite files (Energon's index.sqlite, length indexes) open read-only from any folder name, and a
length index that breaks under a running loader is a typed error naming the file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from energon_ordering import LengthIndexError, OrderingConfig
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.build import build_length_index

LEAN = OrderingConfig(length_sort_pool_size=16, length_sort_mode="batch", seed=3,
                      length_sort_placement="pre-encode", length_sort_pool_holds="keys")


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _lean_keys(path: Path, batches: int, num_workers: int = 0) -> list[str]:
    loader = build_train_loader(path, ordering=LEAN, num_workers=num_workers, batch_size=4,
                                task_encoder_factory=IndexedSyntheticTaskEncoder)
    it = iter(loader)
    try:
        return [k for _ in range(batches) for k in next(it).keys]
    finally:
        del it
        close_loader(loader)


def test_uri_metacharacters_in_folder_names_are_taken_literally(tmp_path):
    from energon_ordering.sqlite_file import connect_readonly, readonly_uri

    folder = tmp_path / "d#a?t%a" / "x y"
    folder.mkdir(parents=True)
    db = folder / "f.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    before = _files(tmp_path)
    assert "%23" in readonly_uri(db) and readonly_uri(db).endswith("?mode=ro")
    con = connect_readonly(db)
    assert con.execute("SELECT name FROM sqlite_master").fetchall() == [("t",)]
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        con.execute("INSERT INTO t VALUES (1)")
    con.close()
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        connect_readonly(folder / "missing.sqlite")
    assert _files(tmp_path) == before  # nothing created, not even the missing file


def test_the_lean_pool_runs_from_a_folder_named_with_uri_metacharacters(tmp_path):
    # Before: "index unreadable or corrupt" from every loader, and an empty file named after the
    # path cut at '#' (here tmp_path / "d") created next to the dataset.
    # (webdataset's ShardWriter takes '%' for a format pattern: the data is written elsewhere.)
    make_synthetic_dataset(tmp_path / "plain", [SourceSpec("web", 48, "short")], shard_size=16)
    path = (tmp_path / "plain").rename(tmp_path / "d#a?t%a") / "web"
    build_length_index(path, task_encoder=IndexedSyntheticTaskEncoder())
    before = _files(tmp_path)
    keys = _lean_keys(path, 6)
    assert len(keys) == 24 and all(k.startswith("web-") for k in keys)
    assert _files(tmp_path) == before
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("holds,num_workers", [("keys", 0), ("keys", 1), ("raw", 0)])
def test_a_length_index_corrupted_under_a_running_loader_names_the_file(tmp_path, holds,
                                                                       num_workers):
    # Before: a bare sqlite3.DatabaseError ("file is not a database") in the loader (worker),
    # without the file's name. holds="keys" reads lengths joined to Energon's index (the
    # byte-range reader), holds="raw" looks them up one by one (LengthIndex.length).
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 48, "short")], shard_size=16)
    path = tmp_path / "web"
    build_length_index(path, task_encoder=IndexedSyntheticTaskEncoder())
    cfg = OrderingConfig(**{**LEAN.to_dict(), "length_sort_pool_holds": holds})
    loader = build_train_loader(path, ordering=cfg, num_workers=num_workers, batch_size=4,
                                task_encoder_factory=IndexedSyntheticTaskEncoder)
    index_file = next(path.glob(".nv-meta/energon_ordering_lengths*.sqlite"))
    # The loader opened (and checked) the index when it was built; the file breaks afterwards.
    index_file.write_bytes(b"\0" * 4096 * 4)
    with pytest.raises(LengthIndexError, match=(
            rf"{index_file.name} is unreadable or corrupt .*energon-ordering index")):
        next(iter(loader))
    close_loader(loader)
