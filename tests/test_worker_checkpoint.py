"""A state saved while a loader worker has not begun iterating resumes exactly
(energon_ordering/worker_checkpoint.py): Energon's worker answered such a request with its
constructor's placeholder, and the resumed loader lost that worker's first micro-batch."""

from __future__ import annotations

import itertools
import pickle
import threading
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
from megatron.energon.flavors.base_dataset import FlexState
from megatron.energon.savable_loader import (
    SavableCheckpoint,
    SavableDatasetCheckpoint,
    SavableDatasetState,
    SavableDatasetWrapper,
)

from energon_ordering import OrderingConfig, restore_state_rank
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, record_batch
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.worker_checkpoint import not_started, workers_never_started

WORKERS = 3
LATE = WORKERS - 1  # the worker that begins iterating late
TRIES = 6


def test_only_the_constructor_placeholder_means_not_started():
    placeholder = SavableCheckpoint(state=None, checkpoint_time=0.0, sample_index=-1)
    first = SavableCheckpoint(state=object(), checkpoint_time=1.0, sample_index=0)
    assert not_started([placeholder])
    assert not not_started([placeholder, first]) and not not_started([first])
    assert not not_started([])


def test_a_not_started_worker_answers_with_a_copy_of_its_restore_state():
    """The answer is pickled later, by the result queue's feeder thread, while the worker (its
    command lock released) restores into the restore state's own objects and mutates them by
    skipping; an answer sharing them resumed with the advanced buffers (skipping twice)."""
    wrapper = object.__new__(SavableDatasetWrapper)
    restore = SavableDatasetState(rng=None, dataset_state=FlexState(buffer=[1, 2]), sample_index=1)
    wrapper._worker_id = 1
    wrapper._last_checkpoints = [SavableCheckpoint(state=None, checkpoint_time=0.0, sample_index=-1)]
    wrapper._workers_restore_from = [None, restore]
    wrapper._workers_skip_samples = [0, 2]
    answer = wrapper.get_checkpoint([-1, 0])
    assert answer.offset == 2 and answer.state.sample_index == 1
    restore.dataset_state["buffer"].append(3)  # what the worker's restore and skip do after it
    assert answer.state.dataset_state["buffer"] == [1, 2]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("late_worker")
    make_synthetic_dataset(root, [SourceSpec("web", 96, "short")], shard_size=8)
    return root / "web"


def _late_answers() -> None:
    """In a loader worker: its answers to save requests are pickled 0.3 s late. The command thread
    only puts its answer on a ``multiprocessing.Queue``, whose feeder thread pickles it when it
    gets to it, while the worker runs on; a loaded machine delays it so at random."""
    if getattr(ForkingPickler, "_late_answers", False):
        return
    dumps = ForkingPickler.dumps.__func__

    def late_dumps(cls, obj, protocol=None):
        if isinstance(obj, dict) and any(isinstance(v, SavableDatasetCheckpoint) for v in obj.values()):
            time.sleep(0.3)
        return dumps(cls, obj, protocol)

    ForkingPickler.dumps = classmethod(late_dumps)
    ForkingPickler._late_answers = True


