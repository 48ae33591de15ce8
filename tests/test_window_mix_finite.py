"""``planned_mix = "window"`` over finite data (``repeat=False``) on real pipelines.

The epoch ends where :func:`~energon_ordering.planned.epoch_end.window_mix_end_step` puts it
(its last window shorter), on every rank at the same step; each sample is drawn at most once
per epoch, none is deferred past its end (the warmup is on, so some samples fit no step's cap:
they are placed and cut, as under the step mix); every cut resumes exactly, the last micro-batch
and after it included; an elastic resume draws the rest of the epoch once; the next epoch draws
every source anew. Compared by what the model sees (keys and tokens after the warmup's cut).
"""

from __future__ import annotations

import itertools
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from energon_ordering import restore_state_rank
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    record_batch,
    run_saving_every_step,
)
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.planned.epoch_end import window_mix_end_step
from energon_ordering.warmup.schedule import SeqLenWarmup

sys.path.insert(0, str(Path(__file__).parent))
from test_elastic_exact import B, K, WARMUP, _config, _seen, data  # noqa: E402,F401  (fixture)

SIZES, WEIGHTS = (300, 160), (0.7, 0.3)  # test_elastic_exact's sources


def _loader(data, world_size, mbps, rank, num_workers=0):
    return build_train_loader(data, ordering=_config(mbps, planned_mix="window"), rank=rank,
                              world_size=world_size, num_workers=num_workers, batch_size=B,
                              repeat=False, task_encoder_factory=IndexedSyntheticTaskEncoder)


def _epoch(data, world_size, mbps, num_workers=0):
    """Every rank's records of one finite epoch."""
    out = []
    for rank in range(world_size):
        loader = _loader(data, world_size, mbps, rank, num_workers)
        out.append([record_batch(b) for b in loader])
        close_loader(loader)
    return out


def _end(world_size, mbps) -> int:
    w = np.asarray(WEIGHTS) / sum(WEIGHTS)
    return window_mix_end_step(SIZES, lambda first, n: np.tile(w, (n, 1)),
                               lambda step: world_size * mbps * B, K)


def test_the_epoch_ends_with_a_shorter_window_on_every_rank_and_draws_each_sample_once(data):
    records = _epoch(data, 3, 2)
    end = _end(3, 2)
    assert end % K  # the last window is shorter than plan_window_steps
    assert [len(r) for r in records] == [end * 2] * 3
    keys = [k for rank in records for b in rank for k in b.keys]
    assert len(keys) == len(set(keys)) == end * 3 * 2 * B
    web = sum(k.startswith("web") for k in keys)
    assert abs(web - WEIGHTS[0] * len(keys)) < 1 + 1e-9  # the epoch's windows hold the blend
    # the warmup holds per step: every sample of its steps within the step's cap
    warmup = SeqLenWarmup(**WARMUP)
    for rank in records:
        for b, rec in enumerate(rank[:warmup.warmup_steps * 2]):
            assert max(rec.lengths) <= warmup.max_seq_len(b // 2), b
    assert records == _epoch(data, 3, 2)  # the same on every build


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_every_cut_of_the_epoch_resumes_exactly_to_nothing_after_its_last_step(data,
                                                                               num_workers):
    def make():
        return _loader(data, 3, 2, 2, num_workers)

    records, states = run_saving_every_step(make)
    n = len(records)
    assert n == _end(3, 2) * 2 and len(states) == n + 1
    for cut in (0, 5, K * 2, n - 2, n - 1, n):  # a window's start, the last micro-batch, after
        loader = make()
        restore_state_rank(loader, pickle.loads(states[cut]))
        assert [record_batch(b) for b in loader] == records[cut:], cut
        close_loader(loader)


def test_an_elastic_resume_draws_the_rest_of_the_epoch_once_in_the_same_steps(data):
    """3 ranks x 2 saved at step 5 (inside window 1 and the warmup), resumed from rank 0's file
    on 2 ranks x 3: every later step holds the uninterrupted run's samples, cut alike, and the
    epoch ends at the same step; a state saved mid-step after that restore resumes exactly."""
    whole = _epoch(data, 3, 2)
    at = 5
    loader = _loader(data, 3, 2, 0)
    it = iter(loader)
    for _ in range(at * 2):
        next(it)
    state = pickle.loads(pickle.dumps(loader.save_state_rank()))
    del it
    close_loader(loader)
    rest, again = [], None
    for rank in range(2):
        loader = _loader(data, 2, 3, rank)
        restore_state_rank(loader, state)
        recs, it = [], iter(loader)
        for b in itertools.count():
            if rank == 0 and b == 4:  # mid-step, after the elastic restore
                again = pickle.loads(pickle.dumps(loader.save_state_rank()))
            try:
                recs.append(record_batch(next(it)))
            except StopIteration:
                break
        rest.append(recs)
        del it
        close_loader(loader)
    assert _seen(rest, 3) == _seen(whole, 2)[at:]
    # the resume of the resume: rank 0's state saved after the elastic restore continues exactly
    loader = _loader(data, 2, 3, 0)
    restore_state_rank(loader, again)
    assert [record_batch(b) for b in loader] == rest[0][4:]
    close_loader(loader)


def test_the_next_epoch_draws_every_source_anew(data):
    loader = _loader(data, 1, 2, 0)
    epochs = [[k for b in loader for k in record_batch(b).keys] for _ in range(2)]
    close_loader(loader)
    assert len(epochs[0]) == len(epochs[1]) == _end(1, 2) * 2 * B
    assert all(len(set(e)) == len(e) for e in epochs)
    assert epochs[0] != epochs[1]  # another permutation of each source
