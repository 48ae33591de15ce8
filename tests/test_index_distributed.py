"""The distributed length index build, in milliseconds: the shard split, the launcher's variables,
the part files and the merge's coverage (pure), and the build's protocol run by two ranks as
threads of this process over one shared store (real prepared datasets, real Energon loading; the
real torchrun runs are in tests/test_index_distributed_run.py, slow tier)."""

from __future__ import annotations

import io
import json
import os
import random
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from energon_ordering.errors import LengthIndexError
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.length_index.build import build_length_index
from energon_ordering.length_index.distributed import Coordinator
from energon_ordering.length_index.launcher import launch_from_env, parse_rendezvous
from energon_ordering.length_index.parts import (
    PartOwner,
    ShardLengths,
    load_part,
    part_files,
    part_path,
    write_part,
)
from energon_ordering.length_index.shard_build import Tally, covered
from energon_ordering.length_index.shard_split import split_shards

# -- the shard split ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_the_split_covers_every_shard_once_in_order_balanced_by_samples(seed):
    rng = random.Random(seed)
    counts = [rng.choice([0, 1, 7, 256, 1000, rng.randrange(2000)])
              for _ in range(rng.randrange(0, 300))]
    world = rng.choice([1, 2, 3, 8, 64, 500])
    shares = split_shards(counts, world)
    assert len(shares) == world
    assert [p for share in shares for p in share] == list(range(len(counts)))
    ideal = sum(counts) / world
    largest = max(counts, default=0)
    for share in shares:
        assert abs(sum(counts[p] for p in share) - ideal) <= largest


def test_the_split_balances_samples_not_shards():
    # one big shard and many small ones: shards split 1 : 100, samples about evenly
    shares = split_shards([1000] + [10] * 100, 2)
    assert list(shares[0]) == [0] and list(shares[1]) == list(range(1, 101))


# -- the launcher's variables ------------------------------------------------------------------


def test_torchrun_and_srun_variables():
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "n0", "MASTER_PORT": "29500",
                "TORCHELASTIC_USE_AGENT_STORE": "True"}
    launch = launch_from_env(torchrun)
    assert (launch.rank, launch.world_size, launch.host, launch.port, launch.agent_store) == (
        1, 4, "n0", 29500, True)
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"}
    launch = launch_from_env(slurm, "node7:1234")
    assert (launch.rank, launch.world_size, launch.host, launch.port, launch.launcher) == (
        3, 8, "node7", 1234, "slurm")
    assert launch_from_env({}) is None
    assert launch_from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    # a batch script's own step (no srun, no rendezvous) is one process
    assert launch_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}) is None


@pytest.mark.parametrize("env,rendezvous,match", [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "abc", "SLURM_STEP_ID": "0"}, "h:1",
     r"SLURM_NTASKS = 'abc' is not an integer >= 1"),
    ({"SLURM_PROCID": "-1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "h:1",
     r"SLURM_PROCID = '-1'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, None,
     r"RANK = 2 is not below WORLD_SIZE = 2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "x"}, None,
     r"MASTER_ADDR:MASTER_PORT = 'h:x' is not HOST:PORT"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, None,
     r"no rendezvous is named .* --rendezvous"),
    ({}, "h:1", r"--rendezvous 'h:1' was given, but neither torchrun"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "h:99999", r"--rendezvous = 'h:99999'"),
])
def test_malformed_launcher_variables_are_one_line(env, rendezvous, match):
    with pytest.raises(LengthIndexError, match=match) as e:
        launch_from_env(env, rendezvous)
    assert "\n" not in str(e.value)


def test_rendezvous_parsing():
    assert parse_rendezvous("node001:29500") == ("node001", 29500)
    assert parse_rendezvous("[::1]:80") == ("::1", 80)


# -- parts -------------------------------------------------------------------------------------


def _owner(**kw) -> PartOwner:
    return PartOwner(**{"package_version": "0.1.0", "dataset_uuid": "u1", "split_part": "train",
                        "computed_by": "raw_length_fn m.f", "world_size": 2, "rank": 1, **kw})


