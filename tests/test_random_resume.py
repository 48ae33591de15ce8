"""The planned order resumes exactly under configurations drawn at random (seeded): either mix,
padded or packed, with or without the sequence-length warmup, finite or repeating data, 1-3
ranks, 1-3 micro-batches per step, loader workers 0-3, plan windows of 2-5 steps, cut at any
micro-batch (the first, mid-window, the last, after the last).

Each case runs every rank uninterrupted, then from a state saved at a random cut, then from a
state the resumed loader saved (a resume of a resume), and, on repeating data cut at a step
boundary, elastically at another data-parallel shape of the same global batch. Compared by what
the model sees: each rank's micro-batches (keys, tokens after the warmup's cut, sources, pack
boundaries), and per optimizer step the samples (and packs) over all ranks after an elastic
resume. The table-driven tests elsewhere pin the cut points that matter; this one covers the
combinations between them.
"""

from __future__ import annotations

import pickle
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from energon_ordering import OrderingConfig, restore_state_rank
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, record_batch
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

B = 3  # samples per padded micro-batch


@dataclass(frozen=True)
class Case:
    mix: str
    pack: bool
    warmup: bool
    repeat: bool
    ranks: int
    mbps: int
    num_workers: int
    window_steps: int
    seed: int
    steps: int
    cut: int  # micro-batches before the first save
    cut2: int  # micro-batches of the resumed run before its save
    elastic: tuple[int, int] | None  # (ranks, micro-batches per step) of the elastic resume

    @property
    def id(self) -> str:
        return (f"{self.mix}-{'packed' if self.pack else 'padded'}"
                f"{'-warmup' if self.warmup else ''}-{'repeat' if self.repeat else 'finite'}"
                f"-{self.ranks}x{self.mbps}-w{self.num_workers}-k{self.window_steps}"
                f"-cut{self.cut}-{self.cut2}"
                + (f"-elastic{self.elastic[0]}x{self.elastic[1]}" if self.elastic else ""))


