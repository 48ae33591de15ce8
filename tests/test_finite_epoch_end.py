"""The end of a finite epoch is part of every loader worker's state (issue 22).

Setup of the issue: 400 samples, rank 0 of 2, ``repeat=False``, a pool of 32 in batch mode,
micro-batch 4 (50 micro-batches per rank). A state saved at the last micro-batch, or after it
without asking for more, must continue with exactly the remainder, possibly nothing.

The race it fixes: when ``save_state_rank()`` asks a worker that has yielded its last sample but
not yet run into the end of its stream, Energon (7.4.1) returns an older checkpoint plus a
number of samples to skip; the restored worker skips to the end and Energon then iterates the
pipeline again, replaying the worker's whole share (see ``PipelineStampDataset``). Under load
that is what Megatron saves at the end of a finite run. :class:`EpochEndGate` forces that
interleaving deterministically: it holds a worker's end-of-iteration checkpoint (the one
``SavableDatasetWrapper.__iter__`` stores after the worker's stream ended, without its command
lock) until the test has saved. The stress test runs the plain scenario in several contending
loader processes at once.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

from energon_ordering import OrderingConfig, restore_state_rank
from energon_ordering.inspect.rank_simulation import close_loader, record_batch
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder

sys.path.insert(0, str(Path(__file__).parent))
from end_gate import EpochEndGate  # noqa: E402

POOL = OrderingConfig(length_sort_pool_size=32, length_sort_mode="batch")
BATCHES = 50  # 400 samples / 2 ranks / micro-batch 4


@pytest.fixture(scope="module")
def finite_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("finite_end")
    make_synthetic_dataset(root, [SourceSpec("web", 400, "short")], shard_size=25)
    return root / "web"


def _loader(path: Path, num_workers: int, release: Any = None):
    """Rank 0 of 2 of the issue's setup, under an :class:`EpochEndGate` (open if
    ``release`` is None)."""
    if release is None:
        release = multiprocessing.Event()
        release.set()
    te = SyntheticTaskEncoder()
    te.ordering = POOL
    wc = WorkerConfig(rank=0, world_size=2, num_workers=num_workers)
    ds = get_train_dataset(path, batch_size=4, worker_config=wc, task_encoder=te,
                           shuffle_buffer_size=None, max_samples_per_sequence=16, repeat=False)
    loader = get_savable_loader(EpochEndGate(ds, release=release, worker_config=wc))
    loader.pin_memory = False
    return loader


def _run(path: Path, num_workers: int, cuts_from_end: list[int], *, hold_end: bool):
    """The whole epoch of n micro-batches with the state saved before micro-batch ``n - c`` for
    every ``c`` in ``cuts_from_end`` (``c == 0``: after the last one, without asking for more).
    ``hold_end``: every worker's end-of-iteration checkpoint waits until the last cut is saved.
    Returns the records and ``{cut: state}``."""
    release = multiprocessing.Event()
    if not hold_end:
        release.set()
    loader = _loader(path, num_workers, release)
    n = len(loader)  # micro-batches of this rank's epoch (Energon's len_rank)
    cuts = [n - c for c in cuts_from_end]
    it = iter(loader)
    records, states = [], {}
    for i in itertools.count():
        if i in cuts:
            states[i] = pickle.loads(pickle.dumps(loader.save_state_rank()))
        if i >= max(cuts):
            release.set()
        try:
            records.append(record_batch(next(it)))
        except StopIteration:
            break
    del it
    close_loader(loader)
    return records, states


def _resumed(path: Path, num_workers: int, state: Any, *, energon: bool = False):
    loader = _loader(path, num_workers)
    if energon:
        loader.restore_state_rank(state)
    else:
        restore_state_rank(loader, state)
    out = [record_batch(b) for b in loader]
    return loader, out


def _skipping(state: Any) -> list[int]:
    """Per worker, the samples Energon skips after its checkpoint (0 = exact checkpoint)."""
    return [ws.offset for ws in state.worker_states]


@pytest.mark.parametrize("energon", [False, True], ids=["ours", "energon"])
@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_a_worker_saved_before_it_saw_its_end_resumes_with_nothing(finite_data, energon):
    """Forced interleaving: both workers are asked for their state after yielding their last
    micro-batch but before Energon stored their end-of-iteration checkpoint (Energon returns
    an older checkpoint + 24 samples to skip). The restore yields nothing (it replayed 50
    micro-batches before the fix); iterating again starts the next epoch."""
    records, states = _run(finite_data, 2, [0], hold_end=True)
    assert len(records) == BATCHES
    state = states[BATCHES]
    assert all(s > 0 for s in _skipping(state)), _skipping(state)  # the interleaving happened
    loader, got = _resumed(finite_data, 2, state, energon=energon)
    assert got == []
    assert len([record_batch(b) for b in loader]) == BATCHES  # the next epoch, whole
    close_loader(loader)


@pytest.mark.parametrize(
    "num_workers,hold_end",
    # without workers the state is the pipeline's own: there is no interleaving to force
    [(0, False), *((w, h) for w in (1, 2, 3) for h in (False, True))],
    ids=lambda v: {False: "as-it-runs", True: "end-unseen"}[v] if isinstance(v, bool) else f"w{v}",
)
def test_cuts_at_and_after_the_last_micro_batch_resume_with_the_remainder(
    finite_data, num_workers, hold_end
):
    """Cuts at the last micro-batch (before it is drawn) and after it, with the workers' ends
    seen or not as the run goes, or with no worker's end seen yet (forced): exactly the
    remainder."""
    records, states = _run(finite_data, num_workers, [1, 0], hold_end=hold_end)
    keys = [k for r in records for k in r.keys]
    assert len(keys) == len(set(keys)) == 200  # rank 0's half, each sample once
    for cut, state in states.items():
        loader, got = _resumed(finite_data, num_workers, state)
        close_loader(loader)
        assert got == records[cut:], f"cut {cut}: skipping {_skipping(state) if num_workers else '-'}"


@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_a_resumed_loader_saved_again_before_its_workers_yield_resumes_identically(finite_data):
    """A state saved by a restored loader before each worker yielded again (at the end of the
    epoch, or after fewer micro-batches than workers) keeps what each worker still skips, so its
    restore continues identically (Energon alone returns the checkpoint without the skip, and
    the restore replayed 48 and 9 micro-batches here)."""
    records, states = _run(finite_data, 2, [0], hold_end=True)
    loader, got = _resumed(finite_data, 2, states[BATCHES])
    again = pickle.loads(pickle.dumps(loader.save_state_rank()))
    close_loader(loader)
    assert got == [] and _resumed_and_closed(finite_data, again) == []

    cut = 20
    records, states = _run(finite_data, 2, [BATCHES - cut], hold_end=False)
    loader = _loader(finite_data, 2)
    restore_state_rank(loader, states[cut])
    it = iter(loader)
    got = [record_batch(next(it))]  # from worker 0 only
    again = pickle.loads(pickle.dumps(loader.save_state_rank()))
    del it
    close_loader(loader)
    assert got + _resumed_and_closed(finite_data, again) == records[cut:]


def _resumed_and_closed(path: Path, state: Any) -> list:
    loader, got = _resumed(path, 2, state)
    close_loader(loader)
    return got


# --- stress: the plain scenario in contending loader processes ------------------------------

STRESS_COPIES = 6
STRESS_TRIES = 100

#: One copy of the scenario: ``tries`` times, the whole epoch on 2 workers, the state saved right
#: after the last micro-batch (without asking for more), restored on a fresh loader (ours and
#: Energon's restore alternately); prints one JSON line per try.
_STRESS_CHILD = r"""
import json, pickle, sys
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
from energon_ordering import OrderingConfig, restore_state_rank
from energon_ordering.inspect.rank_simulation import close_loader
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder

