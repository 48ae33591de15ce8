"""Soak: random cut-and-resume cycles over random pipelines, zero mismatches (issues 12 and 22).

Every cycle draws a pipeline (loader workers 0-3, pool size 1-512, both modes, both placements,
schedule on/off, warmup on/off, finite or repeating data, sequence packing on/off with either
pack-pool placement, the default packer or a user's packer that ignores the warmup, Energon's
worker checkpoint interval: its default or every 1-5 samples) and a cut
anywhere, including the last micro-batch and after the last one of a finite epoch, runs it
uninterrupted on a real prepared dataset, restores a fresh loader from the state saved at the cut
and asserts the identical continuation (for a finite epoch: exactly the remainder, then the end).
Every finite epoch is also checked whole: every document exactly once, none longer than it is,
and (in-process, where a state's counters are exact) its tokens conserved: what the batches hold
plus what the warmup and the pack target cut under ``overflow: keep`` equals the documents' uncut
lengths. The planned order's elastic chains have their own soak (``tests/test_elastic_soak.py``).

``SOAK_SEED`` reproduces a run (the seed is printed; run ``pytest -s`` to see it);
``SOAK_CYCLES`` sets the number of cycles (default 300, split over the parametrised chunks so
that each stays under the per-test timeout).
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import random

import pytest
from megatron.energon import stateless

from energon_ordering import OrderingConfig, OrderingConfigError, restore_state_rank
from energon_ordering.inspect.diagnostics import warmup_counts
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    record_batch,
    run_saving_every_step,
)
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder
from energon_ordering.pool.ffd_pack import first_fit_decreasing
from soak_budget import out_of_time, report

pytestmark = [pytest.mark.slow, pytest.mark.soak]

CHUNKS = 30
CYCLES = int(os.environ.get("SOAK_CYCLES", "300"))
SEED = int(os.environ.get("SOAK_SEED", str(random.SystemRandom().randrange(1 << 30))))
BATCH = 4
#: Micro-batches compared after a cut (the whole remainder when fewer remain).
COMPARE = 12
#: Cuts (cycles) per uninterrupted run.
CUTS_PER_RUN = 5


class UserPackerTE(SyntheticTaskEncoder):
    """A user's packer as Megatron-LM's examples/multimodal writes one: first-fit decreasing to
    its own ``packing_seq_length`` attribute (a constant 4,096 as far as it knows), blind to the
    warmup; the mixin holds its packs to the caps."""

    def __init__(self):
        super().__init__()
        self.packing_seq_length = 4096

    def select_samples_to_pack(self, samples):
        lengths = [s.total_len for s in samples]
        return [[samples[i] for i in p] for p in first_fit_decreasing(lengths, self.packing_seq_length)]

    @stateless
    def pack_selected_samples(self, samples):
        return self.ordering_pack_selected_samples(samples)


@pytest.fixture(scope="module")
def soak_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    make_synthetic_dataset(root / "single", [SourceSpec("web", 128, "trimodal")], shard_size=16)
    meta = make_synthetic_dataset(
        root / "meta", [SourceSpec("web", 64, "trimodal"), SourceSpec("code", 64, "medium")],
        shard_size=16,
    )
    return {"single": root / "single" / "web", "meta": meta,
            "single_parts": (root / "single" / "web",),
            "meta_parts": (root / "meta" / "web", root / "meta" / "code")}


def _draw(rng: random.Random) -> dict:
    mode = rng.choice(["sample", "batch"])
    pool = rng.choice([0, rng.randint(1, 16), rng.randint(1, 512)])
    if mode == "batch":
        pool = max(BATCH, pool // BATCH * BATCH) if pool else 0
    packing = rng.random() < 0.5
    pack_placement = rng.choice(["packs", "samples"])
    placement = rng.choice(["post-encode", "pre-encode"])
    if packing and pack_placement == "packs":
        placement = "post-encode"  # a pool of packs sits after packing, never before encoding
    return dict(
        num_workers=rng.randint(0, 3),
        pool=pool,
        mode=mode,
        placement=placement,
        schedule=rng.random() < 0.5,
        warmup=rng.random() < 0.5,
        repeat=rng.random() < 0.5,
        shuffle=rng.choice([None, 8]),
        steps=rng.randint(8, 28),
        packing=packing,
        pack_buffer=rng.choice([8, 16]),
        pack_target=rng.choice([1024, 2048, 4096]),
        pack_placement=pack_placement,
        packer=rng.choice(["default", "user"]),
        # Energon's worker checkpoints: its default (at the start, then every 60 s, so restores
        # mostly start from the first) or every n samples (mid-stream, as a long run's)
        checkpoint_every=rng.choice([None, 1, 2, 5]),
    )


def _config(d: dict) -> OrderingConfig:
    packing = d["packing"]
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
        packing_buffer_size=d["pack_buffer"] if packing else None,
        pack_seq_length=d["pack_target"] if packing else None,
        pack_pool_placement=d["pack_placement"],
    )


def _maker(data: dict, d: dict):
    path = data["meta"] if d["schedule"] else data["single"]
    cfg = _config(d)
    factory = UserPackerTE if d["packing"] and d["packer"] == "user" else None
    every = d["checkpoint_every"]
    checkpoints = {} if every is None else dict(checkpoint_every_sec=0,
                                                checkpoint_every_min_n_samples=every)
    return lambda: build_train_loader(
        path, ordering=cfg, num_workers=d["num_workers"], batch_size=BATCH,
        shuffle_buffer_size=d["shuffle"], max_samples_per_sequence=16, repeat=d["repeat"],
        task_encoder_factory=factory, **checkpoints,
    )


@functools.lru_cache(maxsize=None)
def _uncut_lengths(paths: tuple) -> dict[str, int]:
    """Every document's key and uncut length: one finite epoch of each prepared dataset with
    every stage off."""
    out: dict[str, int] = {}
    for path in paths:
        loader = build_train_loader(path, ordering=OrderingConfig(), batch_size=BATCH,
                                    shuffle_buffer_size=None, repeat=False)
        for batch in loader:
            rec = record_batch(batch)
            out.update(zip(rec.keys, rec.lengths))
        close_loader(loader)
    return out


def _check_finite_epoch(data: dict, d: dict, records, final_state: bytes) -> str | None:
    """Every document exactly once, tokens conserved; None if so, else what is wrong."""
    uncut = _uncut_lengths(data["meta_parts"] if d["schedule"] else data["single_parts"])
    keys = [k for r in records for k in r.keys]
    if sorted(keys) != sorted(uncut):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        lost = sorted(set(uncut) - set(keys))
        return f"documents: {len(keys)} emitted of {len(uncut)}, twice {dup[:5]}, lost {lost[:5]}"
    grown = [(k, n, uncut[k]) for r in records for k, n in zip(r.keys, r.lengths) if n > uncut[k]]
    if grown:
        return f"documents longer than they are: {grown[:5]}"
    if d["num_workers"] == 0:
        # The cut counters of a state are exact only in-process: a loader worker's state is its
        # last checkpoint plus samples to replay, so its counters lag behind.
        emitted = sum(n for r in records for n in r.lengths)
        cut = warmup_counts(pickle.loads(final_state)).get("truncated_tokens", 0)
        if emitted + cut != sum(uncut.values()):
            return f"tokens: {emitted} emitted + {cut} cut != {sum(uncut.values())} in the documents"
    return None


@pytest.mark.timeout(900)  # 10 cycles, each building up to 7 real loaders
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_soak_random_cut_and_resume(soak_data, chunk, tmp_path):
    seed = SEED * 1000 + chunk
    print(f"soak seed: SOAK_SEED={SEED} (chunk {chunk}: random.Random({seed}))")
    rng = random.Random(seed)
    cycles = CYCLES // CHUNKS + (1 if chunk < CYCLES % CHUNKS else 0)
    done, mismatches = 0, []
    while done < cycles and not out_of_time(done):
        d = _draw(rng)
        steps = d["steps"] if d["repeat"] else None
        try:
            records, states = run_saving_every_step(_maker(soak_data, d), steps)
        except OrderingConfigError as e:
            # A pool larger than a worker's share of repeating data is refused at build time;
            # the cycle goes on with a pool that fits.
            assert d["repeat"] and "larger than a loader worker's share" in str(e), (d, e)
            d["pool"] = BATCH * rng.randint(1, 2)
            records, states = run_saving_every_step(_maker(soak_data, d), steps)
        if not d["repeat"]:
            whole = _check_finite_epoch(soak_data, d, records, states[-1])
            if whole is not None:
                mismatches.append((d, "whole epoch", whole))
        make = _maker(soak_data, d)
        for _ in range(min(CUTS_PER_RUN, cycles - done)):
            cut = rng.randint(0, len(states) - 1)
            if not d["repeat"] and rng.random() < 0.5:  # half of the finite cuts near the end
                cut = rng.randint(max(0, len(states) - 3), len(states) - 1)
            expected = records[cut : cut + COMPARE]
            # A finite epoch's remainder is read one past its end: it must end there.
            to_end = not d["repeat"] and len(records) - cut <= COMPARE
            loader = make()
            restore_state_rank(loader, pickle.loads(states[cut]))
            got = [record_batch(b) for b in
                   itertools.islice(loader, len(expected) + (1 if to_end else 0))]
            close_loader(loader)
            if got != expected:
                mismatches.append(_mismatch(d, cut, records, states[cut], got, tmp_path))
            done += 1
    report("resume soak", chunk, done, cycles, SEED)
    assert not mismatches, f"SOAK_SEED={SEED} chunk {chunk}: mismatches {mismatches}"


def _mismatch(d: dict, cut: int, records: list, state: bytes, got: list, out) -> dict:
    """What a failed resume got wrong, with the case pickled for a reproduction (the saved
    state, the uninterrupted records, the resumed ones)."""
    expected = records[cut : cut + COMPARE]
    at = next((i for i, (e, g) in enumerate(zip(expected, got)) if e != g), min(len(expected), len(got)))
    entries = [(getattr(ws, "offset", None), getattr(getattr(ws, "state", None), "sample_index", None))
               for ws in pickle.loads(state).worker_states]
    case = out / f"mismatch_cut{cut}.pkl"
    case.write_bytes(pickle.dumps({"config": d, "cut": cut, "records": records, "state": state,
                                   "got": got}))
    return {"config": d, "cut": cut, "records": len(records),
            "worker entries (offset, checkpoint sample index)": entries,
            "first difference": at, "expected": expected[at:at + 1], "got": got[at:at + 1],
            "case": str(case)}
