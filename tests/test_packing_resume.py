"""Exact resume with sequence packing where users run it (issue 22, "Packing"), on real pipelines.

- a document cut twice (by the warmup's round target and by its own pack's target) restores
  through both cuts;
- a state saved in the last micro-batches of a finite epoch, or after the last one, continues
  with exactly the remainder (packing alone, with the pool of samples, with the pool of packs),
  also when the last micro-batch is partial (with or without a shuffle buffer);
- every pack fits the cap of its emission step whatever the user's packer does;
- an epoch that drops every sample under ``overflow: drop`` warns once, with the count.
"""

from __future__ import annotations

import itertools
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from megatron.energon import stateless

from energon_ordering import OrderingConfig
from energon_ordering.errors import SeqLenOverflowError
from energon_ordering.inspect.diagnostics import warmup_counts
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    resume,
    run_saving_every_step,
    run_with_cuts,
)
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder
from energon_ordering.pool.ffd_pack import first_fit_decreasing
from energon_ordering.state_stamp import restore_state_rank
from energon_ordering.warmup.cap_cut import EverySampleDroppedWarning
from energon_ordering.warmup.pack_cap import pack_target
from energon_ordering.warmup.schedule import SeqLenWarmup

WARMUP = dict(start=256, full=2048, warmup_steps=6)  # 12 micro-batches with 2 per step


@pytest.fixture(scope="module")
def tail_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """160 trimodal samples (15% around 4,000 tokens: cut by every warmup cap and by the pack
    target) in 5 shards of 32: a finite epoch is ~40 micro-batches of 2 packs."""
    root = tmp_path_factory.mktemp("tail")
    make_synthetic_dataset(root, [SourceSpec("web", 160, "trimodal")], shard_size=32)
    return root / "web"


def _cfg(mode: str, *, warmup: bool = True, **kw) -> OrderingConfig:
    """The issue's setup: buffer 16, target 2048, warmup 256 -> 2048 over 6 steps, 2 micro-batches
    per step, a pool of 8 (of packs or of samples); ``alone``: packing only."""
    if mode == "alone":
        return OrderingConfig(packing_buffer_size=16, pack_seq_length=2048, **kw)
    return OrderingConfig(
        length_sort_pool_size=8, length_sort_mode="sample", micro_batches_per_step=2,
        seq_length_warmup=WARMUP if warmup else None, packing_buffer_size=16, pack_seq_length=2048,
        pack_pool_placement=mode, seed=3, **kw)


def _record(batch):
    return (tuple(batch.keys), batch.tokens.clone(), tuple(map(tuple, batch.pack_lengths)))


def _same(got, want) -> bool:
    return got[0] == want[0] and torch.equal(got[1], want[1]) and got[2] == want[2]


