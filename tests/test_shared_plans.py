"""Window plans shared by a node's processes (``pipeline/shared_plans.py``): one process plans,
the others map its file; the order never depends on who planned it."""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import sys
import os
import stat
import time
from pathlib import Path

import numpy as np
import pytest
from megatron.energon import WorkerConfig

from energon_ordering import OrderingConfig
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.lengths_file import split_lengths
from energon_ordering.pipeline.planned_source import PlannedSourceDataset
from energon_ordering.pipeline.shared_plans import (
    MAX_AGE_S,
    PLAN_DIR_ENV,
    UNWRITTEN_LOCK_S,
    SharedPlans,
    folder_refusal,
    forget_stream,
    plan_dir,
)
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.packs import plan_packed_window
from energon_ordering.planned.plan_check import packed_plan_matches_inputs
from energon_ordering.planned.window import plan_window, window_draws, window_weights

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

SHAPE = (2, 3, 2, 4)


def _ids(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, SHAPE).astype(np.int64)


def test_the_first_process_plans_and_the_next_maps_its_file(tmp_path):
    calls = []

    def plan():
        calls.append(1)
        return _ids()

    first = SharedPlans(tmp_path, "s").ids(0, "a", SHAPE, plan)
    second = SharedPlans(tmp_path, "s").ids(0, "a", SHAPE, plan)
    assert len(calls) == 1 and isinstance(second, np.memmap)
    assert np.array_equal(first, second) and np.array_equal(second, _ids())
    # other inputs, another stream or another shape: planned anew
    SharedPlans(tmp_path, "s").ids(0, "b", SHAPE, plan)
    SharedPlans(tmp_path, "t").ids(0, "a", SHAPE, plan)
    SharedPlans(tmp_path, "s").ids(0, "a", (2, 3, 2, 2), lambda: (calls.append(1), _ids()[..., :2])[1])
    assert len(calls) == 4
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob("*.tmp-*"))


def _racer(folder: str, log: str, barrier, out) -> None:
    def plan():
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)
        return _ids(7)

    barrier.wait()
    out.put(SharedPlans(Path(folder), "race").ids(4, "x", SHAPE, plan).tolist())


def test_processes_asking_at_once_plan_it_once(tmp_path):
    ctx = multiprocessing.get_context("fork")  # as loader workers start
    n = 4
    barrier, out = ctx.Barrier(n), ctx.Queue()
    log = tmp_path / "planned-by"
    procs = [ctx.Process(target=_racer, args=(str(tmp_path / "plans"), str(log), barrier, out))
             for _ in range(n)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in range(n)]
    for p in procs:
        p.join(timeout=60)
    assert got == [_ids(7).tolist()] * n
    assert len(log.read_text().split()) == 1


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    dead = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    shared = SharedPlans(tmp_path, "s", wait_s=30)
    path = tmp_path / "plan-s-000000000-a.npy"
    Path(str(path) + ".lock").write_text(f"{os.uname().nodename} {dead.pid}")
    t0 = time.monotonic()
    got = shared.ids(0, "a", SHAPE, _ids)
    assert time.monotonic() - t0 < 5 and np.array_equal(got, _ids()) and path.is_file()


def test_a_lock_held_too_long_plans_here(tmp_path):
    shared = SharedPlans(tmp_path, "s", wait_s=0.2)
    Path(tmp_path / "plan-s-000000000-a.npy.lock").write_text(f"{os.uname().nodename} {os.getpid()}")
    assert np.array_equal(shared.ids(0, "a", SHAPE, _ids), _ids())


def test_a_full_folder_plans_here(tmp_path, monkeypatch):
    """Found by review (7 December 2026): a full file system (/dev/shm is 64 MB in a default
    container) failed the lock's write, and the error left the loader."""
    import errno

    import energon_ordering.pipeline.shared_plans as shared_plans

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_plans.os, "write", full)
    got = SharedPlans(tmp_path, "s", wait_s=30).ids(0, "a", SHAPE, _ids)
    monkeypatch.undo()
    assert np.array_equal(got, _ids())
    assert not list(tmp_path.glob("*.lock"))  # its lock is not left behind


