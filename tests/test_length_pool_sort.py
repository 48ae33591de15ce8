"""LengthPoolSortDataset on real Energon pipelines: exact resume, no loss, seeds, state."""

from __future__ import annotations

import dataclasses
import pickle
from collections import Counter

import pytest
import torch
from megatron.energon import WorkerConfig, get_train_dataset, get_val_dataset
from megatron.energon.wrappers.base import BaseWrapperDataset
from megatron.energon.wrappers.batch_dataset import BatchDataset
from megatron.energon.wrappers.map_dataset import MapDataset

from energon_ordering import LengthPoolSortDataset, OrderingConfig
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, record_batch, resume, run_with_cuts
from energon_ordering.state_stamp import InputEndDataset


# (mode, pool_size, batch_size): both modes at pool sizes 1, 7 and 64; batch mode needs
# pool_size to be a multiple of batch_size.
POOL_CASES = [
    ("sample", 1, 4),
    ("sample", 7, 4),
    ("sample", 64, 4),
    ("batch", 1, 1),
    ("batch", 7, 7),
    ("batch", 64, 4),
]
TOTAL = 40
CUTS = (0, 3, 14, 27)


def _make(path, ordering, num_workers, batch_size, **loader_kw):
    return lambda: build_train_loader(
        path, ordering=ordering, num_workers=num_workers, batch_size=batch_size, **loader_kw
    )


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("mode,pool_size,batch_size", POOL_CASES)
def test_exact_resume_at_every_cut(small_dataset, num_workers, mode, pool_size, batch_size):
    ordering = OrderingConfig(length_sort_pool_size=pool_size, length_sort_mode=mode, seed=3)
    make = _make(small_dataset, ordering, num_workers, batch_size)
    full, states = run_with_cuts(make, TOTAL, CUTS)
    for cut, state in states.items():
        resumed = resume(make, state, TOTAL - cut)
        for step, (want, got) in enumerate(zip(full[cut:], resumed), start=cut):
            assert got == want, f"cut {cut}: first mismatch at batch {step}: {got} != {want}"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_under_energons_default_garbage_collection(small_dataset, num_workers):
    # The simulations build loaders without Energon's GcDataset (rank_simulation.SIMULATION_GC);
    # a training loader has it (a full collect, then gc.freeze() at every iteration start).
    ordering = OrderingConfig(length_sort_pool_size=64, length_sort_mode="batch", seed=3)
    make = _make(small_dataset, ordering, num_workers, 4, gc_collect_every_n_steps=10)
    loader = make()
    assert "GcDataset" in str(loader.dataset)
    close_loader(loader)
    full, states = run_with_cuts(make, TOTAL, CUTS)
    for cut, state in states.items():
        assert resume(make, state, TOTAL - cut) == full[cut:], f"cut {cut}"


@pytest.mark.parametrize("mode,pool_size", [("sample", 7), ("batch", 64)])
@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_exact_resume_from_mid_pool_worker_snapshots(small_dataset, mode, pool_size):
    # With worker processes Energon restores from the worker's latest in-memory snapshot and
    # replays from there. Snapshot after every batch, so the restored snapshots are taken
    # while the pool is half collected or half emitted (not only the initial state + replay).
    ordering = OrderingConfig(length_sort_pool_size=pool_size, length_sort_mode=mode, seed=1)
    snap = dict(checkpoint_every_sec=0, checkpoint_every_min_n_samples=1)
    cuts = (9, 22, 35)
    make = _make(small_dataset, ordering, 2, 4, **snap)
    full, states = run_with_cuts(make, TOTAL, cuts)
    for cut in cuts:
        offsets = [ws.offset for ws in states[cut].worker_states]
        assert max(offsets) <= 1, f"expected fresh snapshots, got replay offsets {offsets}"
        resumed = resume(make, states[cut], TOTAL - cut)
        assert resumed == full[cut:], f"cut {cut}"


