"""Soak: random cut-and-resume cycles over random pipelines, zero mismatches (issue 12).

Every cycle draws a pipeline (loader workers 0-3, pool size 1-512, both modes, both placements,
schedule on/off, warmup on/off, finite or repeating data) and a cut anywhere, including after
the last sample of a finite epoch, runs it uninterrupted on a real prepared dataset, restores a
fresh loader from the state saved at the cut and asserts the identical continuation (for a
finite epoch: exactly the remainder, then the end).

``SOAK_SEED`` reproduces a run (the seed is printed; run ``pytest -s`` to see it);
``SOAK_CYCLES`` sets the number of cycles (default 200, split over the parametrised chunks so
that each stays under the per-test timeout).
"""

from __future__ import annotations

import itertools
import os
import pickle
import random

import pytest

from energon_ordering import OrderingConfig, OrderingConfigError, restore_state_rank
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    record_batch,
    run_saving_every_step,
)
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

CHUNKS = 20
CYCLES = int(os.environ.get("SOAK_CYCLES", "200"))
SEED = int(os.environ.get("SOAK_SEED", str(random.SystemRandom().randrange(1 << 30))))
BATCH = 4
#: Micro-batches compared after a cut (the whole remainder when fewer remain).
COMPARE = 12
#: Cuts (cycles) per uninterrupted run.
CUTS_PER_RUN = 5


@pytest.fixture(scope="module")
def soak_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    make_synthetic_dataset(root / "single", [SourceSpec("web", 128, "trimodal")], shard_size=16)
    meta = make_synthetic_dataset(
        root / "meta", [SourceSpec("web", 64, "trimodal"), SourceSpec("code", 64, "medium")],
        shard_size=16,
    )
    return {"single": root / "single" / "web", "meta": meta}


def _draw(rng: random.Random) -> dict:
    mode = rng.choice(["sample", "batch"])
    pool = rng.choice([0, rng.randint(1, 16), rng.randint(1, 512)])
    if mode == "batch":
        pool = max(BATCH, pool // BATCH * BATCH) if pool else 0
    schedule = rng.random() < 0.5
    return dict(
        num_workers=rng.randint(0, 3),
        pool=pool,
        mode=mode,
        placement=rng.choice(["post-encode", "pre-encode"]),
        schedule=schedule,
        warmup=rng.random() < 0.5,
        repeat=rng.random() < 0.5,
        shuffle=rng.choice([None, 8]),
        steps=rng.randint(8, 28),
    )


def _config(d: dict) -> OrderingConfig:
    return OrderingConfig(
        length_sort_pool_size=d["pool"],
        length_sort_mode=d["mode"],
        length_sort_placement=d["placement"],
        seed=7,
        micro_batches_per_step=2,
        mixture_schedule={
            "total_steps": 30,
            "phases": [{"until": 0.5, "weights": {"web": 0.8, "code": 0.2}},
                       {"until": 1.0, "ramp_steps": 4, "weights": {"web": 0.2, "code": 0.8}}],
        } if d["schedule"] else None,
        seq_length_warmup={"start": 256, "full": 4096, "warmup_steps": 12} if d["warmup"] else None,
    )


def _maker(data: dict, d: dict):
    path = data["meta"] if d["schedule"] else data["single"]
    cfg = _config(d)
    return lambda: build_train_loader(
        path, ordering=cfg, num_workers=d["num_workers"], batch_size=BATCH,
        shuffle_buffer_size=d["shuffle"], max_samples_per_sequence=16, repeat=d["repeat"],
    )


def _run(make, steps: int | None):
    """``steps`` micro-batches (None: the whole finite epoch) and the state before each one
    (plus, for a finite epoch, the state after the last)."""
    return run_saving_every_step(make, steps)


@pytest.mark.timeout(900)  # 10 cycles, each building up to 7 real loaders
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_soak_random_cut_and_resume(soak_data, chunk):
    seed = SEED * 1000 + chunk
    print(f"soak seed: SOAK_SEED={SEED} (chunk {chunk}: random.Random({seed}))")
    rng = random.Random(seed)
    cycles = CYCLES // CHUNKS + (1 if chunk < CYCLES % CHUNKS else 0)
    done, mismatches = 0, []
    while done < cycles:
        d = _draw(rng)
        try:
            records, states = _run(_maker(soak_data, d), d["steps"] if d["repeat"] else None)
        except OrderingConfigError as e:
            # A pool larger than a worker's share of repeating data is refused at build time;
            # the cycle goes on with a pool that fits.
            assert d["repeat"] and "larger than a loader worker's share" in str(e), (d, e)
            d["pool"] = BATCH * rng.randint(1, 4)
            records, states = _run(_maker(soak_data, d), d["steps"])
        make = _maker(soak_data, d)
        for _ in range(min(CUTS_PER_RUN, cycles - done)):
            cut = rng.randint(0, len(states) - 1)
            if not d["repeat"] and rng.random() < 0.5:  # half of the finite cuts near the end
                cut = rng.randint(max(0, len(states) - COMPARE), len(states) - 1)
            expected = records[cut : cut + COMPARE]
            # A finite epoch's remainder is read one past its end: it must end there.
            to_end = not d["repeat"] and len(records) - cut <= COMPARE
            loader = make()
            restore_state_rank(loader, pickle.loads(states[cut]))
            got = [record_batch(b) for b in
                   itertools.islice(loader, len(expected) + (1 if to_end else 0))]
            close_loader(loader)
            ok = got == expected
            if not ok:
                mismatches.append((d, cut, len(records)))
            done += 1
    assert not mismatches, f"SOAK_SEED={SEED} chunk {chunk}: mismatches {mismatches}"