def test_a_lock_its_maker_never_wrote_is_taken_over_after_a_while(tmp_path):
    """Found by review: a process killed between making its lock and writing its host and pid
    left a lock every process waited on for wait_s, window after window."""
    lock = tmp_path / "plan-s-000000000-a.npy.lock"
    lock.write_text("")
    past = time.time() - 2 * UNWRITTEN_LOCK_S
    os.utime(lock, (past, past))
    t0 = time.monotonic()
    assert np.array_equal(SharedPlans(tmp_path, "s", wait_s=30).ids(0, "a", SHAPE, _ids), _ids())
    assert time.monotonic() - t0 < 5 and not lock.exists()
    # one just made (its maker about to write it) is waited for, as a held one
    fresh = tmp_path / "plan-s-000000001-a.npy.lock"
    fresh.write_text("")
    assert np.array_equal(SharedPlans(tmp_path, "s", wait_s=0.2).ids(1, "a", SHAPE, _ids), _ids())
    assert fresh.exists()


def test_an_unwritable_folder_plans_every_time(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    calls = []
    shared = SharedPlans(blocker / "plans", "s")
    for _ in range(2):
        assert np.array_equal(shared.ids(0, "a", SHAPE, lambda: (calls.append(1), _ids())[1]), _ids())
    assert len(calls) == 2


def test_old_windows_are_removed(tmp_path):
    shared = SharedPlans(tmp_path, "s")
    for w in range(6):
        shared.ids(w, "a", SHAPE, _ids)
    assert sorted(int(p.name.split("-")[2]) for p in tmp_path.glob("plan-s-*.npy")) == [3, 4, 5]


@pytest.mark.parametrize("value,expected", [("off", None), ("", None), ("/x/y", Path("/x/y"))])
def test_the_folder_comes_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(PLAN_DIR_ENV, value)
    assert plan_dir() == expected
    monkeypatch.delenv(PLAN_DIR_ENV)
    assert plan_dir().name == f"energon_ordering_plans-{os.getuid()}"  # one per user


def test_the_folder_and_its_files_are_the_users_alone(tmp_path, monkeypatch):
    folder = tmp_path / "a" / "plans"  # named by the user, not there yet: created 0700
    monkeypatch.setenv(PLAN_DIR_ENV, str(folder))
    seen = []

    def plan():  # runs under the lock
        seen.extend(stat.S_IMODE(p.stat().st_mode) for p in folder.glob("*.lock"))
        return _ids()

    SharedPlans(plan_dir(), "s").ids(0, "a", SHAPE, plan)
    [written] = folder.glob("plan-*.npy")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert seen == [0o600] and stat.S_IMODE(written.stat().st_mode) == 0o600
    # a folder of the user that others cannot write is used as it is
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    mine.chmod(0o755)
    assert folder_refusal(mine) is None
    SharedPlans(mine, "s").ids(0, "a", SHAPE, _ids)
    assert stat.S_IMODE(next(mine.glob("plan-*.npy")).stat().st_mode) == 0o600


def _unsafe(tmp_path: Path, how: str) -> Path:
    folder = tmp_path / "plans"
    folder.mkdir(mode=0o700)
    if how == "another user's":
        if os.getuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(folder, 12345, 12345)  # as if another user of the node created it first
    elif how == "world-writable":
        folder.chmod(0o777)
    elif how == "group-writable":
        folder.chmod(0o770)
    elif how == "a symbolic link":
        link = tmp_path / "link"
        link.symlink_to(folder, target_is_directory=True)
        return link
    return folder


@pytest.mark.parametrize("how", ["another user's", "world-writable", "group-writable",
                                 "a symbolic link"])
def test_a_folder_others_can_write_is_not_used(tmp_path, caplog, how):
    folder = _unsafe(tmp_path, how)
    calls = []
    shared = SharedPlans(folder, "s")
    with caplog.at_level(logging.INFO, logger="energon_ordering.pipeline.shared_plans"):
        for _ in range(3):  # every process plans its windows itself
            got = shared.ids(0, "a", SHAPE, lambda: (calls.append(1), _ids())[1])
            assert np.array_equal(got, _ids())
    assert len(calls) == 3 and not list(folder.iterdir())
    [line] = [r.getMessage() for r in caplog.records if str(folder) in r.getMessage()]
    assert "not shared" in line and folder_refusal(folder) is not None


def _plan_window_of(cursor: PlanCursor) -> tuple[np.ndarray, np.ndarray]:
    """A real plan of a window, and its draws."""
    plan = plan_window(LENGTHS, seed=4, cursor=cursor, weights=window_weights([0.6, 0.4], 0, 2),
                       window_steps=2, world_size=2, micro_batch=4, micro_batches_per_step=2)
    return plan.ids, window_draws([len(x) for x in LENGTHS], 4, cursor, plan.counts)


RNG = np.random.default_rng(2)
LENGTHS = [RNG.integers(10, 4000, 90).astype(float), RNG.integers(10, 4000, 60).astype(float)]


@pytest.mark.parametrize("kind", ["repeated", "out of range", "another sample"])
def test_a_planted_plan_is_not_used_and_the_window_is_planned_again(tmp_path, caplog, kind):
    ids, draws = _plan_window_of(PlanCursor.start(2))
    later, _ = _plan_window_of(PlanCursor(5, (200, 130), (0.0, 0.0)))
    shape, total = ids.shape, sum(len(x) for x in LENGTHS)
    calls = []

    def plan():
        calls.append(1)
        return ids

    SharedPlans(tmp_path, "s", total=total).ids(0, "a", shape, plan, expected=lambda: draws)
    [path] = tmp_path.glob("plan-*.npy")
    bad = ids.copy()
    flat = bad.reshape(-1)
    if kind == "repeated":
        flat[0] = flat[1]
    elif kind == "out of range":
        flat[0] = total
    else:
        flat[0] = next(x for x in later.reshape(-1) if x not in set(flat.tolist()))
    np.save(path, bad)
    with caplog.at_level(logging.WARNING, logger="energon_ordering.pipeline.shared_plans"):
        got = SharedPlans(tmp_path, "s", total=total).ids(0, "a", shape, plan,
                                                          expected=lambda: draws)
    assert np.array_equal(got, ids) and len(calls) == 2
    [line] = [r.getMessage() for r in caplog.records]
    assert str(path) in line and ("appears" in line or "outside" in line)
    assert np.array_equal(np.load(path), ids)  # written anew: the next process maps it
    assert isinstance(SharedPlans(tmp_path, "s", total=total).ids(
        0, "a", shape, plan, expected=lambda: draws), np.memmap) and len(calls) == 2


def test_a_packed_plan_is_checked_by_its_caller(tmp_path):
    """A packed plan is one flat array whose draws depend on its counts: its caller's ``check``
    (planned/plan_check.packed_plan_matches_inputs) decides."""
    inputs = dict(seed=1, cursor=PlanCursor.start(2), weights=window_weights([0.6, 0.4], 0, 2),
                  caps=[2048, 2048])
    flat = plan_packed_window(LENGTHS, world_size=2, micro_batch=2, micro_batches_per_step=2,
                              **inputs).to_array()

    def check(a):
        return packed_plan_matches_inputs(a, sizes=[len(x) for x in LENGTHS], shape=(2, 2, 2),
                                          **inputs)

    SharedPlans(tmp_path, "p").ids(0, "a", (-1,), lambda: flat, check=check)
    [path] = tmp_path.glob("plan-*.npy")
    bad = flat.copy()
    bad[-1] = bad[-2]
    np.save(path, bad)
    assert np.array_equal(SharedPlans(tmp_path, "p").ids(0, "a", (-1,), lambda: flat,
                                                         check=check), flat)
    assert np.array_equal(np.load(path), flat)


def test_forget_stream_removes_that_streams_plans_only(tmp_path):
    for stream in ("s", "t"):
        for w in range(2):
            SharedPlans(tmp_path, stream).ids(w, "a", SHAPE, _ids)
    (tmp_path / "plan-s-000000002-a.npy.lock").write_text("host 1")  # its holder's to remove
    (tmp_path / "notes.txt").write_text("")
    assert forget_stream(tmp_path, "s") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt", "plan-s-000000002-a.npy.lock", "plan-t-000000000-a.npy",
        "plan-t-000000001-a.npy"]
    assert SharedPlans(tmp_path, "t").forget() == 2
    assert forget_stream(None, "s") == 0