def _draw(i: int) -> Case:
    rng = random.Random(1000 + i)
    ranks, mbps = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
    steps = rng.randint(4, 10)
    n = steps * mbps
    cut = rng.choice([0, 1, n // 2, n - 1, n, rng.randint(0, n)])
    repeat = rng.random() < 0.7
    elastic = None
    if repeat and cut and cut % mbps == 0:
        shapes = [(r, ranks * mbps // r) for r in (1, 2, 3, 4)
                  if (ranks * mbps) % r == 0 and r != ranks]
        elastic = rng.choice(shapes) if shapes else None
    return Case(mix=rng.choice(["step", "window"]), pack=rng.random() < 0.4,
                warmup=rng.random() < 0.5, repeat=repeat, ranks=ranks, mbps=mbps,
                num_workers=rng.choice([0, 0, 1, 2, 3]), window_steps=rng.choice([2, 3, 5]),
                seed=rng.randint(0, 99), steps=steps, cut=cut, cut2=rng.randint(0, n - cut),
                elastic=elastic)


CASES = [_draw(i) for i in range(24)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Three indexed sources of different lengths (short, long, medium)."""
    return indexed_synthetic(
        tmp_path_factory.mktemp("random_resume"),
        [SourceSpec("web", 300, "short", weight=0.6), SourceSpec("code", 160, "long", weight=0.3),
         SourceSpec("mid", 120, "medium", weight=0.1)],
        shard_size=24)


def _config(case: Case, mbps: int) -> OrderingConfig:
    kw = dict(length_sort_mode="planned", length_sort_placement="pre-encode",
              length_sort_pool_holds="keys", micro_batches_per_step=mbps, seed=case.seed,
              plan_window_steps=case.window_steps, planned_mix=case.mix)
    if case.warmup:
        kw["seq_length_warmup"] = {"start": 128, "full": 2048, "warmup_steps": 6}
    if case.pack:
        kw["pack_seq_length"] = 1024
    return OrderingConfig(**kw)


def _run(data, case: Case, micro_batches: int, *, ranks: int | None = None,
         mbps: int | None = None, state=None, save_at: int | None = None):
    """Every rank's records of ``micro_batches`` micro-batches (fewer where finite data ends),
    each rank restored from ``state[rank]`` if given, and each rank's state after ``save_at``
    micro-batches."""
    ranks, mbps = ranks or case.ranks, mbps or case.mbps
    records, states = [], []
    for rank in range(ranks):
        loader = build_train_loader(
            data, ordering=_config(case, mbps), rank=rank, world_size=ranks,
            num_workers=case.num_workers, batch_size=1 if case.pack else B,
            packing_buffer_size=16 if case.pack else None, repeat=case.repeat,
            task_encoder_factory=IndexedSyntheticTaskEncoder)
        if state is not None:
            restore_state_rank(loader, state[rank])
        it, recs = None, []
        for b in range(micro_batches + 1):
            if b == save_at:
                states.append(pickle.loads(pickle.dumps(loader.save_state_rank())))
            if b == micro_batches:
                break
            if it is None:  # after a save before the first micro-batch (Energon's rule)
                it = iter(loader)
            try:
                recs.append(record_batch(next(it)))
            except StopIteration:  # finite data ends every rank at the same step
                break
        records.append(recs)
        del it
        close_loader(loader)
    return records, states


def _per_step(records, mbps: int) -> list[list]:
    """Per optimizer step over all ranks: the sorted samples (key, tokens, source) and packs."""
    steps = min(len(r) for r in records) // mbps
    out = []
    for s in range(steps):
        recs = [rec for rank in records for rec in rank[s * mbps:(s + 1) * mbps]]
        samples = sorted(p for rec in recs for p in zip(rec.keys, rec.lengths))
        packs = []
        for rec in recs:
            at = 0
            for pack in rec.pack_lengths:
                packs.append(tuple(zip(rec.keys[at:at + len(pack)], pack, strict=True)))
                at += len(pack)
        out.append((samples, sorted(packs)))
    return out


def _params():
    return [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.num_workers else [])
            for c in CASES]


def test_the_drawn_cases_cover_the_combinations():
    """The seeded draw covers both mixes, packing, the warmup, finite data, workers 0-3, cuts at
    the first and after the last micro-batch, and elastic resumes."""
    assert {c.mix for c in CASES} == {"step", "window"}
    assert {c.pack for c in CASES} == {True, False} and {c.warmup for c in CASES} == {True, False}
    assert {c.repeat for c in CASES} == {True, False}
    assert {c.num_workers for c in CASES} == {0, 1, 2, 3}
    assert any(c.cut == 0 for c in CASES) and any(c.cut == c.steps * c.mbps for c in CASES)
    assert sum(c.elastic is not None for c in CASES) >= 3


@pytest.mark.parametrize("case", _params())
def test_a_random_configuration_resumes_exactly(data, case):
    n = case.steps * case.mbps
    whole, _ = _run(data, case, n)
    assert whole[0], "the uninterrupted run saw no micro-batch"
    _, saved = _run(data, case, case.cut, save_at=case.cut)
    rest, saved2 = _run(data, case, n - case.cut, state=saved, save_at=case.cut2)
    for rank in range(case.ranks):
        assert rest[rank] == whole[rank][case.cut:], f"rank {rank} after the cut"
    rest2, _ = _run(data, case, n - case.cut - case.cut2, state=saved2)
    for rank in range(case.ranks):
        assert rest2[rank] == whole[rank][case.cut + case.cut2:], \
            f"rank {rank} after the resume of the resume"
    if case.elastic:
        ranks, mbps = case.elastic
        first = case.cut // case.mbps
        elastic, _ = _run(data, case, (case.steps - first) * mbps, ranks=ranks, mbps=mbps,
                          state=[saved[0]] * ranks)
        assert _per_step(elastic, mbps) == _per_step(whole, case.mbps)[first:]