def _restore_keys(node):
    """Every restore key (a tuple starting with a stage name) in a saved loader state."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            if node and node[0] in ("PackCapDataset", "MapDataset", "FinitePackingDataset"):
                yield node
            stack.extend(node)
        elif hasattr(node, "__dataclass_fields__") and not isinstance(node, type):
            stack.extend(getattr(node, f) for f in node.__dataclass_fields__)


# ---- restore keys that nest --------------------------------------------------------------------


def _check_cuts(path, cfg, num_workers, repeat, cuts, total):
    def make():
        return build_train_loader(path, ordering=cfg, num_workers=num_workers, batch_size=2,
                                  shuffle_buffer_size=8, repeat=repeat)

    full, states = run_with_cuts(make, total, cuts, record=_record)
    twice = 0
    for cut, state in states.items():
        twice += any(key.count("PackCapDataset") >= 2 for key in _restore_keys(state))
        resumed = resume(make, state, total - cut, record=_record)
        for b, (want, got) in enumerate(zip(full[cut:], resumed), start=cut):
            assert _same(got, want), f"cut {cut}: micro-batch {b} differs"
    return twice


@pytest.mark.parametrize("repeat", [True, False])
@pytest.mark.parametrize("placement", ["packs", "samples"])
def test_a_document_cut_twice_restores_through_both_cuts(tail_dataset, placement, repeat):
    # before the fix: AssertionError in Energon's MapDataset.restore_sample at cuts 1, 3, 5, 7
    twice = _check_cuts(tail_dataset, _cfg(placement), 0, repeat, (1, 3, 5, 7), 10)
    assert twice, "no saved state held a document cut twice: the test lost its subject"


@pytest.mark.slow
@pytest.mark.parametrize("repeat", [True, False])
@pytest.mark.parametrize("placement", ["packs", "samples"])
def test_a_document_cut_twice_restores_through_both_cuts_with_workers(tail_dataset, placement, repeat):
    twice = _check_cuts(tail_dataset, _cfg(placement), 2, repeat, (1, 3, 5, 7), 10)
    assert twice


@pytest.mark.slow
def test_the_shipped_packing_recipe_scaled_down_resumes_exactly(three_sources):
    # recipes/slm_350m_20b.yaml with the data of three_sources (its 4 sources -> 3) and a warmup
    # of 20 steps: before the fix it failed at cuts 2, 9 and 17
    cfg = OrderingConfig(
        total_steps=60, micro_batches_per_step=2, seed=1234, blend_policy="deterministic",
        mixture_schedule={"phases": [{"until": 54, "weights": {"web": 0.62, "code": 0.26, "curated": 0.12}},
                                     {"until": 60, "weights": {"web": 0.35, "code": 0.30, "curated": 0.35}}]},
        seq_length_warmup={"start": 512, "full": 2048, "warmup_steps": 20, "multiple_of": 1, "overflow": "keep"},
        packing_buffer_size=16, pack_seq_length=2048, length_sort_pool_size=24, length_sort_mode="sample",
        pack_pool_placement="packs", schedule_lag_compensation=True)
    for num_workers in (0, 2):
        _check_cuts(three_sources, cfg, num_workers, True, (2, 9, 17), 24)


# ---- the end of a finite epoch -----------------------------------------------------------------


def _run_to_end(make, state):
    loader = make()
    restore_state_rank(loader, pickle.loads(state))
    out = [_record(b) for b in loader]
    close_loader(loader)
    return out


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["alone", "samples", "packs"])
def test_a_state_saved_at_the_end_of_a_finite_epoch_resumes_with_the_remainder(tail_dataset, mode, num_workers):
    # before the fix: "alone" re-emitted documents from the third-last micro-batch on, the pools
    # replayed the epoch ("expected 0 batches, got 41")
    shuffle = None if mode == "alone" else 8

    def make():
        return build_train_loader(tail_dataset, ordering=_cfg(mode), num_workers=num_workers, batch_size=2,
                                  shuffle_buffer_size=shuffle, repeat=False)

    records, states = run_saving_every_step(make, None, record=_record)
    docs = [k for r in records for k in r[0]]
    assert sorted(docs) == [f"web-{i:08d}" for i in range(160)]  # every document exactly once
    n = len(records)
    for i in range(n - 3, n + 1):  # the last three micro-batches, and after the last one
        got = _run_to_end(make, states[i])
        assert len(got) == n - i, f"state {i} of {n}: expected {n - i} micro-batches, got {len(got)}"
        assert all(_same(g, w) for g, w in zip(got, records[i:])), f"state {i} of {n}: the remainder differs"


@pytest.fixture(scope="module")
def short_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """128 trimodal samples in 8 shards of 16: packed to 1024 tokens, the last micro-batch of 4
    packs is partial."""
    root = tmp_path_factory.mktemp("short")
    make_synthetic_dataset(root, [SourceSpec("web", 128, "trimodal")], shard_size=16)
    return root / "web"


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("placement", ["packs", "samples"])
@pytest.mark.parametrize("shuffle", [None, 8])
def test_a_state_saved_after_a_partial_last_micro_batch_resumes_with_nothing(
    short_dataset, shuffle, placement, num_workers
):
    # the batcher emits a partial last micro-batch after its input has ended, when every stage
    # below has reset itself to the next epoch; before the fix (InputEndDataset) the state saved
    # after it restored to a replay of the epoch in all four cases: "expected 0, got 24"
    cfg = OrderingConfig(
        length_sort_pool_size=8, length_sort_mode="batch", seed=7, micro_batches_per_step=2,
        packing_buffer_size=16, pack_seq_length=1024, pack_pool_placement=placement)

    def make():
        return build_train_loader(short_dataset, ordering=cfg, num_workers=num_workers,
                                  batch_size=4, shuffle_buffer_size=shuffle,
                                  max_samples_per_sequence=16, repeat=False)

    records, states = run_saving_every_step(make, None, record=_record)
    assert sorted(k for r in records for k in r[0]) == [f"web-{i:08d}" for i in range(128)]
    assert any(len(r[2]) < 4 for r in records), "no partial micro-batch: the test lost its subject"
    n = len(records)
    for i in range(n - 2, n + 1):  # the last two micro-batches, and after the last one
        got = _run_to_end(make, states[i])
        assert len(got) == n - i, f"state {i} of {n}: expected {n - i}, got {len(got)}"
        assert all(_same(g, w) for g, w in zip(got, records[i:])), f"state {i} of {n}: differs"


# ---- caps hold whatever the packer -------------------------------------------------------------


class FixedLengthPackerTE(SyntheticTaskEncoder):
    """A user's packer that ignores the warmup: first-fit decreasing to a constant 2,048."""

    def select_samples_to_pack(self, samples):
        lengths = [s.total_len for s in samples]
        return [[samples[i] for i in p] for p in first_fit_decreasing(lengths, 2048)]

    @stateless
    def pack_selected_samples(self, samples):
        return self.ordering_pack_selected_samples(samples)