def test_files_older_than_a_day_are_swept_by_the_next_writer(tmp_path):
    old = time.time() - MAX_AGE_S - 60
    names = ["plan-x-000000007-a.npy", "plan-x-000000008-a.npy.lock",
             "plan-x-000000008-a.npy.tmp-host-123", "plan-s-000000000-b.npy", "notes.txt"]
    for name in names:
        (tmp_path / name).write_text("")
        os.utime(tmp_path / name, (old, old))
    (tmp_path / "plan-y-000000000-a.npy").write_text("")  # another run's, fresh: kept
    SharedPlans(tmp_path, "s").ids(0, "a", SHAPE, _ids)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt", "plan-s-000000000-a.npy", "plan-y-000000000-a.npy"]


def _source(lengths, rank: int, world_size: int = 4) -> PlannedSourceDataset:
    return PlannedSourceDataset(
        [None, None], [[], []], lengths, weights=[0.6, 0.4], seed=3, window_steps=2,
        micro_batches_per_step=2, batch_size=4,
        worker_config=WorkerConfig(rank=rank, world_size=world_size, num_workers=0),
    )


def _order(lengths, ranks: int = 4, batches: int = 12) -> list[list[list[int]]]:
    """``ids[rank][b]`` of each rank's first micro-batches."""
    return [[_source(lengths, r).micro_batch_ids(b).tolist() for b in range(batches)]
            for r in range(ranks)]