def test_resume_restores_pooled_samples_with_identical_content(small_dataset):
    # Pooled samples are re-created from restore keys; their tokens must be bit-identical.
    ordering = OrderingConfig(length_sort_pool_size=64, length_sort_mode="batch")
    loader = build_train_loader(small_dataset, ordering=ordering, num_workers=0)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.save_state_rank()
    want = [next(it) for _ in range(20)]
    loader2 = build_train_loader(small_dataset, ordering=ordering, num_workers=0)
    loader2.restore_state_rank(pickle.loads(pickle.dumps(state)))
    it2 = iter(loader2)
    got = [next(it2) for _ in range(20)]
    for a, b in zip(want, got):
        assert a.keys == b.keys
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.images, b.images)


def _all_keys(path) -> set[str]:
    loader = build_train_loader(
        path, ordering=OrderingConfig(), num_workers=0, repeat=False, shuffle_buffer_size=None,
    )
    keys = {k for batch in loader for k in record_batch(batch).keys}
    close_loader(loader)
    return keys


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("mode,pool_size,batch_size", [("sample", 7, 4), ("batch", 64, 4)])
def test_finite_epoch_loses_and_duplicates_nothing(
    small_dataset, num_workers, mode, pool_size, batch_size
):
    world_size = 3
    expected = _all_keys(small_dataset)
    assert len(expected) == 640
    per_rank = []
    for rank in range(world_size):
        kwargs = dict(rank=rank, world_size=world_size, num_workers=num_workers,
                      batch_size=batch_size, repeat=False)
        pooled = build_train_loader(
            small_dataset,
            ordering=OrderingConfig(length_sort_pool_size=pool_size, length_sort_mode=mode),
            **kwargs,
        )
        keys = [k for b in pooled for k in record_batch(b).keys]
        close_loader(pooled)
        plain = build_train_loader(small_dataset, ordering=OrderingConfig(), **kwargs)
        plain_keys = [k for b in plain for k in record_batch(b).keys]
        close_loader(plain)
        dup = [k for k, c in Counter(keys).items() if c > 1]
        assert not dup, f"rank {rank} yields duplicates: {dup[:5]}"
        # The pool reorders the rank's share; it never changes which samples it holds.
        assert sorted(keys) == sorted(plain_keys)
        per_rank.append(set(keys))
    for a in range(world_size):
        for b in range(a + 1, world_size):
            assert not per_rank[a] & per_rank[b], f"ranks {a} and {b} share samples"
    assert set().union(*per_rank) == expected


def _keys(path, ordering, steps=30, **kw):
    loader = build_train_loader(path, ordering=ordering, **kw)
    it = iter(loader)
    out = [record_batch(next(it)).keys for _ in range(steps)]
    del it
    close_loader(loader)
    return out


@pytest.mark.parametrize("mode", ["sample", "batch"])
def test_same_seed_same_stream_other_seed_other_stream(small_dataset, mode):
    def cfg(seed):
        return OrderingConfig(length_sort_pool_size=32, length_sort_mode=mode, seed=seed)

    first = _keys(small_dataset, cfg(0))
    assert first == _keys(small_dataset, cfg(0))
    other = _keys(small_dataset, cfg(1))
    assert other != first
    # A different seed permutes the same pools differently: same samples per pool.
    assert sorted(sum(first[:8], ())) == sorted(sum(other[:8], ()))


def test_pool_changes_order_but_not_pool_membership(small_dataset):
    plain = _keys(small_dataset, OrderingConfig(), steps=16)
    pooled = _keys(small_dataset, OrderingConfig(length_sort_pool_size=64), steps=16)
    assert plain != pooled
    assert sorted(sum(plain, ())) == sorted(sum(pooled, ()))


