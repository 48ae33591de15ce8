"""Elastic resume of the planned order is as exact as an exact one (issue 31, contract 13).

After a restore at another data-parallel shape, every stage that depends on the optimizer step
reads the plan's step (the sequence-length warmup's cap, the planned packs' caps), and every state
the restored loader saves resumes exactly: before its first micro-batch, mid-step and at a step
boundary, with loader workers 0-3. Compared by what the model sees: per optimizer step, each
sample's key and its token length after the warmup's cut (and the pack boundaries when packing).
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
import sys

import pytest
from megatron.energon import stateless

from energon_ordering import OrderingConfig, restore_state_rank
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    record_batch,
    resume,
)
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

B = 4
K = 4  # plan_window_steps: a restore at step 6 falls inside window 1
WARMUP = {"start": 128, "full": 2048, "warmup_steps": 10}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two indexed sources (web: short, code: long), enough for 14 steps of 24 samples."""
    return indexed_synthetic(
        tmp_path_factory.mktemp("elastic_exact"),
        [SourceSpec("web", 300, "short", weight=0.7), SourceSpec("code", 160, "long", weight=0.3)],
        shard_size=32)


def _config(mbps: int, **kw) -> OrderingConfig:
    return OrderingConfig(**{**dict(
        length_sort_mode="planned", length_sort_placement="pre-encode",
        length_sort_pool_holds="keys", micro_batches_per_step=mbps, seed=3, plan_window_steps=K,
        seq_length_warmup=WARMUP, planned_mix="step"), **kw})


def _loader(data, world_size, mbps, rank, num_workers=0, pack=False, loader_kwargs=None, **kw):
    """Rank ``rank``'s planned loader (``pack``: micro-batches of one pack; ``loader_kwargs``:
    for ``get_savable_loader``)."""
    return build_train_loader(data, ordering=_config(mbps, **kw), rank=rank,
                              world_size=world_size, num_workers=num_workers,
                              batch_size=1 if pack else B,
                              packing_buffer_size=32 if pack else None,
                              task_encoder_factory=IndexedSyntheticTaskEncoder,
                              **(loader_kwargs or {}))


def _seen(records, mbps):
    """Per optimizer step, the sorted (key, tokens) of every rank's samples (what the model
    sees, whichever rank gets it)."""
    steps = len(records[0]) // mbps
    return [sorted(pair for rank in records for rec in rank[s * mbps:(s + 1) * mbps]
                   for pair in zip(rec.keys, rec.lengths, strict=True))
            for s in range(steps)]


def _copy(state):
    return pickle.loads(pickle.dumps(state))


def _run(data, world_size, mbps, micro_batches, *, state=None, num_workers=0, save_at=None,
         **kw):
    """``micro_batches`` micro-batches on every rank (each restored from ``state``, if given);
    returns the records and rank 0's states after ``save_at`` micro-batches (and at the end)."""
    records, states = [], {}
    for rank in range(world_size):
        loader = _loader(data, world_size, mbps, rank, num_workers, **kw)
        if state is not None:
            restore_state_rank(loader, state)
        it = iter(loader)
        recs = []
        for b in range(micro_batches + 1):
            if rank == 0 and save_at is not None and b in save_at:
                states[b] = _copy(loader.save_state_rank())
            if b < micro_batches:
                recs.append(record_batch(next(it)))
        records.append(recs)
        del it
        close_loader(loader)
    return records, states


def _rank0_from(data, world_size, mbps, state, micro_batches, num_workers=0):
    """Rank 0's next ``micro_batches`` records, restored from ``state``."""
    return resume(lambda: _loader(data, world_size, mbps, 0, num_workers), state, micro_batches)


def test_elastic_resume_keeps_the_warmup_caps(data):
    """3 ranks x 2 micro-batches saved at step 6 (inside the warmup and a plan window), resumed
    on 2 ranks x 3: every resumed sample is cut to its step's cap, as uninterrupted."""
    steps = 10
    whole, _ = _run(data, 3, 2, steps * 2)
    _, states = _run(data, 3, 2, 6 * 2, save_at={6 * 2})
    rest, _ = _run(data, 2, 3, (steps - 6) * 3, state=states[12])
    assert _seen(rest, 3) == _seen(whole, 2)[6:]
    assert any(n < 300 for s in _seen(whole, 2)[6:] for _, n in s)  # caps really cut