def _shard(pos: int, n: int = 3, measured: bool = True) -> ShardLengths:
    return ShardLengths(pos, f"shard-{pos}.tar", f"d{pos}", 10, 20,
                        [f"k{pos}-{i}" for i in range(n)], [float(i) for i in range(n)],
                        measured=measured)


def test_a_part_is_written_atomically_and_read_back(tmp_path):
    path = part_path(tmp_path / "idx.sqlite", 1, 2)
    assert path.name == "idx.sqlite.part-1-of-2"
    write_part(path, _owner(), [_shard(2), _shard(3)])
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    shards, why = load_part(path, _owner(), [(2, "shard-2.tar"), (3, "shard-3.tar")])
    assert why == "reused" and shards == [_shard(2), _shard(3)]
    assert part_files(tmp_path / "idx.sqlite") == [path]


@pytest.mark.parametrize("owner,expect,why", [
    (_owner(dataset_uuid="u2"), None, "dataset_uuid 'u1', now 'u2'"),
    (_owner(computed_by="raw_length_fn m.g"), None, "computed_by"),
    (_owner(world_size=3), None, "world_size 2, now 3"),
    (_owner(), [(2, "shard-2.tar")], "another split"),
])
def test_a_part_of_another_build_is_not_reused_and_says_why(tmp_path, owner, expect, why):
    path = tmp_path / "p"
    write_part(path, _owner(), [_shard(2), _shard(3)])
    shards, reason = load_part(path, owner, expect or [(2, "shard-2.tar"), (3, "shard-3.tar")])
    assert shards is None and why in reason


def test_a_damaged_part_is_recomputed_and_another_versions_refused(tmp_path):
    path = tmp_path / "p"
    write_part(path, _owner(), [_shard(2)])
    record = json.loads(path.read_text())
    record["shards"][0]["lengths"][0] = 99.0
    path.write_text(json.dumps(record))
    assert load_part(path, _owner(), [(2, "shard-2.tar")]) == (
        None, "its content digest does not match (damaged)")
    write_part(path, _owner(package_version="0.0.9"), [_shard(2)])
    with pytest.raises(LengthIndexError, match=r"written by energon-ordering '0.0.9'.*Delete "
                                               r"the parts \(rm .*p\.part-\*\)"):
        load_part(path, _owner(), [(2, "shard-2.tar")])


# -- the merge's coverage ----------------------------------------------------------------------

SPLIT = [(f"shard-{p}.tar", 3) for p in range(4)]


def test_the_merge_yields_every_sample_in_split_order():
    tally = Tally()
    pairs = list(covered("ds", SPLIT, True, iter([_shard(p, measured=p != 1)
                                                     for p in range(4)]), tally))
    assert [k for k, _ in pairs] == [f"k{p}-{i}" for p in range(4) for i in range(3)]
    assert tally.measured == 9 and [s[0] for s in tally.stamps] == [n for n, _ in SPLIT]


@pytest.mark.parametrize("shards,match", [
    ([0, 1, 3], r"hold shard 3 \(shard-3.tar\) where shard 2 \(shard-2.tar\) comes next"),
    ([0, 1, 1, 2, 3], r"hold shard 1 .* where shard 2"),
    ([0, 1, 2], r"cover 3 of the split's 4 shards"),
    ([0, 1, 2, 3, 3], r"hold shard 3 .* where shard 4 \(\(none: all covered\)\)"),
])
def test_the_merge_refuses_a_shard_missing_or_twice(shards, match):
    with pytest.raises(LengthIndexError, match=match):
        list(covered("ds", SPLIT, True, iter([_shard(p) for p in shards]), Tally()))


def test_the_merge_refuses_a_shard_short_of_samples():
    with pytest.raises(LengthIndexError, match=r"shard-2.tar has 3 samples but its part holds 2"):
        list(covered("ds", SPLIT, True, iter([_shard(0), _shard(1), _shard(2, n=2)]),
                     Tally()))


# -- the protocol, two ranks as threads --------------------------------------------------------

MEASURED: dict[str, list[str]] = {}
FAIL_IN: set[str] = set()