class _YieldingFirstLock:
    """An ``RLock`` whose first ``with`` in the thread that made it waits 0.5 s first, so that
    the command thread started just before takes it first (see :func:`late_worker`)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._owner = threading.get_ident()
        self._waited = False

    def __enter__(self):
        if not self._waited and threading.get_ident() == self._owner:
            self._waited = True
            time.sleep(0.5)
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)

    def acquire(self, *args, **kwargs):
        return self._lock.acquire(*args, **kwargs)

    def release(self):
        self._lock.release()


def _command_thread_first() -> None:
    """In a loader worker: Energon's wrapper makes its command lock with
    ``savable_loader.threading.RLock()``; there it becomes a :class:`_YieldingFirstLock`, so a
    save request that waited while the worker was starting is answered before the worker's
    iteration takes the lock (and stores its first checkpoint)."""
    import megatron.energon.savable_loader as savable_loader

    class _Threading:
        RLock = _YieldingFirstLock

        def __getattr__(self, name):
            return getattr(threading, name)

    savable_loader.threading = _Threading()


@pytest.fixture
def late_worker(monkeypatch):
    """The last loader worker begins its iteration 1 s late (in the forked worker, before
    Energon's wrapper starts its command thread), so a state saved after the first micro-batch
    reaches it before it has begun, and its command thread takes the command lock before the
    iteration does (:func:`_command_thread_first`); and every worker's answer is pickled late
    (:func:`_late_answers`), after the worker has gone on. Energon's code runs unchanged; only
    its start and the pickling are delayed (in the forked workers, never in this process)."""
    original = SavableDatasetWrapper.__iter__

    def late_iter(self):
        info = torch.utils.data.get_worker_info()
        if info is not None:
            _late_answers()
        if info is not None and info.id == LATE:
            time.sleep(1.0)
            _command_thread_first()
        yield from original(self)

    monkeypatch.setattr(SavableDatasetWrapper, "__iter__", late_iter)


def _loader(path: Path):
    return build_train_loader(path, ordering=OrderingConfig(length_sort_pool_size=8, length_sort_mode="batch"),
                              num_workers=WORKERS, batch_size=4, shuffle_buffer_size=None,
                              max_samples_per_sequence=8, repeat=False)


def _epoch(path: Path) -> list:
    loader = _loader(path)
    records = [record_batch(b) for b in loader]
    close_loader(loader)
    return records


def _save_after(loader, n: int):
    """The state after ``n`` more micro-batches of ``loader`` (its iterator kept alive)."""
    it = iter(loader)
    drawn = [record_batch(next(it)) for _ in range(n)]
    state = pickle.loads(pickle.dumps(loader.save_state_rank()))
    del it
    close_loader(loader)
    return drawn, state


def _resume(path: Path, state, n: int) -> list:
    loader = _loader(path)
    restore_state_rank(loader, state)
    out = [record_batch(b) for b in itertools.islice(loader, n)]
    close_loader(loader)
    return out


@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_a_state_saved_before_a_worker_began_resumes_exactly(data, late_worker):
    epoch = _epoch(data)
    late = 0
    for _ in range(TRIES):
        drawn, state = _save_after(_loader(data), 1)
        assert drawn == epoch[:1]
        late += state.worker_states[LATE].state is None  # answered before the worker began
        assert _resume(data, state, 6) == epoch[1:7]
    assert late, "the late worker began before every save: the interleaving was not forced"


@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_a_restored_worker_saved_before_it_began_keeps_its_restore_point(data, late_worker):
    """A loader restored mid-epoch and saved again before its late worker began: that worker's
    entry is the one it was restored from (not "start afresh"), and the state resumes exactly."""
    epoch = _epoch(data)
    _, first = _save_after(_loader(data), 7)
    # a restored loader rotates its workers: process LATE runs worker (LATE + next) % WORKERS
    late = (LATE + first.next_worker_id) % WORKERS
    restored = first.worker_states[late]
    assert restored.state is not None
    for _ in range(TRIES):
        loader = _loader(data)
        restore_state_rank(loader, first)
        drawn, second = _save_after(loader, 1)
        assert drawn == epoch[7:8]
        entry = second.worker_states[late]
        assert entry.state is not None, "the late worker was told to start afresh"
        assert (entry.state.sample_index, entry.offset) == (restored.state.sample_index, restored.offset)
        resumed = _resume(data, second, 6)
        assert resumed == epoch[8:14], (
            f"first {_entries(first)}, second {_entries(second)}: resumed with "
            f"{[r.keys for r in resumed[:2]]}, expected {[r.keys for r in epoch[8:10]]}")


def _entries(state) -> str:
    """Each worker's (checkpoint sample index, offset), and the next worker."""
    return str([(None if ws.state is None else ws.state.sample_index, ws.offset)
                for ws in state.worker_states]) + f" next {state.next_worker_id}"


@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
@pytest.mark.timeout(120)  # Energon alone waits forever for the answer of workers never started
@pytest.mark.parametrize("restored_after", [0, 7])
def test_a_state_saved_between_iter_and_the_first_next_resumes_exactly(data, restored_after):
    """``iter(loader)`` marks Energon's workers as running before torch starts them (at the first
    ``next()``); a save in between is answered, by Energon's own branch for workers that have
    not started: the state the loader was restored from (None for a fresh one)."""
    epoch = _epoch(data)
    loader = _loader(data)
    if restored_after:
        _, first = _save_after(_loader(data), restored_after)
        restore_state_rank(loader, first)
    it = iter(loader)
    assert workers_never_started(loader)
    state = pickle.loads(pickle.dumps(loader.save_state_rank()))
    assert (state is None) == (restored_after == 0)
    assert record_batch(next(it)) == epoch[restored_after]  # the loader goes on as before
    assert not workers_never_started(loader)
    del it
    close_loader(loader)
    assert _resume(data, state, 6) == epoch[restored_after:restored_after + 6]
