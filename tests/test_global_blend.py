"""The deterministic blend across data-parallel ranks: exact per optimizer step, exact on resume.

Real pipelines (one ``get_train_dataset`` + ``get_savable_loader`` per rank, ``WorkerConfig(rank=r,
world_size=8)``) over a two-source metadataset. Only public names are imported, so the 8-rank
test also runs against an older checkout of the package (it fails there: every rank drew the
same per-rank sequence).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from energon_ordering import OrderingConfig, StateMismatchError
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    record_batch,
    resume,
    run_ranks,
    run_saving_every_step,
    run_with_cuts,
)
from energon_ordering.inspect.synthetic import make_synthetic_dataset

R, B, M = 8, 4, 4  # 8 ranks, micro-batch 4, 4 micro-batches per step: G = 128 draws per step
CONSTANT = {"sources": {"a": {"weight": 0.7}, "b": {"weight": 0.3}}}
# A phase switch at step 6 and a ramp from step 12: the carry crosses both.
PHASED = {"phases": [
    {"until": 6, "weights": {"a": 0.7, "b": 0.3}},
    {"until": 12, "weights": {"a": 0.25, "b": 0.75}},
    {"until": 40, "ramp_steps": 9, "weights": {"a": 0.9, "b": 0.1}},
]}


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A metadataset over a (800 samples) and b (800 samples)."""
    return make_synthetic_dataset(tmp_path_factory.mktemp("two"), {"a": 800, "b": 800},
                                  shard_size=50)


def _cfg(schedule: dict, policy: str = "deterministic", **kw: Any) -> OrderingConfig:
    return OrderingConfig(mixture_schedule=schedule, blend_policy=policy,
                          micro_batches_per_step=M, **kw)


def _per_step(records, source: str) -> np.ndarray:
    """Samples of ``source`` per optimizer step, summed over ranks and micro-batches."""
    counts = np.array([[sum(s == source for s in batch.sources) for batch in rank]
                       for rank in records])
    steps = counts.shape[1] // M
    return counts[:, :steps * M].sum(axis=0).reshape(steps, M).sum(axis=1)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_step_on_eight_ranks_is_within_two_samples(two_sources, num_workers):
    steps = 30
    records = run_ranks(two_sources, ordering=_cfg(CONSTANT), world_size=R, steps=steps * M,
                        num_workers=num_workers, batch_size=B)
    a = _per_step(records, "a")
    dev = a - 0.7 * R * M * B  # 89.6 of 128 per step; b's deviation is the negative
    assert len(a) == steps
    # The guarantee is 2; the construction gives 1 (each step's count is floor or ceil).
    assert np.abs(dev).max() <= 1.0 + 1e-9, dev


@pytest.mark.slow
def test_eight_ranks_follow_a_phase_switch_and_a_ramp_per_step(two_sources):
    from energon_ordering.mixture.schedule import MixtureSchedule

    steps = 24
    records = run_ranks(two_sources, ordering=_cfg(PHASED), world_size=R, steps=steps * M,
                        batch_size=B)
    target = MixtureSchedule.from_dict(PHASED).weights_table(np.arange(steps))[:, 0] * R * M * B
    a = _per_step(records, "a")
    assert np.abs(a - target).max() <= 1.0 + 1e-9
    assert np.abs(np.cumsum(a - target)).max() < 1.0  # the carry: cumulative within one


# Five sources, uneven: the ideal-position merge breaks quota in every step, so every step is
# laid out earliest deadline first.
FIVE = {"sources": {n: {"weight": w} for n, w in
                    zip("abcde", (0.63, 0.04, 0.09, 0.12, 0.12))}}