def _lengths_files(folder: Path, rng: np.random.Generator) -> tuple[list, list]:
    """Two sources' lengths, in memory and mapped from their files in ``folder``."""
    values = [rng.integers(10, 4000, n).astype(float) for n in (500, 300)]
    mapped = [split_lengths(folder / f"lengths-{s}.npy", lambda v=v: v)
              for s, v in enumerate(values)]
    return values, mapped


def test_ranks_of_a_node_share_plans_and_read_the_same_order(tmp_path, monkeypatch):
    values, mapped = _lengths_files(tmp_path, np.random.default_rng(1))
    monkeypatch.setenv(PLAN_DIR_ENV, "off")
    alone = _order(values)
    monkeypatch.setenv(PLAN_DIR_ENV, str(tmp_path / "plans"))
    assert _order(mapped) == alone
    # 12 micro-batches of M = 2 per step, K = 2 steps per window: windows 0, 1 and 2, one file
    # each, written once for the four ranks
    assert len(list((tmp_path / "plans").glob("plan-*.npy"))) == 3


def test_a_planted_plan_does_not_change_the_runs_order(tmp_path, monkeypatch):
    values, mapped = _lengths_files(tmp_path, np.random.default_rng(1))
    monkeypatch.setenv(PLAN_DIR_ENV, "off")
    alone = _order(values)
    monkeypatch.setenv(PLAN_DIR_ENV, str(tmp_path / "plans"))
    _order(mapped, ranks=1)  # writes the windows' plans
    for path in (tmp_path / "plans").glob("plan-*.npy"):  # each made to repeat a sample
        ids = np.load(path)
        ids.reshape(-1)[0] = ids.reshape(-1)[1]
        np.save(path, ids)
    assert _order(mapped) == alone