path, tries, copy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def loader():
    te = SyntheticTaskEncoder()
    te.ordering = OrderingConfig(length_sort_pool_size=32, length_sort_mode="batch")
    wc = WorkerConfig(rank=0, world_size=2, num_workers=2)
    ds = get_train_dataset(path, batch_size=4, worker_config=wc, task_encoder=te,
                           shuffle_buffer_size=None, max_samples_per_sequence=16, repeat=False)
    l = get_savable_loader(ds)
    l.pin_memory = False
    return l

for t in range(tries):
    l = loader()
    it = iter(l)
    n = sum(1 for _ in range(50) if next(it, None) is not None)
    state = pickle.loads(pickle.dumps(l.save_state_rank()))
    del it
    close_loader(l)
    r = loader()
    if (copy + t) % 2:
        r.restore_state_rank(state)
    else:
        restore_state_rank(r, state)
    replayed = sum(1 for _ in r)
    close_loader(r)
    print(json.dumps({"copy": copy, "try": t, "batches": n, "replayed": replayed,
                      "skipping": [ws.offset for ws in state.worker_states]}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_end_of_epoch_cut_in_contending_loader_processes_never_replays(finite_data, tmp_path):
    """STRESS_COPIES copies of the issue's scenario at once (each with 2 loader workers, so the
    machine is busy with contending loaders), STRESS_TRIES tries in all: zero replays. Before
    the fix this caught the race (see the report of issue 22)."""
    script = tmp_path / "end_cut.py"
    script.write_text(_STRESS_CHILD)
    per_copy = [STRESS_TRIES // STRESS_COPIES + (c < STRESS_TRIES % STRESS_COPIES)
                for c in range(STRESS_COPIES)]
    procs = [
        subprocess.Popen([sys.executable, str(script), str(finite_data), str(n), str(c)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
        for c, n in enumerate(per_copy)
    ]
    results, errors = [], []
    deadline = time.monotonic() + 1500
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if p.returncode:
                errors.append(err[-2000:])
    finally:
        for p in procs:  # our own processes (and their loader workers), by PID
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert not errors, errors
    assert len(results) == STRESS_TRIES
    assert all(r["batches"] == BATCHES for r in results)
    unseen = sum(any(r["skipping"]) for r in results)
    replays = [r for r in results if r["replayed"]]
    print(f"{STRESS_TRIES} tries, {unseen} saved before a worker saw its end, "
          f"{len(replays)} replayed")
    assert not replays, replays