def test_batch_mode_batches_are_sorted_chunks(small_dataset):
    loader = build_train_loader(
        small_dataset,
        ordering=OrderingConfig(length_sort_pool_size=64, length_sort_mode="batch"),
        num_workers=0,
    )
    it = iter(loader)
    pool = [record_batch(next(it)) for _ in range(16)]  # exactly one pool of 64
    close_loader(loader)
    ranges = sorted((min(b.lengths), max(b.lengths)) for b in pool)
    for (lo_a, hi_a), (lo_b, hi_b) in zip(ranges, ranges[1:]):
        assert hi_a <= lo_b, "chunks of one pool must not interleave in length"
    for b in pool:
        assert list(b.lengths) == sorted(b.lengths)


def _chain(dataset):
    out = [dataset]
    while isinstance(dataset, BaseWrapperDataset) and len(dataset.datasets) == 1:
        dataset = dataset.dataset
        out.append(dataset)
    return out


def test_pool_sits_between_encode_sample_and_batch_in_training_only(small_dataset):
    from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder

    te = SyntheticTaskEncoder()
    te.ordering = OrderingConfig(length_sort_pool_size=16)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    train = get_train_dataset(
        small_dataset, batch_size=4, worker_config=wc, task_encoder=te,
        shuffle_buffer_size=8, max_samples_per_sequence=8,
    )
    chain = _chain(train)
    idx = next(i for i, d in enumerate(chain) if isinstance(d, LengthPoolSortDataset))
    # the batcher's input end is reported to the stamp (a partial last batch follows the end)
    assert isinstance(chain[idx - 1], InputEndDataset)
    assert isinstance(chain[idx - 2], BatchDataset)
    assert isinstance(chain[idx + 1], MapDataset)
    assert chain[idx + 1].map_fn.__name__ == "encode_sample"
    assert chain[idx].pool_size == 16 and chain[idx].mode == "sample"

    val = get_val_dataset(small_dataset, split_part="train", batch_size=4, worker_config=wc,
                          task_encoder=te)
    assert not any(isinstance(d, LengthPoolSortDataset) for d in _chain(val))


def test_pool_off_builds_the_plain_energon_pipeline(small_dataset):
    from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder

    te = SyntheticTaskEncoder()
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    train = get_train_dataset(small_dataset, batch_size=4, worker_config=wc, task_encoder=te,
                              shuffle_buffer_size=8, max_samples_per_sequence=8)
    assert not any(isinstance(d, LengthPoolSortDataset) for d in _chain(train))


def _walk(obj, path=()):
    """Yields (path, value) for every node of a saved state."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, path + (i,))
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name), path + (f.name,))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_saved_state_holds_keys_not_payloads(small_dataset, num_workers):
    ordering = OrderingConfig(length_sort_pool_size=64, length_sort_mode="batch")
    loader = build_train_loader(small_dataset, ordering=ordering, num_workers=num_workers)
    it = iter(loader)
    for _ in range(6):
        next(it)
    state = loader.save_state_rank()
    del it
    close_loader(loader)
    blob = pickle.dumps(state)
    # The only tensors and byte strings are Energon's RNG states (under a key named "rng*").
    for path, x in _walk(state):
        if isinstance(x, (torch.Tensor, bytes, bytearray)):
            assert any(str(p).startswith("rng") for p in path), f"payload at {path}"
    # No image bytes and no caption text made it into the state.
    assert b"IHDR" not in blob  # PNG header
    words = {w for w in ("ba", "ke", "mi", "so", "zu")}
    assert not any(f" {a} {b} ".encode() in blob for a in words for b in words)
    pools = [x for _, x in _walk(state) if isinstance(x, dict) and "_emitting" in x]
    assert pools, "the pool's state must be part of the saved state"
    for pool in pools:
        pending = len(pool["_emitting"]["_restore_keys"]) + len(pool["_collecting"]["_restore_keys"])
        assert pending > 0
        key_bytes = len(pickle.dumps((pool["_emitting"], pool["_collecting"])))
        assert key_bytes / pending <= 100, f"{key_bytes / pending:.0f} bytes per pooled sample"