def test_lengths_of_the_same_name_and_size_but_other_values_get_their_own_plans(
        tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    runs = []
    for run in ("a", "b"):  # two datasets' lengths files: same names, same sizes
        (tmp_path / run).mkdir()
        values, mapped = _lengths_files(tmp_path / run, rng)
        monkeypatch.setenv(PLAN_DIR_ENV, "off")
        alone = _order(values)
        monkeypatch.setenv(PLAN_DIR_ENV, str(tmp_path / "plans"))
        runs.append((_order(mapped), alone))
    assert all(shared == alone for shared, alone in runs)


def test_a_lengths_file_deleted_or_replaced_mid_run_changes_neither_order_nor_plans(
        tmp_path, monkeypatch):
    """Found by review (7 December 2026): each window read the lengths files' digests anew, so
    a deleted file (as a stale index's message advises) failed the next window, and a file
    replaced under the same name named this process's plans after the other values (another
    run's plans of those were then taken: the same draws, another arrangement)."""
    rng = np.random.default_rng(1)
    values, mapped = _lengths_files(tmp_path, rng)
    monkeypatch.setenv(PLAN_DIR_ENV, "off")
    alone = _order(values, ranks=1)[0]
    monkeypatch.setenv(PLAN_DIR_ENV, str(tmp_path / "plans"))
    running = _source(mapped, 0)
    seen = [running.micro_batch_ids(b).tolist() for b in range(2)]  # window 0 planned
    files = [Path(x.filename) for x in mapped]
    others = [rng.integers(10, 4000, len(v)).astype(float) for v in values]
    for path, other, x in zip(files, others, mapped):  # replaced: same names, shapes, dtypes
        path.unlink()
        np.save(path, other.astype(x.dtype))
    monkeypatch.setenv(PLAN_DIR_ENV, "off")
    other_alone = _order(others, ranks=1)[0]
    monkeypatch.setenv(PLAN_DIR_ENV, str(tmp_path / "plans"))
    reread = [split_lengths(path, lambda: None) for path in files]
    assert _order(reread, ranks=1)[0] == other_alone  # another run writes the new ones' plans
    seen += [running.micro_batch_ids(b).tolist() for b in range(2, 12)]
    assert seen == alone
    for path in files:  # deleted: the mapped data and its digests stay this process's
        path.unlink()
    assert [running.micro_batch_ids(b).tolist() for b in range(12, 16)] == _order(
        values, ranks=1, batches=16)[0][12:]


@pytest.fixture(scope="module")
def indexed(tmp_path_factory) -> Path:
    return indexed_synthetic(
        tmp_path_factory.mktemp("shared_plans"),
        [SourceSpec("web", 160, "short", weight=0.7), SourceSpec("code", 96, "long", weight=0.3)],
        shard_size=32)


@pytest.mark.parametrize("packing", [None, 32])
def test_closed_loaders_leave_no_plans(indexed, tmp_path, monkeypatch, packing):
    """Two ranks' loaders of a node open at once share the windows' plans; closing them
    removes the plans (forget_stream), so finished runs leave nothing in the node's memory."""
    monkeypatch.setenv(PLAN_DIR_ENV, str(tmp_path / "plans"))
    ordering = OrderingConfig(
        length_sort_mode="planned", length_sort_placement="pre-encode",
        length_sort_pool_holds="keys", micro_batches_per_step=2, seed=5, plan_window_steps=2,
        pack_seq_length=1024 if packing else None)
    loaders = [build_train_loader(indexed, ordering=ordering, rank=r, world_size=2,
                                  num_workers=0, batch_size=2, packing_buffer_size=packing,
                                  task_encoder_factory=IndexedSyntheticTaskEncoder)
               for r in range(2)]
    for loader in loaders:
        for _ in itertools.islice(loader, 6):
            pass
    # windows 0 and 1, and 2, planned ahead while window 1 was consumed
    assert len(list((tmp_path / "plans").glob("plan-*.npy"))) == 3
    for loader in loaders:
        close_loader(loader)
    assert not list((tmp_path / "plans").iterdir())