def words(raw: dict) -> float:
    """Raw length function: the caption's words; records who measured what."""
    me = threading.current_thread().name
    if me in FAIL_IN:
        raise RuntimeError(f"{me} lost")
    MEASURED.setdefault(me, []).append(raw["__key__"])
    return float(len(raw["txt"].split()))


@pytest.fixture(scope="module")
def web(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    make_synthetic_dataset(root, [SourceSpec("web", 120, "short")], shard_size=16)
    return root / "web"


def _ranks(path: Path, world: int = 2, **kw) -> tuple[list, list[str]]:
    """``build_length_index`` by ``world`` threads, each a rank over one shared store; returns
    each rank's result (or exception) and the log lines."""
    import torch.distributed as dist

    store = dist.HashStore()
    results: list = [None] * world
    logs: list[str] = []

    def rank(r: int) -> None:
        coord = Coordinator(r, world, dist.PrefixStore("t/", store), stall_timeout=60)
        try:
            results[r] = build_length_index(path, raw_length_fn=words, coordinator=coord,
                                            log=logs.append, **kw)
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, logs


def test_two_ranks_write_the_one_process_index_byte_for_byte(web):
    one = build_length_index(web, raw_length_fn=words)[0].summary.path
    expected = one.read_bytes()
    lengths_files = sorted(one.parent.glob("*.npy"))
    MEASURED.clear()
    (built0, built1), logs = _ranks(web)
    assert built0[0].summary == built1[0].summary and built0[0].measured == 120
    assert one.read_bytes() == expected and sorted(one.parent.glob("*.npy")) == lengths_files
    assert sorted(len(v) for v in MEASURED.values()) == [56, 64]  # shards of 16, 16, ... 8: 4 and 4
    assert part_files(one) == []
    assert sorted(line.split(" samples")[0].split(",")[0] for line in logs) == [
        "length index: merged 2 parts", f"length index: wrote {one.name}.part-0-of-2: 64",
        f"length index: wrote {one.name}.part-1-of-2: 56"]


def test_a_rerun_after_a_lost_rank_reuses_the_finished_part(web):
    one = build_length_index(web, raw_length_fn=words)[0].summary.path
    expected = one.read_bytes()
    one.unlink()
    MEASURED.clear()
    FAIL_IN.add("rank1")
    try:
        (lost0, lost1), _ = _ranks(web)
    finally:
        FAIL_IN.clear()
    assert isinstance(lost1, LengthIndexError) and "rank1 lost" in str(lost1)
    assert isinstance(lost0, LengthIndexError) and "another process failed (rank 1" in str(lost0)
    assert not one.exists() and [p.name for p in part_files(one)] == [f"{one.name}.part-0-of-2"]
    MEASURED.clear()
    (built0, _), logs = _ranks(web)
    assert list(MEASURED) == ["rank1"]  # rank 0 measured nothing again
    assert [line for line in logs if ": wrote " not in line and ": merged " not in line] == [
        f"length index: reusing {one.name}.part-0-of-2 (64 samples of 4 shards, content digest "
        "verified)"]
    assert built0[0].measured == 120 and one.read_bytes() == expected


def test_parts_of_another_world_size_or_dataset_version_are_never_merged(web):
    one = build_length_index(web, raw_length_fn=words)[0].summary.path
    expected = one.read_bytes()
    owner = PartOwner("0.1.0", "another-uuid", "train", "x", 2, 0)
    write_part(part_path(one, 0, 2), owner, [_shard(0, n=16)])  # another index.uuid
    write_part(part_path(one, 0, 3), owner, [_shard(0, n=16)])  # another world size
    (built0, _), logs = _ranks(web)
    assert built0[0].measured == 120 and one.read_bytes() == expected
    assert any("not reusing " + part_path(one, 0, 2).name + ": it is of another build "
               "(dataset_uuid 'another-uuid'" in line for line in logs), logs
    assert any("removing 1 part(s) of a build by another number of processes" in line
               for line in logs), logs
    assert part_files(one) == []


# -- one-line errors ---------------------------------------------------------------------------

TOUCHED: list[Path] = []


def touching_words(raw: dict) -> float:
    """Raw length function that writes (touches) the shard it measures, as a writer would."""
    os.utime(TOUCHED[0] / raw["__shard__"], ns=(1, 1))
    return 1.0


def test_a_shard_written_during_the_build_fails_it_in_one_line(tmp_path):
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 20, "short")], shard_size=16)
    TOUCHED[:] = [tmp_path / "web"]
    with pytest.raises(LengthIndexError, match=r"shard .*shard-000000.tar changed during the "
                                               r"build .* run `energon prepare` again"):
        build_length_index(tmp_path / "web", raw_length_fn=touching_words)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("env,args,match", [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "abc", "SLURM_STEP_ID": "0"},
     ["--rendezvous", "127.0.0.1:29500"], r"Error: length index: the launcher variable "
                                           r"SLURM_NTASKS = 'abc' is not an integer >= 1"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"},
     ["--rendezvous-timeout", "2"], r"Error: length index: the rendezvous at 127.0.0.1:\d+ "
                                    r"could not form within 2 s .* raise --rendezvous-timeout"),
])
def test_launcher_errors_are_one_line_and_exit_2(web, env, args, match):
    from click.testing import CliRunner

    from energon_ordering.cli import main

    env = {k: v.format(port=_free_port()) for k, v in env.items()}
    result = CliRunner().invoke(main, ["index", str(web), "--raw-length-fn",
                                       "test_index_distributed:words", *args], env=env)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(match, lines[0]), result.output