class AttributePackerTE(FixedLengthPackerTE):
    """Packs to its own ``packing_seq_length``, as Megatron-LM's examples/multimodal encoder."""

    def __init__(self):
        super().__init__()
        self.packing_seq_length = 2048
        self.seen_lengths: list[int] = []

    def select_samples_to_pack(self, samples):
        self.seen_lengths.append(self.packing_seq_length)
        lengths = [s.total_len for s in samples]
        return [[samples[i] for i in p] for p in first_fit_decreasing(lengths, self.packing_seq_length)]


def _over_cap(batches, warm):
    return [(i, sum(p)) for i, b in enumerate(batches) for p in b.pack_lengths
            if len(p) > 1 and sum(p) > pack_target(i // 2, 2048, warm)]


@pytest.mark.parametrize("placement", ["packs", "samples"])
def test_a_packer_that_ignores_the_warmup_is_held_to_the_caps(tail_dataset, placement):
    warm = SeqLenWarmup(**WARMUP)

    def make():
        return build_train_loader(tail_dataset, ordering=_cfg(placement), batch_size=2, shuffle_buffer_size=8,
                                  task_encoder_factory=FixedLengthPackerTE)

    loader = make()
    batches = list(itertools.islice(loader, 14))
    state = loader.save_state_rank()
    close_loader(loader)
    assert not _over_cap(batches, warm)  # before the fix: packs of up to 2,048 tokens under a cap of 256
    assert warmup_counts(state)["packs_over_cap"] > 0  # re-split first-fit, counted
    # and the re-split packs resume exactly
    full, states = run_with_cuts(make, 12, (3, 8), record=_record)
    for cut, st in states.items():
        assert all(_same(g, w) for g, w in zip(resume(make, st, 12 - cut, record=_record), full[cut:]))


def test_a_packer_that_reads_its_packing_seq_length_gets_the_rounds_target(tail_dataset):
    warm = SeqLenWarmup(**WARMUP)
    te = AttributePackerTE()
    loader = build_train_loader(tail_dataset, ordering=_cfg("samples"), batch_size=2, shuffle_buffer_size=8,
                                task_encoder_factory=lambda: te)
    batches = list(itertools.islice(loader, 14))
    state = loader.save_state_rank()
    close_loader(loader)
    assert not _over_cap(batches, warm)
    assert warmup_counts(state)["packs_over_cap"] == 0  # its own packs fit: nothing re-split
    assert te.seen_lengths[0] == 256 and max(te.seen_lengths) <= 2048 and len(set(te.seen_lengths)) > 1
    assert te.packing_seq_length == 2048  # set for the call only


class KnapsackTE(AttributePackerTE):
    """Refuses a document above its ``packing_seq_length``, as Megatron's greedy_knapsack does;
    every third sample has 300 media tokens, more than the first caps (256)."""

    def media_tokens(self, sample):
        return 300 if int(sample.__key__.rsplit("-", 1)[1]) % 3 == 0 else 64

    def select_samples_to_pack(self, samples):
        longest = max(s.total_len for s in samples)
        if longest > self.packing_seq_length:
            raise ValueError(f"knapsack: A sample is larger {longest} than the max_sequence_length")
        return super().select_samples_to_pack(samples)


def test_documents_kept_over_the_cap_are_packed_alone_not_handed_to_a_target_attribute_packer(tail_dataset):
    warm = SeqLenWarmup(**WARMUP)
    loader = build_train_loader(tail_dataset, ordering=_cfg("samples"), batch_size=2, repeat=False,
                                shuffle_buffer_size=8, task_encoder_factory=KnapsackTE)
    batches = list(loader)
    close_loader(loader)
    assert not _over_cap(batches, warm)
    # overflow "keep": every document arrives once, the big images alone and uncut
    assert sorted(k for b in batches for k in b.keys) == [f"web-{i:08d}" for i in range(160)]
    assert any(len(p) == 1 and p[0] > pack_target(i // 2, 2048, warm)
               for i, b in enumerate(batches) for p in b.pack_lengths)


def test_a_pack_over_its_cap_is_refused_under_overflow_error(tail_dataset):
    loader = build_train_loader(tail_dataset, ordering=_cfg("samples", seq_length_overflow="error"), batch_size=2,
                                task_encoder_factory=FixedLengthPackerTE)
    with pytest.raises(SeqLenOverflowError, match=r"FixedLengthPackerTE.select_samples_to_pack returned a pack of "
                       r"\d+ documents and \d+ tokens, more than the pack target of 256 tokens.*ordering_pack_target"):
        list(itertools.islice(loader, 4))
    close_loader(loader)


# ---- an epoch that drops every sample ----------------------------------------------------------


class BigImages(SyntheticTaskEncoder):
    def __init__(self):
        super().__init__(image_tokens=300)  # more media tokens than the first caps (256)


@pytest.mark.parametrize("packing", [True, False])
def test_an_epoch_that_drops_every_sample_warns_once_with_the_count(tail_dataset, packing):
    cfg = OrderingConfig(micro_batches_per_step=2, seq_length_warmup=WARMUP, seq_length_overflow="drop",
                         packing_buffer_size=16 if packing else None, pack_seq_length=2048 if packing else None)
    loader = build_train_loader(tail_dataset, ordering=cfg, batch_size=2, repeat=False, task_encoder_factory=BigImages)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert list(loader) == []  # before the fix: this, in silence
    close_loader(loader)
    dropped = [w for w in caught if issubclass(w.category, EverySampleDroppedWarning)]
    assert len(dropped) == 1, [str(w.message) for w in caught]
    stage = "Sequence packing" if packing else "Sequence-length warmup"
    assert f"{stage}: all 160 samples of this epoch on rank 0 worker 0 were dropped" in str(dropped[0].message)
