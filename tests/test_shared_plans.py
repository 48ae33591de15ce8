"""Window plans shared by a node's processes (``pipeline/shared_plans.py``): one process plans,
the others map its file; the order never depends on who planned it."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest
from megatron.energon import WorkerConfig

from energon_ordering.length_index.lengths_file import split_lengths
from energon_ordering.pipeline.planned_source import PlannedSourceDataset
from energon_ordering.pipeline.shared_plans import PLAN_DIR_ENV, SharedPlans, plan_dir

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
    assert plan_dir().name == "energon_ordering_plans"


def _source(lengths, rank: int, world_size: int = 4) -> PlannedSourceDataset:
    return PlannedSourceDataset(
        [None, None], [[], []], lengths, weights=[0.6, 0.4], seed=3, window_steps=2,
        micro_batches_per_step=2, batch_size=4,
        worker_config=WorkerConfig(rank=rank, world_size=world_size, num_workers=0),
    )


def test_ranks_of_a_node_share_plans_and_read_the_same_order(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    values = [rng.integers(10, 4000, n).astype(float) for n in (500, 300)]
    mapped = [split_lengths(tmp_path / f"lengths-{s}.npy", lambda v=v: v)
              for s, v in enumerate(values)]
    monkeypatch.setenv(PLAN_DIR_ENV, "off")
    alone = [[_source(values, r).micro_batch_ids(b).tolist() for b in range(12)] for r in range(4)]
    monkeypatch.setenv(PLAN_DIR_ENV, str(tmp_path / "plans"))
    shared = [[_source(mapped, r).micro_batch_ids(b).tolist() for b in range(12)] for r in range(4)]
    assert shared == alone
    # 12 micro-batches of M = 2 per step, K = 2 steps per window: windows 0, 1 and 2, one file
    # each, written once for the four ranks
    assert len(list((tmp_path / "plans").glob("plan-*.npy"))) == 3
