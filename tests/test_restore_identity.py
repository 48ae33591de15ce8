"""A restore that would change the data is refused; finite epochs resume exactly (issue 12).

One parametrised test runs every row of the issue's table on real prepared datasets: cut a real
run, change one thing, restore, and assert the exact typed error or the exact continuation.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import tiers
import torch
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

from energon_ordering import OrderingConfig, StateMismatchError, restore_state_rank
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    record_batch,
    resume,
    run_saving_every_step,
    run_with_cuts,
)
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.build import build_length_index
from energon_ordering.length_index.index import LengthIndex, index_name, write_length_index

SPEC = [SourceSpec("web", 192, "trimodal")]
SCHEDULE = {
    "total_steps": 40,
    "phases": [
        {"until": 0.5, "weights": {"web": 0.7, "code": 0.3}},
        {"until": 1.0, "weights": {"web": 0.3, "code": 0.7}},
    ],
}
POOL = OrderingConfig(length_sort_pool_size=16, length_sort_mode="batch", seed=3)
SCHED = OrderingConfig(
    mixture_schedule=SCHEDULE, length_sort_pool_size=16, length_sort_mode="batch",
    micro_batches_per_step=2,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real prepared datasets: ``a``; ``b`` with the same shard names and counts (other
    samples); ``meta`` a two-source metadataset; ``indexed`` with a length index."""
    root = tmp_path_factory.mktemp("identity")
    make_synthetic_dataset(root / "a", SPEC, shard_size=24)
    make_synthetic_dataset(root / "b", SPEC, shard_size=24, seed=1)
    meta = make_synthetic_dataset(
        root / "m", [SourceSpec("web", 160, "short"), SourceSpec("code", 160, "medium")],
        shard_size=20,
    )
    make_synthetic_dataset(root / "i", SPEC, shard_size=24)
    build_length_index(root / "i" / "web", task_encoder=IndexedSyntheticTaskEncoder())
    return {"a": root / "a" / "web", "b": root / "b" / "web", "meta": meta,
            "indexed": root / "i" / "web", "root": root}