@pytest.mark.parametrize("cut", [0, 1, 3, 5])  # micro-batches after the elastic restore
def test_a_state_saved_after_an_elastic_restore_resumes_exactly(data, cut):
    """A loader restored elastically (3x2 -> 2x3) saves at ``cut`` micro-batches (before its
    first, mid-step, at a step boundary); that state restored exactly continues as the loader
    did."""
    _, states = _run(data, 3, 2, 4 * 2, save_at={8})
    n = 4 * 3
    elastic, saved = _run(data, 2, 3, n, state=states[8], save_at={cut})
    assert saved[cut] is not None
    # rank 0 of the 2x3 shape from its own state: the rest of what it saw
    assert _rank0_from(data, 2, 3, saved[cut], n - cut) == elastic[0][cut:]


def test_restoring_none_into_a_planned_loader_says_it_starts_afresh(data, caplog):
    loader = _loader(data, 2, 3, 0)
    with caplog.at_level(logging.INFO, logger="energon_ordering"):
        restore_state_rank(loader, None)
    assert [r for r in caplog.records if "afresh" in r.getMessage()]
    close_loader(loader)


@pytest.mark.slow  # loader worker processes
@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("cut", [0, 1, 4])
def test_elastic_then_exact_with_loader_workers(data, num_workers, cut):
    """The same with loader workers: the elastic restore from a 2-worker 3x2 state, a save at
    ``cut`` (before any micro-batch, mid-step, after a step), the exact restore of that state:
    the same samples and lengths, and the warmup's caps of the uninterrupted run."""
    steps = 8
    whole, _ = _run(data, 3, 2, steps * 2)
    _, states = _run(data, 3, 2, 4 * 2, save_at={8}, num_workers=2)
    n = (steps - 4) * 3
    elastic, saved = _run(data, 2, 3, n, state=states[8], save_at={cut},
                          num_workers=num_workers)
    assert _seen(elastic, 3) == _seen(whole, 2)[4:]
    assert saved[cut] is not None
    assert _rank0_from(data, 2, 3, saved[cut], n - cut, num_workers) == elastic[0][cut:]


def _planned_entry(state):
    """The planned source's saved state in rank state ``state`` (0 loader workers)."""
    from energon_ordering.state_stamp import _find_saved_class
    return _find_saved_class(state.worker_states[0], "PlannedSourceDataset")


def test_a_version_1_state_restores_unless_an_elastic_resume_dealt_it(data):
    """States of PLANNED_STATE_VERSION 1 and 2 (which had no ``_epoch_offset``: their next
    epochs started under no rotation) continue alike unless a version-1 history holds an
    elastic restore (version 1 moved samples between the steps of that window): refused, by
    name."""
    from energon_ordering.errors import StateMismatchError

    _, plain = _run(data, 2, 3, 6, save_at={6})
    current, _ = _run(data, 2, 3, 3, state=plain[6])
    entry = _planned_entry(plain[6])
    assert entry["_stamp"]["state_version"] == 3 and entry["_epoch_offset"] == 0
    del entry["_epoch_offset"]
    for version in (2, 1):
        entry["_stamp"]["state_version"] = version
        rest, _ = _run(data, 2, 3, 3, state=plain[6])
        assert rest == current  # taken as it is
    _, states = _run(data, 3, 2, 8, save_at={8})
    _, moved = _run(data, 2, 3, 3, state=states[8], save_at={3})
    entry = _planned_entry(moved[3])
    assert entry["_history"]
    entry["_stamp"]["state_version"] = 1
    del entry["_epoch_offset"]
    loader = _loader(data, 2, 3, 0)
    with pytest.raises(StateMismatchError, match=r"version 1.*elastic resume.*_history"):
        restore_state_rank(loader, moved[3])
    close_loader(loader)


