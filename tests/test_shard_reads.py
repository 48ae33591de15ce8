"""Byte-range reads check what they read: every byte of the range, and the tar header of every
part names that part of that sample with the index's size. A shard changed after `energon
prepare` raises ShardReadError (naming shard, sample and fix) instead of emitting a cut sample or
letting the decoder's error handler skip garbage one sample at a time."""

from __future__ import annotations

import io
import shutil
import sqlite3
import tarfile
from pathlib import Path

import pytest

from energon_ordering import OrderingConfig, ShardReadError
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.build import build_length_index
from energon_ordering.pool.byte_range_reader import ByteRangeReader, tar_members_problem

LEAN = OrderingConfig(length_sort_pool_size=16, length_sort_mode="batch", seed=3,
                      length_sort_placement="pre-encode", length_sort_pool_holds="keys")
FIX = r"run `energon prepare .*` again, then `energon-ordering index .*`"


@pytest.fixture(scope="module")
def web(tmp_path_factory) -> Path:
    """64 samples in 4 shards of 16, with a length index (the lean pool fills from the indexes)."""
    root = tmp_path_factory.mktemp("shard_reads")
    make_synthetic_dataset(root, [SourceSpec("web", 64, "short")], shard_size=16)
    build_length_index(root / "web", task_encoder=IndexedSyntheticTaskEncoder())
    return root / "web"


def _copy(web: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(web, tmp_path / "web"))


def _parts(path: Path, shard: int, sample: int) -> list[tuple[str, int, int]]:
    con = sqlite3.connect(path / ".nv-meta" / "index.sqlite")
    try:
        return con.execute(
            "SELECT part_name, content_byte_offset, content_byte_size FROM sample_parts "
            "WHERE tar_file_id = ? AND sample_index = ? ORDER BY content_byte_offset",
            (shard, sample)).fetchall()
    finally:
        con.close()


def _rewrite_captions(shard: Path, extra: bytes) -> None:
    """The same members (same keys, same order) with longer captions: other byte ranges."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w") as tar:
        for member, data in members:
            if member.name.endswith(".txt"):
                data += extra
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def _run_epoch(path: Path, num_workers: int) -> list[str]:
    loader = build_train_loader(path, ordering=LEAN, num_workers=num_workers, batch_size=4,
                                repeat=False, task_encoder_factory=IndexedSyntheticTaskEncoder)
    try:
        return [k for batch in loader for k in batch.keys]
    finally:
        close_loader(loader)


def _reader(path: Path) -> ByteRangeReader:
    return ByteRangeReader(path, [(f"shard-{i:06d}.tar", 16) for i in range(4)])


def test_an_intact_dataset_reads_every_sample(web):
    assert sorted(_run_epoch(web, 0)) == [f"web-{i:08d}" for i in range(64)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_truncated_shard_raises_instead_of_emitting_half_a_sample(web, tmp_path, num_workers):
    # Before: the last sample of shard 1 came out with half its caption, silently (Energon's own
    # reader raises tarfile.ReadError on the same data).
    path = _copy(web, tmp_path)
    _, offset, size = _parts(path, 1, 15)[-1]
    shard = path / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[: offset + size // 2])
    with pytest.raises(ShardReadError, match=(
            rf"shard .*shard-000001\.tar does not hold sample 'web-00000031' \(sample 15 of the "
            rf"shard, index 31\) where .*index\.sqlite says: the shard ends at byte "
            rf"{offset + size // 2}, inside the sample's byte range .*{FIX}")):
        _run_epoch(path, num_workers)


def test_a_shard_replaced_with_the_same_keys_and_other_sizes_raises(web, tmp_path):
    # Before: 13-15 of 64 samples were read at stale offsets, failed to decode and were skipped
    # with a traceback each; the epoch ended "normally" without them.
    path = _copy(web, tmp_path)
    _rewrite_captions(path / "shard-000001.tar", b" and more" * 40)
    with pytest.raises(ShardReadError, match=rf"shard-000001\.tar does not hold sample .*{FIX}"):
        _run_epoch(path, 0)


def test_every_part_header_is_checked_not_only_the_first(web, tmp_path):
    # The first sample of a rewritten shard keeps its first member (json) at the index's offset
    # with its size; only the caption (the last member) grew.
    path = _copy(web, tmp_path)
    _rewrite_captions(path / "shard-000001.tar", b" and more" * 40)
    parts = _parts(path, 1, 0)
    assert [p[0] for p in parts][-1] == "txt"
    with pytest.raises(ShardReadError, match=(
            r"does not hold sample 'web-00000016' \(sample 0 of the shard, index 16\) where "
            rf".*says: tar member 'web-00000016\.txt' holds {parts[-1][2] + 360} bytes, the "
            rf"index says {parts[-1][2]}\. .*{FIX}")):
        _reader(path).read(16)
    assert _reader(path).read(0)["__key__"] == "web-00000000"  # shard 0 is intact


def test_a_sample_at_another_samples_offset_is_named(web, tmp_path):
    # Shard 2's file replaced by shard 3's: a valid header at the first sample's offset, of
    # another sample (elsewhere no header at all: "no tar header at byte ...").
    path = _copy(web, tmp_path)
    shutil.copy(path / "shard-000003.tar", path / "shard-000002.tar")
    with pytest.raises(ShardReadError, match=(
            r"sample 'web-00000032' .*says: the tar member there is 'web-00000048\.json', not "
            r"'web-00000032\.json'")):
        _reader(path).read(32)
    with pytest.raises(ShardReadError, match=r"sample 'web-00000037' .*says: no tar header at"):
        _reader(path).read(37)


def _tar(members: list[tuple[str, bytes]], fmt: int) -> tuple[bytes, list[tuple[str, int, int]]]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        parts = [(m.name.rsplit(".", 1)[1], m.offset_data, m.size) for m in tar.getmembers()]
    return buf.getvalue(), parts


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
@pytest.mark.parametrize("key", ["s0", "dir/" + "k" * 60 + "/sample", "x" * 120])
def test_the_header_check_accepts_every_tar_format_and_long_names(fmt, key):
    if fmt == tarfile.USTAR_FORMAT and len(key) > 100 and "/" not in key:
        pytest.skip("ustar cannot store a 120-byte name without a '/'")
    data, parts = _tar([(f"{key}.json", b"{}"), (f"{key}.txt", b"hello")], fmt)
    assert tar_members_problem(data, 0, key, parts) is None
    assert "not 'other.json'" in tar_members_problem(data, 0, "other", parts)
    wrong = [(p, o, s + 1) for p, o, s in parts]
    assert "holds 2 bytes, the index says 3" in tar_members_problem(data, 0, key, wrong)
    assert "no tar header at byte 0" in tar_members_problem(b"\1" * len(data), 0, key, parts)
