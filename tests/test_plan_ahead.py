"""Planning the next window off the critical path (issue 32): PlanAhead, and the planned
sources planning window w+1 while w is consumed without changing a sample of the order.

Real prepared datasets, real ``get_train_dataset`` + ``get_savable_loader`` per simulated rank;
planning ahead is switched off through the package's own constant (``PLAN_AHEAD``) to compare.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
import sys

import pytest

from energon_ordering import OrderingConfig
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    resume,
    run_with_cuts,
)
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.pipeline import planned_source
from energon_ordering.pipeline.plan_ahead import THREAD_NAME, PlanAhead
from energon_ordering.pipeline.shared_plans import PLAN_DIR_ENV

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

K, M = 2, 2  # a window is K x M = 4 micro-batches of a rank


def _planning_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


# -- PlanAhead --------------------------------------------------------------------------------

def test_a_value_is_taken_by_its_key_only():
    ahead = PlanAhead()
    ahead.start(("w", 1), lambda: 41 + 1)
    assert ahead.take(("w", 2)) == (False, None)  # another key: computed by the caller
    assert ahead.take(("w", 1)) == (True, 42)
    assert ahead.take(("w", 1)) == (False, None)  # taken once
    assert not _planning_threads()


def test_an_error_on_the_thread_is_left_to_the_caller():
    ahead = PlanAhead()
    ahead.start(1, lambda: 1 / 0)
    assert ahead.take(1) == (False, None)


def test_a_new_job_or_cancel_joins_the_old_one():
    gate = threading.Event()
    ahead = PlanAhead()
    ahead.start(1, lambda: gate.wait(5) and "first")
    assert ahead.busy()
    ahead.start(1, lambda: "again")  # the same job under way: kept
    gate.set()
    ahead.start(2, lambda: "second")  # the first is joined and dropped
    assert ahead.take(1) == (False, None)
    assert ahead.take(2) == (True, "second")
    ahead.start(3, lambda: time.sleep(0.05))
    ahead.cancel()
    assert not ahead.busy() and not _planning_threads()


def test_a_copy_from_another_process_is_replaced():
    ahead = PlanAhead()
    assert PlanAhead.for_this_process(ahead) is ahead
    ahead.pid = -1  # as in a forked loader worker: the parent's thread is not ours
    assert PlanAhead.for_this_process(ahead) is not ahead
    assert PlanAhead.for_this_process(None) is not None


# -- the planned sources ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two indexed sources (web: short, code: long; weights 0.7 / 0.3) and their metadataset."""
    return indexed_synthetic(
        tmp_path_factory.mktemp("plan_ahead"),
        [SourceSpec("web", 200, "short", weight=0.7), SourceSpec("code", 120, "long", weight=0.3)],
        shard_size=32)


def _loader(data, *, packed=False, mix="step", num_workers=0, rank=0, world_size=2):
    ordering = OrderingConfig(
        length_sort_mode="planned", length_sort_placement="pre-encode",
        length_sort_pool_holds="keys", micro_batches_per_step=M, seed=7, plan_window_steps=K,
        planned_mix=mix, pack_seq_length=1024 if packed else None,
        seq_length_warmup={"start": 256, "full": 2048, "warmup_steps": 6})
    return build_train_loader(data, ordering=ordering, rank=rank, world_size=world_size,
                              num_workers=num_workers, batch_size=1 if packed else 4,
                              packing_buffer_size=32 if packed else None,
                              task_encoder_factory=IndexedSyntheticTaskEncoder)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_next_window_is_planned_while_this_one_is_consumed(data, tmp_path, monkeypatch,
                                                               packed):
    """After the first micro-batch of window 0 the plan of window 1 appears in the node's
    shared plans without micro-batch 4 (window 1's first) being asked for."""
    folder = tmp_path / "plans"
    monkeypatch.setenv(PLAN_DIR_ENV, str(folder))
    loader = _loader(data, packed=packed)
    it = iter(loader)
    next(it)
    deadline = time.monotonic() + 30
    while len(list(folder.glob("plan-*.npy"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(list(folder.glob("plan-*.npy"))) == 2  # window 0, and window 1 ahead
    del it
    close_loader(loader)
    assert not _planning_threads()


CUTS = [0, 2, 3, 5, 7, 11]  # 3, 7, 11: before the last micro-batch of windows 0, 1, 2


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("mix", ["step", "window"])
def test_planning_ahead_changes_nothing_and_resumes_exactly(data, monkeypatch, packed, mix):
    """The same micro-batches with and without planning ahead, across window boundaries; a
    state saved mid-window or before a window's last micro-batch resumes exactly; no planning
    thread outlives its loader."""
    total = 14

    def make():
        return _loader(data, packed=packed, mix=mix, rank=1)

    records, states = run_with_cuts(make, total, CUTS)
    for cut in CUTS:
        assert resume(make, states[cut], total - cut) == records[cut:], cut
    assert not _planning_threads()
    monkeypatch.setattr(planned_source, "PLAN_AHEAD", False)
    assert run_with_cuts(make, total, [])[0] == records


@pytest.mark.slow  # loader worker processes
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_forked_loader_workers_plan_ahead_alike(data, monkeypatch, packed):
    """Two forked loader workers, each planning its next window on its own thread: the order
    of the in-process loader, and a resume before a window's last micro-batch continues it."""
    total = 12

    def make(workers):
        return lambda: _loader(data, packed=packed, num_workers=workers, rank=1)

    inline, _ = run_with_cuts(make(0), total, [])
    records, states = run_with_cuts(make(2), total, [3, 7])
    assert records == inline
    for cut in (3, 7):
        assert resume(make(2), states[cut], total - cut) == records[cut:], cut
