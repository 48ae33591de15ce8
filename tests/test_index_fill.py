"""Filling the key pool from the indexes: Energon's visiting order, no payload read, the identical
sequence of today's (payload-reading) key pool, exact resume; byte-range reads equal Energon's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from megatron.energon import WorkerConfig
from megatron.energon.flavors.webdataset.itar_reader import ITarReader
from megatron.energon.metadataset.loader import load_dataset

from energon_ordering import OrderingConfig
from energon_ordering.errors import LengthIndexError, OrderingConfigError
from energon_ordering.inspect.pool_memory import find_stage
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, resume, run_with_cuts
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.index import LengthIndex
from energon_ordering.pool.byte_range_reader import ByteRangeReader
from energon_ordering.pool.index_fill import IndexFilledLoader, index_fill_problem, index_filled
from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

TOTAL = 40


def PayloadFillTaskEncoder() -> IndexedSyntheticTaskEncoder:
    """Today's key pool: the fill reads every sample through Energon's reader."""
    te = IndexedSyntheticTaskEncoder()
    te.ordering_index_fill = False
    return te


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """Three indexed sources of different lengths and a metadataset blending them."""
    root = tmp_path_factory.mktemp("index_fill")
    return indexed_synthetic(
        root,
        [SourceSpec("web", 300, "short"), SourceSpec("code", 300, "long"),
         SourceSpec("mix", 320, "trimodal")],
        shard_size=32)


def _cfg(mode="batch", pool=64, holds="keys", **kw):
    return OrderingConfig(length_sort_pool_size=pool, length_sort_mode=mode, seed=3,
                          length_sort_placement="pre-encode", length_sort_pool_holds=holds, **kw)


def _make(path, cfg, num_workers, te, expect_fill):
    def make():
        loader = build_train_loader(path, ordering=cfg, num_workers=num_workers, batch_size=4,
                                    task_encoder_factory=te)
        assert (find_stage(loader.dataset, IndexFilledLoader) is not None) == expect_fill
        assert find_stage(loader.dataset, KeyPoolSortDataset) is not None
        return loader

    return make


def _energon_loader(path):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = load_dataset(path).get_datasets(
        training=True, split_part="train", worker_config=wc, max_samples_per_sequence=16,
        shuffle_over_epochs_multiplier=1,
    ).datasets[0].dataset
    return ds.build().dataset


def test_byte_range_reads_equal_energons_reader_for_every_sample(indexed):
    loader = _energon_loader(indexed.parent / "mix")
    energon = loader.join_readers[0]
    mine = index_filled(loader).byte_reader
    assert len(mine) == len(energon) == 320
    for i in range(len(mine)):
        assert mine.read(i) == energon[i], f"sample {i}"
    with pytest.raises(IndexError, match="outside"):
        mine.read(320)


def test_byte_range_reader_applies_energons_filters(indexed):
    loader = _energon_loader(indexed.parent / "web")
    energon = loader.join_readers[0]
    shards = [(s.name, s.count) for s in energon.shard_infos]
    excluded = f"{shards[1][0]}/{ByteRangeReader(indexed.parent / 'web', shards).key(40)}"
    reader = ByteRangeReader(indexed.parent / "web", shards, part_filter=lambda ext: ext == "txt",
                             sample_filter=lambda name: name != excluded)
    energon.part_filter, energon.sample_filter = reader.part_filter, reader.sample_filter
    assert reader.read(40) is None and energon[40] is None
    for i in (0, 39, 41, 299):
        assert reader.read(i) == energon[i]
        assert set(k for k in reader.read(i) if not k.startswith("__")) == {"txt"}


def test_byte_range_reader_refuses_a_dataset_without_energons_index(indexed, tmp_path):
    with pytest.raises(OrderingConfigError, match="index.sqlite does not exist"):
        ByteRangeReader(tmp_path, [("shard-000000.tar", 1)])
    with pytest.raises(OrderingConfigError, match=r"not in .*\.info\.json"):
        ByteRangeReader(indexed.parent / "web", [("no-such-shard.tar", 1)])


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("mode,pool", [("sample", 30), ("batch", 64)])
def test_index_fill_emits_the_identical_sequence_of_todays_key_pool(indexed, num_workers, mode, pool):
    # Three sources, Energon's own blend, a shuffle buffer: the same samples arrive in the same
    # order, so the pool emits the same sequence, with the same decoded tensors.
    cfg = _cfg(mode, pool)
    runs = {}
    for te, fill in ((PayloadFillTaskEncoder, False), (IndexedSyntheticTaskEncoder, True)):
        runs[fill] = run_with_cuts(_make(indexed, cfg, num_workers, te, fill), TOTAL, ())[0]
    assert runs[True] == runs[False]
    assert len({k for b in runs[True] for k in b.keys}) == 4 * TOTAL


@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_index_fill_with_a_mixture_schedule_matches_and_resumes(indexed):
    schedule = {"phases": [{"until": 0.5, "weights": {"web": 0.5, "code": 0.2, "mix": 0.3}},
                           {"until": 1.0, "weights": {"web": 0.1, "code": 0.3, "mix": 0.6}}]}
    cfg = _cfg("batch", 32, mixture_schedule=schedule, total_steps=TOTAL,
               schedule_lag_compensation=False)
    today = run_with_cuts(_make(indexed, cfg, 2, PayloadFillTaskEncoder, False), TOTAL, ())[0]
    make = _make(indexed, cfg, 2, IndexedSyntheticTaskEncoder, True)
    full, states = run_with_cuts(make, TOTAL, (0, 13, 29))
    assert full == today
    for cut, state in states.items():
        assert resume(make, state, TOTAL - cut) == full[cut:], f"cut {cut}"


@pytest.mark.parametrize("saved,restored", [(True, False), (False, True)])
@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_a_checkpoint_restores_across_index_fill_on_and_off(indexed, saved, restored):
    cfg = _cfg("batch", 64)
    te = {True: IndexedSyntheticTaskEncoder, False: PayloadFillTaskEncoder}
    full, states = run_with_cuts(_make(indexed, cfg, 2, te[saved], saved), TOTAL, (17,))
    assert resume(_make(indexed, cfg, 2, te[restored], restored), states[17], TOTAL - 17) == full[17:]


def test_the_fill_reads_no_payload(indexed, monkeypatch):
    # Energon's tar reader must never run: the fill reads keys from the index, and emission
    # reads byte ranges. Every emitted sample is read exactly once.
    def no_tar_reads(self, idx):
        raise AssertionError(f"payload read through Energon's tar reader: sample {idx}")

    reads = []
    original = ByteRangeReader.read

    def counted(self, index):
        reads.append(index)
        return original(self, index)

    def no_lookups(self, key):
        raise AssertionError(f"length looked up one by one: {key}")

    monkeypatch.setattr(ITarReader, "__getitem__", no_tar_reads)
    monkeypatch.setattr(ByteRangeReader, "read", counted)
    # The lengths ride along with the keys (one joined read per block of samples).
    monkeypatch.setattr(LengthIndex, "length", no_lookups)
    loader = _make(indexed, _cfg("batch", 64), 0, IndexedSyntheticTaskEncoder, True)()
    it = iter(loader)
    batches = [next(it) for _ in range(TOTAL)]
    del it
    close_loader(loader)
    emitted = [k for b in batches for k in b.keys]
    assert len(reads) == len(emitted) == 4 * TOTAL


def test_joined_lengths_are_the_length_index(indexed, tmp_path):
    import shutil

    web = indexed.parent / "web"
    index = LengthIndex.open(web)
    shards = [(s.name, s.count) for s in _energon_loader(web).join_readers[0].shard_infos]
    reader = ByteRangeReader(web, shards, lengths=index.path, lengths_digest=index.digest)
    for i in range(len(reader)):
        shard, key, length = reader.visit(i)
        assert (shard, key) == (reader.shard_name(i), reader.key(i))
        assert length == index.length(key)
    assert ByteRangeReader(web, shards).visit(0)[2] is None
    # An index replaced under the job is refused in the process that reads it.
    copy = tmp_path / "lengths.sqlite"
    shutil.copy(index.path, copy)
    stale = ByteRangeReader(web, shards, lengths=copy, lengths_digest="not-this-one")
    with pytest.raises(LengthIndexError, match="was replaced while this job reads it"):
        stale.visit(0)


def test_no_index_fill_where_the_payload_is_needed(indexed):
    # holds = "raw" keeps the payload; a source without a length index measures the payload.
    _make(indexed, _cfg("batch", 64, holds="raw"), 0, IndexedSyntheticTaskEncoder, False)()
    loader = _energon_loader(indexed.parent / "web")
    assert index_fill_problem(loader) is None
    loader.join_readers = [loader.join_readers[0], loader.join_readers[0]]
    assert index_fill_problem(loader) == "it joins 2 datasets"
    with pytest.raises(OrderingConfigError, match="cannot fill from the indexes.*joins 2"):
        index_filled(loader)


def test_an_index_without_byte_ranges_falls_back_to_the_payload_fill(indexed, tmp_path):
    import shutil
    import sqlite3

    copy = tmp_path / "web"
    shutil.copytree(indexed.parent / "web", copy)
    con = sqlite3.connect(copy / ".nv-meta" / "index.sqlite")
    con.execute("DROP TABLE sample_parts")
    con.commit()
    con.close()
    loader = _energon_loader(copy)
    assert "no byte ranges per part" in index_fill_problem(loader)
    with pytest.raises(OrderingConfigError, match="has no tables samples and sample_parts"):
        ByteRangeReader(copy, [(s.name, s.count) for s in loader.join_readers[0].shard_infos])
    _make(copy, _cfg("batch", 64), 0, IndexedSyntheticTaskEncoder, False)()


def test_fast_choice_draws_what_energons_worker_rng_draws():
    # The index fill's RNG must pick the same slice with the same draw as Energon's, also when
    # the weights change in place (a slice ends: a new one's size, or 0 when none is left), and
    # leave the generator where Energon's leaves it whenever anything else draws or saves: in
    # the middle of a block of draws, at its end, across a restore.
    import random

    import torch
    from megatron.energon.rng import WorkerRng

    from energon_ordering.pool.index_fill import DRAW_BLOCK, FastChoiceRng

    wc = WorkerConfig(rank=1, world_size=4, num_workers=0)
    wc.worker_activate(0)
    try:
        trace = {}
        for cls in (WorkerRng, FastChoiceRng):
            rng, edits = cls(wc), random.Random(7)
            probs = torch.tensor([16.0, 16.0, 9.0, 16.0, 3.0, 16.0], dtype=torch.float32)
            out, saved = [], None
            for i in range(6 * DRAW_BLOCK):
                out.append(rng.choice_idx(probs))
                if edits.random() < 0.1:
                    probs[edits.randrange(len(probs))] = float(edits.choice([0, 1, 7, 16, 33]))
                if probs.sum() == 0:
                    probs[0] = 5.0
                if i == DRAW_BLOCK - 1 or edits.random() < 0.004:
                    out.append(("save", rng.save_state()["rng"]))
                    saved = rng.save_state()
                if edits.random() < 0.004:
                    out.append(("randbelow", rng.randbelow(1000)))
                if edits.random() < 0.002:
                    out.append(("shuffle", tuple(rng.shuffle(list(range(9))))))
                if edits.random() < 0.002 and saved is not None:
                    rng.restore_state(saved)
                    out.append("restored")
            trace[cls] = out, rng.save_state()["rng"]
        assert trace[FastChoiceRng] == trace[WorkerRng]
        picks = [x for x in trace[WorkerRng][0] if isinstance(x, int)]
        assert len(set(picks)) == 6
        assert sum(x == "restored" for x in trace[WorkerRng][0]) >= 3
    finally:
        wc.worker_deactivate()


@pytest.mark.parametrize("shuffle_over_epochs", [None, 1, 2, -1])
@pytest.mark.parametrize("parallel", [1, 3, 16])
def test_the_index_walk_is_energons_walk(indexed, shuffle_over_epochs, parallel):
    # The index-filled loader's walk against Energon's own loader over the same slice plan:
    # the same samples in the same order over several epochs, the same saved state at every
    # save point, and a walk restored from any of them continues identically.
    from megatron.energon.flavors.webdataset.sample_loader import WebdatasetSampleLoaderDataset

    if shuffle_over_epochs is None and parallel > 1:
        pytest.skip("Energon walks unshuffled slices one at a time")
    base = _energon_loader(indexed.parent / "mix")
    wc = WorkerConfig(rank=1, world_size=2, num_workers=0)

    def energon():
        return WebdatasetSampleLoaderDataset(
            base.join_readers, base.workers_slice_offsets, worker_config=wc,
            shuffle_over_epochs=shuffle_over_epochs, parallel_slice_iters=parallel)

    def walk(loader, n, state=None):
        wc.worker_activate(0)
        try:
            loader.reset_state_own()
            if state is not None:
                loader.restore_state(state)
            keys, states = [], []
            while len(keys) < n:
                for sample in loader:
                    keys.append(sample.__restore_key__)
                    if len(keys) % 37 == 0:
                        states.append(loader.save_state())
                    if len(keys) == n:
                        break
            return keys, states
        finally:
            wc.worker_deactivate()

    per_worker = base.workers_slice_offsets[0][-1] - base.workers_slice_offsets[0][0]
    n = int(2.5 * per_worker)
    ours, ours_states = walk(index_filled(energon()), n)
    theirs, their_states = walk(energon(), n)
    assert ours == theirs
    assert [dict(s) for s in ours_states] == [dict(s) for s in their_states]
    for k in (1, len(their_states) // 2, len(their_states) - 1):
        rest = n - 37 * (k + 1)
        assert walk(index_filled(energon()), rest, their_states[k])[0] == theirs[37 * (k + 1):]
