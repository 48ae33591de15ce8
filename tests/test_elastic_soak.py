"""Soak: elastic chains of the planned order, by what the model sees (issue 31, contract 13).

Every cycle draws a planned pipeline (warmup, packing, a mixture schedule: each on or off; the
mix granularity, ``planned_mix`` step or window), two
data-parallel shapes of one global batch (ranks x micro-batches per step), loader workers 0-3 on
each side, Energon's worker checkpoint interval, and a cut step; then:

1. the uninterrupted run at the first shape (every rank: per optimizer step, each sample's key
   and token length after the warmup's cut, and the packs);
2. the first shape up to the cut with workers, rank 0's state saved there;
3. the elastic restore of that state on every rank of the second shape: every step after the
   cut must hold what the uninterrupted run holds;
4. one rank of the second shape, restored elastically with its own loader workers, saving its
   state before every micro-batch (before its first one, mid-step, at every step boundary): its
   micro-batches equal that rank's in (3), and each state at a drawn cut, restored into a loader
   of the same shape (at a step boundary with drawn loader workers), continues with exactly the
   rest.

``SOAK_SEED`` reproduces a run (printed with ``pytest -s``); ``ELASTIC_SOAK_CYCLES`` sets the
cycles (default 60, split over the chunks).
"""

from __future__ import annotations

import itertools
import os
import pickle
import random
import sys
from pathlib import Path

import pytest

from energon_ordering import restore_state_rank
from energon_ordering.inspect.rank_simulation import close_loader, record_batch
from energon_ordering.inspect.synthetic import SourceSpec

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402
from test_elastic_exact import _loader, _packs_seen, _run, _seen  # noqa: E402
from soak_budget import out_of_time, report  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.soak]

CHUNKS = 6
CYCLES = int(os.environ.get("ELASTIC_SOAK_CYCLES", "60"))
SEED = int(os.environ.get("SOAK_SEED", str(random.SystemRandom().randrange(1 << 30))))

#: Shapes (ranks, micro-batches per step) of one global batch: 24 samples of micro-batches of
#: 4, or 4 packs of micro-batches of 1.
SHAPES = {False: [(1, 6), (2, 3), (3, 2), (6, 1)], True: [(1, 4), (2, 2), (4, 1)]}

#: A mixture schedule whose weights ramp across the cuts (steps 3-9).
SCHEDULE = {"total_steps": 24, "phases": [
    {"until": 0.125, "weights": {"web": 0.8, "code": 0.2}},
    {"until": 1.0, "ramp_steps": 6, "weights": {"web": 0.3, "code": 0.7}}]}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return indexed_synthetic(
        tmp_path_factory.mktemp("elastic_soak"),
        [SourceSpec("web", 300, "short", weight=0.7), SourceSpec("code", 160, "long", weight=0.3)],
        shard_size=32)


def _draw(rng: random.Random) -> dict:
    pack = rng.random() < 0.5
    before, after = rng.sample(SHAPES[pack], 2)
    return dict(
        pack=pack,
        before=before,
        after=after,
        warmup=rng.random() < 0.7,
        schedule=rng.random() < 0.5,
        workers_before=rng.randint(0, 3),
        workers_after=rng.randint(0, 3),
        workers_exact=rng.randint(0, 3),
        # Energon's worker checkpoints: its default (the first, then every 60 s) or every n
        # samples, so that restores also start from mid-stream checkpoints
        checkpoint_every=rng.choice([None, 1, 2, 3]),
        cut=rng.randint(1, 7),
        rank=rng.randrange(after[0]),
        mix=rng.choice(["step", "window"]),
    )


def _kwargs(d: dict) -> dict:
    kw: dict = dict(pack=d["pack"], planned_mix=d["mix"])
    if d["pack"]:
        kw["pack_seq_length"] = 1024
    if not d["warmup"]:
        kw["seq_length_warmup"] = None
    if d["schedule"]:
        kw["mixture_schedule"] = SCHEDULE
    return kw


def _loader_kwargs(d: dict) -> dict:
    n = d["checkpoint_every"]
    return {} if n is None else dict(checkpoint_every_sec=0, checkpoint_every_min_n_samples=n)


def _cycle(data: Path, d: dict) -> str | None:
    """One elastic chain (see the module docstring); None if every comparison holds."""
    kw = _kwargs(d)
    view = _packs_seen if d["pack"] else _seen
    (R1, M1), (R2, M2) = d["before"], d["after"]
    cut, steps = d["cut"], 4
    whole, _ = _run(data, R1, M1, (cut + steps) * M1, **kw)
    _, saved = _run(data, R1, M1, cut * M1, save_at={cut * M1},
                    num_workers=d["workers_before"], **kw)
    state = saved[cut * M1]
    rest, _ = _run(data, R2, M2, steps * M2, state=state, **kw)
    if view(rest, M2) != view(whole, M1)[cut:]:
        return "the elastic resume's steps differ from the uninterrupted run's"
    # one rank of the new shape with loader workers, saving before every micro-batch
    n = steps * M2
    loader = _loader(data, R2, M2, d["rank"], d["workers_after"],
                     loader_kwargs=_loader_kwargs(d), **kw)
    restore_state_rank(loader, pickle.loads(pickle.dumps(state)))
    records, states, it = [], [], None
    for _ in range(n):
        states.append(pickle.dumps(loader.save_state_rank()))
        it = it or iter(loader)
        records.append(record_batch(next(it)))
    states.append(pickle.dumps(loader.save_state_rank()))
    del it
    close_loader(loader)
    if records != rest[d["rank"]]:
        return f"rank {d['rank']} with {d['workers_after']} workers differs from 0 workers"
    for c in sorted({0, n, *random.Random(repr(d)).sample(range(n + 1), 3)}):
        again_state = pickle.loads(states[c])
        if again_state is None:
            return f"save_state_rank() after the elastic restore returned None at {c}"
        # another number of loader workers is an elastic resume: at a step boundary only
        workers = d["workers_exact"] if c % M2 == 0 else d["workers_after"]
        loader = _loader(data, R2, M2, d["rank"], workers, loader_kwargs=_loader_kwargs(d), **kw)
        restore_state_rank(loader, again_state)
        got = [record_batch(b) for b in itertools.islice(loader, n - c)] if c < n else []
        close_loader(loader)
        if got != records[c:]:
            at = next((i for i, (a, b) in enumerate(zip(got, records[c:])) if a != b), None)
            return f"the exact restore of the state at micro-batch {c} differs at {at}"
    return None


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_soak_elastic_chains(data, chunk):
    seed = SEED * 1000 + chunk
    print(f"elastic soak seed: SOAK_SEED={SEED} (chunk {chunk}: random.Random({seed}))")
    rng = random.Random(seed)
    cycles = CYCLES // CHUNKS + (1 if chunk < CYCLES % CHUNKS else 0)
    mismatches, done = [], 0
    while done < cycles and not out_of_time(done):
        d = _draw(rng)
        problem = _cycle(data, d)
        if problem is not None:
            mismatches.append((d, problem))
        done += 1
    report("elastic soak", chunk, done, cycles, SEED)
    assert not mismatches, f"SOAK_SEED={SEED} chunk {chunk}: {mismatches}"
