"""The lean pre-encode pool on real Energon pipelines: same order as the encoded pool, exact
resume, no loss, no payload in the state, lengths from the index or a raw length function."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
import torch
from megatron.energon.wrappers.base import BaseWrapperDataset

from energon_ordering import OrderingConfig, StateMismatchError
from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset
from energon_ordering.length_index.build import build_length_index
from energon_ordering.inspect.pool_memory import find_stage
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    resume,
    run_ranks,
    run_with_cuts,
)
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder, SyntheticTaskEncoder

TOTAL = 40
CUTS = (0, 3, 14, 27)


@pytest.fixture(scope="module")
def indexed_dataset(tmp_path_factory):
    """640 trimodal samples with a length index built by the synthetic task encoder."""
    root = tmp_path_factory.mktemp("indexed")
    make_synthetic_dataset(root, [SourceSpec("web", 640, "trimodal")], shard_size=32)
    build_length_index(root / "web", task_encoder=IndexedSyntheticTaskEncoder())
    return root / "web"


def _cfg(placement, pool=64, mode="batch", seed=5, holds="keys"):
    return OrderingConfig(length_sort_pool_size=pool, length_sort_mode=mode, seed=seed,
                          length_sort_placement=placement,
                          length_sort_pool_holds=holds if placement == "pre-encode" else "raw")


def _make(path, ordering, num_workers=0, te=IndexedSyntheticTaskEncoder, **kw):
    def make():
        loader = build_train_loader(path, ordering=ordering, num_workers=num_workers,
                                    batch_size=4, task_encoder_factory=te, **kw)
        lean = find_stage(loader.dataset, KeyPoolSortDataset) is not None
        assert lean == (ordering.length_sort_placement == "pre-encode"), "placement not built"
        return loader

    return make


def _records(path, ordering, steps, num_workers=0, te=IndexedSyntheticTaskEncoder):
    """The first ``steps`` micro-batches of a fresh loader."""
    return run_with_cuts(_make(path, ordering, num_workers, te), steps, ())[0]


@pytest.mark.parametrize("holds", ["keys", "raw"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("mode,pool", [("sample", 7), ("batch", 64)])
def test_lean_pool_emits_exactly_the_encoded_pools_sequence(indexed_dataset, num_workers, mode,
                                                            pool, holds):
    # Same lengths (the index holds the encoder's lengths), same seeds, same arrival order:
    # the order depends on nothing else, so the sequences must be identical.
    runs = {}
    for placement in ("post-encode", "pre-encode"):
        cfg = _cfg(placement, pool, mode, holds=holds)
        runs[placement] = _records(indexed_dataset, cfg, TOTAL, num_workers)
    assert runs["pre-encode"] == runs["post-encode"]
    # The pool really sorted: batch mode groups neighbouring lengths.
    if mode == "batch":
        spread = [max(b.lengths) - min(b.lengths) for b in runs["pre-encode"]]
        assert sorted(spread)[len(spread) // 2] < 200


def test_lean_pipeline_loads_after_the_pool_and_yields_identical_tensors(indexed_dataset):
    batches = {}
    for placement in ("post-encode", "pre-encode"):
        loader = _make(indexed_dataset, _cfg(placement))()
        if placement == "pre-encode":
            pool = find_stage(loader.dataset, KeyPoolSortDataset)
            assert pool is not None, "the lean pool is in the pipeline"
            # Below the pool the samples are raw: no decoded image exists before emission.
            assert "Defer" in str(pool.dataset) and "Materialize" not in str(pool.dataset)
        it = iter(loader)
        batches[placement] = [next(it) for _ in range(12)]
        del it
        close_loader(loader)
    for a, b in zip(batches["post-encode"], batches["pre-encode"]):
        assert a.keys == b.keys
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.images, b.images)
        assert a.__restore_key__ is not None and b.__restore_key__ is not None


@pytest.mark.parametrize("holds", ["keys", "raw"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("mode,pool", [("sample", 7), ("batch", 64)])
def test_lean_pool_exact_resume_at_every_cut(indexed_dataset, num_workers, mode, pool, holds):
    make = _make(indexed_dataset, _cfg("pre-encode", pool, mode, holds=holds), num_workers)
    full, states = run_with_cuts(make, TOTAL, CUTS)
    for cut, state in states.items():
        resumed = resume(make, state, TOTAL - cut)
        for step, (want, got) in enumerate(zip(full[cut:], resumed), start=cut):
            assert got == want, f"cut {cut}: first mismatch at batch {step}: {got} != {want}"


@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_lean_pool_exact_resume_from_mid_pool_worker_snapshots(indexed_dataset):
    snap = dict(checkpoint_every_sec=0, checkpoint_every_min_n_samples=1)
    cuts = (9, 22, 35)
    make = _make(indexed_dataset, _cfg("pre-encode", 64, "batch"), 2, **snap)
    full, states = run_with_cuts(make, TOTAL, cuts)
    for cut in cuts:
        offsets = [ws.offset for ws in states[cut].worker_states]
        assert max(offsets) <= 1, f"expected fresh snapshots, got replay offsets {offsets}"
        assert resume(make, states[cut], TOTAL - cut) == full[cut:], f"cut {cut}"


def test_lean_and_encoded_pools_yield_the_same_samples_per_epoch(indexed_dataset):
    # One finite epoch on 3 ranks: every sample exactly once, for both placements.
    epochs = {}
    for placement in ("post-encode", "pre-encode"):
        records = run_ranks(indexed_dataset, ordering=_cfg(placement, 32, "batch"), world_size=3,
                            steps=None, repeat=False, batch_size=4,
                            task_encoder_factory=IndexedSyntheticTaskEncoder)
        epochs[placement] = Counter(k for rank in records for b in rank for k in b.keys)
    assert epochs["pre-encode"] == epochs["post-encode"]
    assert len(epochs["pre-encode"]) == 640 and set(epochs["pre-encode"].values()) == {1}


def test_raw_length_function_needs_no_index(small_dataset):
    # SyntheticTaskEncoder computes exact lengths from the raw caption bytes; the small
    # dataset has no length index.
    runs = {}
    for placement in ("post-encode", "pre-encode"):
        runs[placement] = _records(small_dataset, _cfg(placement, 32, "sample"), 20, te=SyntheticTaskEncoder)
    assert runs["pre-encode"] == runs["post-encode"]


def test_lean_state_holds_keys_not_samples(indexed_dataset):
    # Right after the first batch the pool holds pool_size - 4 unemitted samples.
    pool = 512
    sizes = {}
    for p in (0, pool):
        cfg = _cfg("pre-encode", p, "batch") if p else OrderingConfig()
        loader = _make(indexed_dataset, cfg)()
        it = iter(loader)
        next(it)
        sizes[p] = len(pickle.dumps(loader.save_state_rank()))
        del it
        close_loader(loader)
    per_sample = (sizes[pool] - sizes[0]) / (pool - 4)
    assert 0 < per_sample < 100, f"{per_sample:.1f} bytes per pooled sample"


def test_lean_pool_in_memory_holds_no_sample_objects(indexed_dataset):
    loader = _make(indexed_dataset, _cfg("pre-encode", 256, "batch"))()
    it = iter(loader)
    next(it)
    pool = find_stage(loader.dataset, KeyPoolSortDataset)
    held = [*pool._emit_keys, *pool._collect_keys, *pool._collect_lengths]
    assert len(pool._emit_keys) - pool._emit_pos == 256 - 4
    assert all(isinstance(x, (tuple, float, int)) for x in held)
    del it
    close_loader(loader)


def test_lean_pool_state_refuses_another_pool_configuration(indexed_dataset):
    loader = _make(indexed_dataset, _cfg("pre-encode", 64, "batch", seed=1))()
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    del it
    close_loader(loader)
    other = _make(indexed_dataset, _cfg("pre-encode", 64, "batch", seed=2))()
    with pytest.raises(StateMismatchError, match=r"seed: saved 1 != configured 2"):
        other.restore_state_rank(state)
        next(iter(other))
    close_loader(other)


def test_lean_pool_with_a_mixture_schedule_keeps_sources(three_sources):
    schedule = {"phases": [{"until": 0.5, "weights": {"web": 0.5, "code": 0.5, "curated": 0}},
                           {"until": 1.0, "weights": {"web": 0, "code": 0.2, "curated": 0.8}}]}
    runs = {}
    for placement in ("post-encode", "pre-encode"):
        cfg = OrderingConfig(length_sort_pool_size=32, length_sort_mode="batch",
                             length_sort_placement=placement, mixture_schedule=schedule,
                             total_steps=60, schedule_lag_compensation=False)
        runs[placement] = _records(three_sources, cfg, 60, te=SyntheticTaskEncoder)
    assert runs["pre-encode"] == runs["post-encode"]
    sources = Counter(s for b in runs["pre-encode"][40:] for s in b.sources)
    assert sources["web"] == 0 and sources["curated"] > sources["code"]
    for b in runs["pre-encode"]:
        assert all(k.startswith(s) for k, s in zip(b.keys, b.sources))


def test_key_pool_is_an_energon_wrapper(indexed_dataset):
    loader = _make(indexed_dataset, _cfg("pre-encode"))()
    pool = find_stage(loader.dataset, KeyPoolSortDataset)
    assert isinstance(pool, BaseWrapperDataset)
    assert pool.config()["pool_size"] == 64 and "KeyPoolSortDataset(pool_size=64" in str(pool)
    assert pool.len_worker() == pool.dataset.len_worker()
    close_loader(loader)


PLACEMENT_CHANGES = [
    (("post-encode", "keys"), ("pre-encode", "keys")),
    (("pre-encode", "keys"), ("post-encode", "keys")),
    (("pre-encode", "raw"), ("post-encode", "keys")),
    (("post-encode", "keys"), ("pre-encode", "raw")),
]


@pytest.mark.parametrize("saved,restored", PLACEMENT_CHANGES)
def test_changing_the_placement_on_resume_is_refused(indexed_dataset, saved, restored):
    loader = _make(indexed_dataset, _cfg(saved[0], holds=saved[1]))()
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    del it
    close_loader(loader)
    other = _make(indexed_dataset, _cfg(restored[0], holds=restored[1]))()
    with pytest.raises(StateMismatchError, match=r"differently built pipeline|placement: saved"):
        other.restore_state_rank(state)
    close_loader(other)


def test_raw_holding_pool_keeps_packed_compressed_files_out_of_the_gc(indexed_dataset):
    import gc

    from energon_ordering.inspect.pool_memory import pool_holdings, resident_bytes

    loader = _make(indexed_dataset, _cfg("pre-encode", 64, holds="raw"))()
    it = iter(loader)
    next(it)
    pool = find_stage(loader.dataset, KeyPoolSortDataset)
    assert pool.keep_samples
    held, objs = pool_holdings(pool)
    packed = [p for p in pool._emit_packed if p is not None]
    assert held == 64 and len(packed) == 60
    assert all(isinstance(p, bytes) and not gc.is_tracked(p) for p in packed)
    per_sample = resident_bytes(objs) / 60
    assert 500 < per_sample < 20_000  # a 16x16 PNG and a caption, compressed; nothing decoded
    del it
    close_loader(loader)


@pytest.mark.parametrize("saved,restored", [("raw", "keys"), ("keys", "raw")])
@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_switching_what_the_pool_holds_across_a_resume_keeps_the_order(indexed_dataset, saved, restored):
    # The state is the same (keys and lengths) either way; only memory and reads differ.
    full, states = run_with_cuts(_make(indexed_dataset, _cfg("pre-encode", 64, holds=saved), 2), TOTAL, (17,))
    resumed = resume(_make(indexed_dataset, _cfg("pre-encode", 64, holds=restored), 2), states[17], TOTAL - 17)
    assert resumed == full[17:]


# ---- crude datasets: raw samples cooked by the task encoder --------------------------------------

from megatron.energon import CaptioningSample, Cooker, basic_sample_keys, stateless  # noqa: E402


@stateless
def cook_caption(sample: dict) -> CaptioningSample:
    return CaptioningSample(**basic_sample_keys(sample), image=sample["png"], caption=sample["txt"])


class CrudeTaskEncoder(SyntheticTaskEncoder):
    cookers = [Cooker(cook_caption)]


@pytest.fixture(scope="module")
def crude_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("crude")
    make_synthetic_dataset(root, [SourceSpec("web", 320, "trimodal")], shard_size=32)
    (root / "web" / ".nv-meta" / "dataset.yaml").write_text(
        "__module__: megatron.energon\n__class__: CrudeWebdataset\n")
    return root / "web"


@pytest.mark.parametrize("holds", ["keys", "raw"])
def test_crude_dataset_cooked_after_the_pool(crude_dataset, holds):
    runs = {}
    for placement in ("post-encode", "pre-encode"):
        make = _make(crude_dataset, _cfg(placement, 32, "batch", holds=holds), te=CrudeTaskEncoder)
        full, states = run_with_cuts(make, 30, (11,))
        assert resume(make, states[11], 19) == full[11:]
        runs[placement] = full
    assert runs["pre-encode"] == runs["post-encode"]


def test_energons_own_blend_feeds_the_lean_pool(three_sources):
    # A metadataset without a mixture schedule: Energon's BlendDataset over deferred sources.
    runs = {}
    for placement in ("post-encode", "pre-encode"):
        runs[placement] = _records(three_sources, _cfg(placement, 32, "batch"), 40, te=SyntheticTaskEncoder)
    assert runs["pre-encode"] == runs["post-encode"]
    sources = Counter(s for b in runs["pre-encode"] for s in b.sources)
    assert set(sources) == {"web", "code", "curated"}
    for b in runs["pre-encode"]:
        assert all(k.startswith(s) for k, s in zip(b.keys, b.sources))


def test_validation_pipelines_are_untouched(indexed_dataset):
    from megatron.energon import WorkerConfig, get_val_dataset

    te = IndexedSyntheticTaskEncoder()
    te.ordering = _cfg("pre-encode", 64)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    val = get_val_dataset(indexed_dataset, split_part="train", batch_size=4, worker_config=wc,
                          task_encoder=te)
    assert find_stage(val, KeyPoolSortDataset) is None and "Defer" not in str(val)