def test_processes_that_disagree_on_the_world_size_fail_in_one_line():
    from energon_ordering.length_index.distributed import join
    from energon_ordering.length_index.launcher import Launch

    port = _free_port()
    errors: list = [None, None]

    def process(rank: int, world: int) -> None:
        try:
            join(Launch(rank, world, "127.0.0.1", port, "slurm"), timeout=20)
        except LengthIndexError as e:
            errors[rank] = e

    threads = [threading.Thread(target=process, args=a) for a in ((0, 2), (1, 3))]
    for t in threads:
        t.start()
        time.sleep(0.3)  # rank 0 hosts the store
    for t in threads:
        t.join(60)
    assert "disagree on the world size: this one (rank 0) says 2 (slurm), rank 1 says 3" in str(
        errors[0])
    assert "(rank 1) says 3 (slurm), rank 0 says 2" in str(errors[1])


def test_after_prepare_again_a_renamed_shard_keeps_its_lengths_and_a_changed_one_is_measured(
        tmp_path):
    """Incremental reuse is keyed by a shard's content, not its name: after one shard is
    renamed and one caption of another rewritten, `energon prepare` again measures only the
    rewritten shard's 16 samples, and the index equals a rebuild that measures every sample."""
    import tarfile

    from energon_ordering.inspect.synthetic import _energon_prepare

    make_synthetic_dataset(tmp_path, [SourceSpec("web", 120, "short")], shard_size=16)
    web = tmp_path / "web"
    assert build_length_index(web, raw_length_fn=words)[0].measured == 120
    for suffix in ("", ".idx"):
        (web / f"shard-000004.tar{suffix}").rename(web / f"moved-000004.tar{suffix}")
    changed = web / "shard-000003.tar"
    with tarfile.open(changed) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    first_caption = next(m for m, _ in members if m.name.endswith(".txt"))
    with tarfile.open(changed, "w") as tar:
        for member, data in members:
            if member is first_caption:
                data = b"a rewritten caption of seven words here"
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    _energon_prepare(web, "png")
    MEASURED.clear()
    again = build_length_index(web, raw_length_fn=words)[0]
    assert again.measured == 16 and len(next(iter(MEASURED.values()))) == 16
    assert {key for keys in MEASURED.values() for key in keys} == {
        m.name.split(".")[0] for m, _ in members}  # the rewritten shard's samples, no other
    rebuilt = build_length_index(web, raw_length_fn=words, name="rebuilt", reuse=False)[0]
    assert rebuilt.measured == 120
    assert _rows(again.summary.path) == _rows(rebuilt.summary.path)


def _rows(index: Path) -> list[tuple]:
    import sqlite3

    con = sqlite3.connect(index)
    try:
        return con.execute("SELECT sample_key, length FROM lengths ORDER BY sample_key").fetchall()
    finally:
        con.close()