def _maker(path, cfg, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("shuffle_buffer_size", 16)
    kw.setdefault("max_samples_per_sequence", 8)
    return lambda: build_train_loader(path, ordering=cfg, **kw)


def _state(path, cfg, cut=5, **kw):
    return run_with_cuts(_maker(path, cfg, **kw), cut + 1, [cut])[1][cut]


def _refused(make, state, match):
    loader = make()
    try:
        with pytest.raises(StateMismatchError, match=match):
            restore_state_rank(loader, state)
    finally:
        close_loader(loader)


def _reprepare(data):
    """The same path after a new `energon prepare` (a new index.uuid)."""
    make_synthetic_dataset(data["root"] / "a2", SPEC, shard_size=24)
    return data["root"] / "a2" / "web"


# Each row: (saved with, restored with) -> expected message. kw = build_train_loader arguments.
REFUSED = {
    "rank1-state-on-rank0": (
        dict(cfg=POOL, rank=1, world_size=2), dict(cfg=POOL, rank=0, world_size=2),
        r"rank: saved 1 != configured 0.*another data-parallel rank's",
    ),
    "world-size-3-to-2": (
        dict(cfg=POOL, rank=0, world_size=3), dict(cfg=POOL, rank=0, world_size=2),
        r"world_size: saved 3 != configured 2.*energon checkpoint redist",
    ),
    "other-dataset-same-shards": (
        dict(cfg=POOL), dict(cfg=POOL, path="b"),
        r"datasets: saved \[\{'uuid': '[0-9a-f-]+'.*index.uuid",
    ),
    "lag-compensation-toggled": (
        dict(cfg=SCHED, path="meta"),
        dict(cfg=replace(SCHED, schedule_lag_compensation=False), path="meta"),
        r"schedule_lag_compensation: saved True != configured False",
    ),
    "micro-batches-per-step-changed": (
        dict(cfg=SCHED, path="meta"), dict(cfg=replace(SCHED, micro_batches_per_step=4), path="meta"),
        r"micro_batches_per_step: saved 2 != configured 4",
    ),
    "num-workers-2-to-0": (
        dict(cfg=POOL, num_workers=2), dict(cfg=POOL, num_workers=0),
        r"num_workers: saved 2 != configured 0",
    ),
    "num-workers-2-to-1": (
        dict(cfg=POOL, num_workers=2), dict(cfg=POOL, num_workers=1),
        r"num_workers: saved 2 != configured 1",
    ),
    "num-workers-2-to-3": (
        dict(cfg=POOL, num_workers=2), dict(cfg=POOL, num_workers=3),
        r"num_workers: saved 2 != configured 3",
    ),
    "pool-on-to-off": (
        dict(cfg=POOL), dict(cfg=OrderingConfig()),
        r"length_sort_pool_size: saved 16 != configured 0",
    ),
    "schedule-to-none": (
        dict(cfg=SCHED, path="meta"), dict(cfg=replace(SCHED, mixture_schedule=None), path="meta"),
        r"mixture_schedule: saved \['web', 'code'\] != configured None",
    ),
    "max-samples-per-sequence-changed": (
        dict(cfg=POOL), dict(cfg=POOL, max_samples_per_sequence=4),
        r"max_samples_per_sequence: saved \[8\] != configured \[4\]",
    ),
}


def _kw(data, row):
    row = dict(row)
    cfg = row.pop("cfg")
    path = data[row.pop("path", "a")]
    return path, cfg, row


@pytest.mark.parametrize("case", tiers.cases(REFUSED))
def test_changed_restore_is_refused(data, case):
    saved_with, restored_with, match = REFUSED[case]
    path, cfg, kw = _kw(data, saved_with)
    state = _state(path, cfg, **kw)
    path2, cfg2, kw2 = _kw(data, restored_with)
    _refused(_maker(path2, cfg2, **kw2), state, match)


def test_same_path_prepared_again_is_refused(data):
    state = _state(data["a"], POOL)
    again = _reprepare(data)
    # Same shards, same samples, but `energon prepare` wrote a new index.uuid.
    _refused(_maker(again, POOL), state, r"datasets: saved .*'uuid'.*prepared again")


def test_rebuilt_length_index_is_refused(data):
    """The index the pool sorted by is rebuilt with other lengths between save and resume."""
    cfg = replace(POOL, length_sort_placement="pre-encode", length_sort_pool_holds="keys")
    make = _maker(data["indexed"], cfg, task_encoder_factory=IndexedSyntheticTaskEncoder)
    state = _state(data["indexed"], cfg, task_encoder_factory=IndexedSyntheticTaskEncoder)
    # Rebuilt with the same function: identical content, the state restores.
    build_length_index(data["indexed"], task_encoder=IndexedSyntheticTaskEncoder())
    loader = make()
    restore_state_rank(loader, state)
    close_loader(loader)
    old = LengthIndex.open(data["indexed"])
    lengths = [(f"web-{i:08d}", 7.0 + i) for i in range(192)]  # another length function
    write_length_index(data["indexed"], lengths, computed_by=old.computed_by,
                       name=index_name(old.computed_by))
    try:
        _refused(make, state, r"length_index: saved \[\{'uuid'.*'digest'.*Select the original")
    finally:
        build_length_index(data["indexed"], task_encoder=IndexedSyntheticTaskEncoder())


@pytest.mark.parametrize("case", ["pool-on-to-off", "max-samples-per-sequence-changed"])
def test_energon_restore_without_the_precheck_is_typed_too(data, case):
    """Calling Energon's own ``loader.restore_state_rank`` (no pre-check): the top stage's
    check runs before any stage below interprets the state (no bare AssertionError)."""
    saved_with, restored_with, match = REFUSED[case]
    path, cfg, kw = _kw(data, saved_with)
    state = _state(path, cfg, **kw)
    path2, cfg2, kw2 = _kw(data, restored_with)
    loader = _maker(path2, cfg2, **kw2)()
    try:
        with pytest.raises(StateMismatchError, match=match):
            loader.restore_state_rank(state)
            next(iter(loader))
    finally:
        close_loader(loader)


@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_unchanged_restore_passes_the_check(data):
    """The check is no blanket refusal: the same configuration resumes exactly."""
    make = _maker(data["meta"], SCHED, num_workers=2)
    records, states = run_with_cuts(make, 12, [7])
    assert resume(make, states[7], 5) == records[7:]


def test_supported_change_pool_holds_raw_to_keys_resumes_exactly(data):
    """A supported change: what the lean pool holds may change across a restart."""
    raw = replace(POOL, length_sort_placement="pre-encode", length_sort_pool_holds="raw")
    keys = replace(raw, length_sort_pool_holds="keys")
    records, states = run_with_cuts(_maker(data["a"], raw), 14, [9])
    assert resume(_maker(data["a"], keys), states[9], 5) == records[9:]


# --- redistribution ----------------------------------------------------------------------------


@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_energon_checkpoint_redist_is_refused(data, tmp_path):
    """`energon checkpoint redist` (Energon's own tool) hands 2 ranks x 2 workers to 1 rank x 4
    workers; the redistributed state is refused with a message that says so."""
    for rank in range(2):
        state = _state(data["a"], POOL, rank=rank, world_size=2, num_workers=2)
        torch.save(state, tmp_path / f"state_r{rank}.pt")
    out = tmp_path / "redist"
    out.mkdir()  # Energon 7.4.1's redist does not create it for per-rank files
    proc = subprocess.run(
        [sys.executable, "-m", "megatron.energon.cli.main", "checkpoint", "redist",
         str(tmp_path / "state_r0.pt"), str(tmp_path / "state_r1.pt"), str(out),
         "--new-world-size", "1"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    (new_file,) = sorted(out.glob("*.pt"))
    new_state = torch.load(new_file, weights_only=False)
    assert len(new_state.worker_states) == 4
    _refused(_maker(data["a"], POOL, num_workers=4), new_state,
             r"world_size: saved 2 != configured 1.*does not support redistributing.*"
             r"energon checkpoint redist")


# --- finite epochs -----------------------------------------------------------------------------


def _finite_run(make):
    """The whole finite epoch, with the state before every micro-batch and after the last."""
    records, states = run_saving_every_step(make)
    return records, [pickle.loads(s) for s in states]


def _remainder(make, state):
    loader = make()
    restore_state_rank(loader, state)
    out = [record_batch(b) for b in loader]
    close_loader(loader)
    return out


@pytest.mark.parametrize(
    "cfg,num_workers",
    [(POOL, 0), (POOL, 2), (OrderingConfig(), 2),
     (replace(POOL, length_sort_pool_size=64), 1)],
    ids=["pool-w0", "pool-w2", "nopool-w2", "pool64-w1"],
)
def test_finite_epoch_resumes_with_exactly_the_remainder(data, cfg, num_workers):
    """Cut inside the last pool, at the last batch and after it: exactly the remainder."""
    make = _maker(data["a"], cfg, num_workers=num_workers, repeat=False)
    records, states = _finite_run(make)
    n = len(records)
    assert n == 48  # 192 samples / 4, nothing lost or repeated
    assert sorted(k for r in records for k in r.keys) == [f"web-{i:08d}" for i in range(192)]
    for cut in (n - 3, n - 1, n):  # inside the last pool (16 samples = 4 batches), last, after
        assert _remainder(make, states[cut]) == records[cut:], f"cut {cut} of {n}"


def _plain_energon_loader(path, num_workers, shuffle_buffer_size):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers)
    ds = get_train_dataset(path, batch_size=4, worker_config=wc, repeat=False,
                           shuffle_buffer_size=shuffle_buffer_size, max_samples_per_sequence=8)
    return get_savable_loader(ds)


@pytest.mark.parametrize("num_workers,shuffle_buffer_size", [(2, None), (0, 16)])
def test_energon_replays_a_finished_finite_epoch(data, num_workers, shuffle_buffer_size):
    """Pins Energon 7.4.1's own behaviour, which OrderingTaskEncoder's pipelines work around:
    restoring the state saved after the last micro-batch of a finite epoch (with workers), or
    one saved while its shuffle buffer drains, replays the epoch. If this test fails, Energon
    fixed it: drop the workarounds (PipelineStampDataset._ended, FiniteShuffleBufferDataset)."""

    def make():
        return _plain_energon_loader(data["a"], num_workers, shuffle_buffer_size)

    records, states = _finite_run(make)
    n = len(records)
    cut = n if num_workers else n - 1
    loader = make()
    loader.restore_state_rank(states[cut])
    replayed = [record_batch(b) for b in loader]
    close_loader(loader)
    assert len(replayed) > n - cut + 10, (n, cut, len(replayed))