@pytest.fixture(scope="module")
def five_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A metadataset over five sources of 300 samples each."""
    return make_synthetic_dataset(tmp_path_factory.mktemp("five"),
                                  {n: 300 for n in "abcde"}, shard_size=50)


def test_five_sources_take_the_earliest_deadline_first_layout():
    from energon_ordering.mixture.schedule import MixtureSchedule
    from energon_ordering.mixture.step_counts import StepLayout

    weights = MixtureSchedule.from_dict(FIVE).weights_table([0])[0]
    layout = StepLayout.of_step(weights, R * M * B, [0.0] * 5)
    assert not layout._keeps_quota(layout._ideal_position_merge())
    assert layout._keeps_quota(layout.order)


@pytest.mark.slow
def test_every_window_of_five_sources_on_eight_ranks_is_within_two_samples(five_sources):
    steps = 10
    records = run_ranks(five_sources, ordering=_cfg(FIVE), world_size=R, steps=steps * M,
                        batch_size=B)
    names = "abcde"
    # the global draw sequence: micro-batch b of every rank in rank order is draws [bRB, (b+1)RB)
    seq = [names.index(s) for b in range(steps * M) for rank in records
           for s in rank[b].sources]
    assert len(seq) == steps * R * M * B
    w = np.array([0.63, 0.04, 0.09, 0.12, 0.12])
    dev = np.vstack([np.zeros(5), np.cumsum(np.eye(5)[seq] - w, axis=0)])
    assert np.abs(dev).max() < 1.0  # every prefix within one sample
    assert (dev.max(axis=0) - dev.min(axis=0)).max() <= 2.0  # so every window within 2


def test_exact_resume_of_one_rank_of_eight_with_five_sources(five_sources):
    def make():
        return build_train_loader(five_sources, ordering=_cfg(FIVE), rank=3, world_size=R,
                                  batch_size=B)

    _cut_and_resume(make, 24, cuts=(0, 5, 8, 13))


def _cut_and_resume(make, total, cuts):
    full, states = run_with_cuts(make, total, cuts)
    for cut, state in states.items():
        resumed = resume(make, state, total - cut)
        for i, (x, y) in enumerate(zip(full[cut:], resumed)):
            assert x == y, f"cut {cut}: first mismatch at micro-batch {cut + i}"
    return full


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_of_one_rank_of_eight_across_a_switch_and_a_ramp(two_sources, num_workers):
    def make():
        return build_train_loader(two_sources, ordering=_cfg(PHASED), rank=3, world_size=R,
                                  num_workers=num_workers, batch_size=B)

    # switch at step 6 = micro-batch 24, ramp from micro-batch 48; cuts mid-step and on both
    _cut_and_resume(make, 60, cuts=(0, 7, 24, 26, 49))


def test_exact_resume_after_a_source_runs_out(two_sources):
    # One finite epoch: a (0.7) runs out first, then the blend draws b by the per-rank rule.
    def make():
        return build_train_loader(two_sources, ordering=_cfg(CONSTANT), rank=1, world_size=2,
                                  batch_size=B, repeat=False, shuffle_buffer_size=None)

    records, states = run_saving_every_step(make)
    keys = [k for r in records for k in r.keys]
    assert len(keys) == len(set(keys)) == 800  # rank 1's half of both sources, each once
    a_last = max(i for i, r in enumerate(records) if "a" in r.sources)
    for cut in (0, a_last - 1, a_last, a_last + 1, len(records) - 3):
        loader = make()
        from energon_ordering.state_stamp import restore_state_rank

        restore_state_rank(loader, pickle.loads(states[cut]))
        rest = [record_batch(b) for b in loader]
        close_loader(loader)
        assert rest == records[cut:], f"cut {cut}"


def _blend_state(state: Any) -> dict:
    """The ScheduledBlendDataset's saved dict inside a rank's loader state (worker 0)."""
    todo = [state.worker_states[0]]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if node.get("__class__") == "ScheduledBlendDataset":
                return node
            todo.extend(node.values())
        elif isinstance(node, (list, tuple)):
            todo.extend(node)
    raise AssertionError("no ScheduledBlendDataset in the state")


def _as_version_1(state: Any) -> Any:
    """The state as blend state version 1 wrote it (no draw counter, carry or batch size)."""
    state = pickle.loads(pickle.dumps(state))
    blend = _blend_state(state)
    for field in ("_draws", "_carry_step", "_carry"):
        del blend[field]
    blend["_stamp"] = {k: v for k, v in blend["_stamp"].items() if k != "batch_size"}
    blend["_stamp"]["state_version"] = 1
    return state


def test_a_version_1_deterministic_state_is_refused_naming_the_per_rank_sequence(two_sources):
    def make():
        return build_train_loader(two_sources, ordering=_cfg(CONSTANT), batch_size=B)

    _, states = run_with_cuts(make, 4, [3])
    old = _as_version_1(states[3])
    with pytest.raises(StateMismatchError,
                       match=r"blend state version 1.*per-rank sequence.*version 3 lays each "
                             r"step of global draws out in a quota-keeping order.*start the data "
                             r"stream afresh"):
        resume(make, old, 1)


def test_a_version_1_random_state_continues_exactly(two_sources):
    def make():
        return build_train_loader(two_sources, ordering=_cfg(CONSTANT, "random"), batch_size=B)

    full, states = run_with_cuts(make, 20, [9])
    assert resume(make, _as_version_1(states[9]), 11) == full[9:]


def _as_version_2(state: Any) -> Any:
    """The state as blend state version 2 wrote it (same fields, another layout per step)."""
    state = pickle.loads(pickle.dumps(state))
    _blend_state(state)["_stamp"]["state_version"] = 2
    return state


def test_a_version_2_deterministic_state_is_refused_naming_the_old_layout(two_sources):
    def make():
        return build_train_loader(two_sources, ordering=_cfg(CONSTANT), batch_size=B)

    _, states = run_with_cuts(make, 4, [3])
    with pytest.raises(StateMismatchError,
                       match=r"blend state version 2 \(policy 'deterministic'\).*merged by ideal "
                             r"position.*version 3 lays each step.*start the data stream afresh"):
        resume(make, _as_version_2(states[3]), 1)


def test_a_version_2_random_state_continues_exactly(two_sources):
    def make():
        return build_train_loader(two_sources, ordering=_cfg(CONSTANT, "random"), batch_size=B)

    full, states = run_with_cuts(make, 20, [9])
    assert resume(make, _as_version_2(states[9]), 11) == full[9:]


def test_a_version_2_deterministic_state_under_the_per_rank_rule_continues_exactly(two_sources):
    # A pool behind the blend switched it to the per-rank rule, which version 3 did not change.
    cfg = _cfg(CONSTANT, length_sort_pool_size=32, length_sort_mode="batch")

    def make():
        return build_train_loader(two_sources, ordering=cfg, rank=2, world_size=R, batch_size=B)

    full, states = run_with_cuts(make, 20, [9])
    assert _blend_state(states[9])["_per_rank"] is True
    assert resume(make, _as_version_2(states[9]), 11) == full[9:]


@pytest.mark.slow  # loader worker processes (the slow tier's rule, tests/conftest.py)
def test_the_micro_batch_size_is_stamped(two_sources):
    # With loader workers Energon lets the micro-batch size change (without, it asserts); the
    # blend's layout depends on it, so its stamp refuses.
    def make(batch_size):
        return lambda: build_train_loader(two_sources, ordering=_cfg(CONSTANT), num_workers=1,
                                          batch_size=batch_size)

    _, states = run_with_cuts(make(B), 3, [2])
    with pytest.raises(StateMismatchError, match=r"batch_size: saved 4 != configured 2"):
        resume(make(2), states[2], 1)


def test_with_a_pool_each_rank_keeps_the_per_rank_bound(two_sources):
    # A pool between blend and batch breaks the draw -> micro-batch map; the blend notices and
    # draws by the per-rank rule. Each batch-mode pool of 32 emits exactly its own 32 draws
    # over 8 micro-batches, so every pool holds b within 2 samples of 0.1 x 32 = 3.2.
    cfg = OrderingConfig(mixture_schedule={"sources": {"a": {"weight": 0.9}, "b": {"weight": 0.1}}},
                         blend_policy="deterministic", length_sort_pool_size=32,
                         length_sort_mode="batch")
    loader = build_train_loader(two_sources, ordering=cfg, rank=2, world_size=R, batch_size=B)
    it = iter(loader)
    records = [record_batch(next(it)) for _ in range(48)]
    del it
    close_loader(loader)
    b = np.array([sum(s == "b" for s in r.sources) for r in records]).reshape(6, 8).sum(axis=1)
    assert np.abs(b - 3.2).max() < 2.0, b