def _packs_seen(records, mbps):
    """Per optimizer step, the sorted packs of every rank: each pack its (key, tokens) pairs."""
    out = []
    for s in range(len(records[0]) // mbps):
        packs = []
        for rank in records:
            for rec in rank[s * mbps:(s + 1) * mbps]:
                at = 0
                for pack in rec.pack_lengths:
                    packs.append(tuple(zip(rec.keys[at:at + len(pack)], pack, strict=True)))
                    at += len(pack)
        out.append(sorted(packs))
    return out


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_elastic_resume_of_packs_keeps_their_caps_and_boundaries(data, num_workers):
    """Packing under the warmup (packs of up to 1,024 tokens, capped at 512-896 by the warmup in
    steps 2-5): 2 ranks x 2 micro-batches of 1 pack saved at step 2, resumed on 1 rank x 4:
    every step holds the same packs, each sample cut to the same length."""
    kw = dict(pack_seq_length=1024, plan_window_steps=K)
    whole, _ = _run(data, 2, 2, 6 * 2, num_workers=num_workers, pack=True, **kw)
    _, states = _run(data, 2, 2, 2 * 2, save_at={4}, num_workers=num_workers, pack=True, **kw)
    rest, _ = _run(data, 1, 4, 4 * 4, state=states[4], pack=True, **kw)
    assert _packs_seen(rest, 4) == _packs_seen(whole, 2)[2:]
    assert max(n for s in _packs_seen(rest, 4)[:1] for p in s for _, n in p) <= 512


def test_the_step_clock_is_found_below_single_wrappers_only(data):
    """The warmup over the planned source reads its step; over a blend (several inner
    datasets, whose ``dataset`` property asserts) it reads Energon's batch index."""
    from megatron.energon.wrappers.blend_dataset import BlendDataset

    from energon_ordering.step_clock import find_step_clock
    from energon_ordering.warmup.seq_warmup import SeqLenWarmupDataset

    loader = _loader(data, 2, 3, 0)
    warmup = loader.dataset.dataset
    while not isinstance(warmup, SeqLenWarmupDataset):
        warmup = warmup.dataset
    assert type(warmup.clock).__name__ == "PlannedSourceDataset"
    blend = BlendDataset((warmup.dataset, 0.5), (warmup.dataset, 0.5),
                         worker_config=warmup.worker_config)
    assert find_step_clock(blend) is None
    close_loader(loader)


def test_elastic_resume_keeps_the_schedules_steps(data):
    """A mixture schedule switching mid-run (steps 4-8 ramp web 0.8 -> 0.2): 3 ranks x 2 saved
    at step 5, resumed on 6 x 1, every step holds the uninterrupted run's samples and tokens,
    so each step's mix is the schedule's at that step."""
    schedule = {"total_steps": 16, "phases": [
        {"until": 0.25, "weights": {"web": 0.8, "code": 0.2}},
        {"until": 1.0, "ramp_steps": 4, "weights": {"web": 0.2, "code": 0.8}}]}
    whole, _ = _run(data, 3, 2, 10 * 2, mixture_schedule=schedule)
    _, states = _run(data, 3, 2, 5 * 2, save_at={10}, mixture_schedule=schedule)
    rest, _ = _run(data, 6, 1, 5, state=states[10], mixture_schedule=schedule)
    seen = _seen(whole, 2)
    assert _seen(rest, 1) == seen[5:]
    webs = [sum(k.startswith("web") for k, _ in s) for s in seen]
    assert webs[0] > webs[-1]  # the schedule really moves the mix


#: (pack target the packer was told, tokens it was handed) per pack, in-process loaders only.
_TOLD: list[tuple[int, int]] = []


class _AskingPacker(IndexedSyntheticTaskEncoder):
    """A user's packer that asks ``ordering_pack_target()`` while it packs."""

    @stateless
    def pack_selected_samples(self, samples):
        _TOLD.append((self.ordering_pack_target(), sum(s.total_len for s in samples)))
        return self.ordering_pack_selected_samples(samples)


def test_a_packer_asking_for_its_target_after_an_elastic_resume_gets_the_plans_cap(data):
    """Planned packs under the warmup, resumed elastically at step 2 (Energon's batch index
    restarts at 0): a packer calling ``ordering_pack_target()`` is told its pack's cap, never
    step 0's, so what it packs fits what it was told."""
    cfg = dict(pack_seq_length=1024, plan_window_steps=K)
    _, states = _run(data, 2, 2, 2 * 2, save_at={4}, pack=True, **cfg)
    loader = build_train_loader(data, ordering=_config(4, **cfg), rank=0, world_size=1,
                                batch_size=1, packing_buffer_size=32,
                                task_encoder_factory=_AskingPacker)
    restore_state_rank(loader, states[4])
    _TOLD.clear()
    it = iter(loader)
    for _ in range(4):  # step 2: cap 512
        next(it)
    del it
    close_loader(loader)
    assert _TOLD and all(tokens <= told == 512 for told, tokens in _TOLD), _TOLD
