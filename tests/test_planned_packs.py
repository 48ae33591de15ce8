"""``length_sort_mode: planned`` with sequence packing on real pipelines (issue 23): every rank
reads the plan's packs, each within its step's cap; exact resume at every cut with loader
workers 0-3; a finite epoch draws every sample at most once and ends on the same step everywhere;
an elastic resume is refused by name.

Real prepared datasets with length indexes, real ``get_train_dataset(packing_buffer_size=...)``
+ ``get_savable_loader`` per simulated rank; the expected packs come from
:func:`energon_ordering.planned.packs.plan_packed_window`.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from energon_ordering import OrderingConfig
from energon_ordering.errors import OrderingConfigError, StateMismatchError
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    planned_window_steps,
    record_batch,
    run_ranks,
    run_saving_every_step,
    run_with_cuts,
)
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.packs import plan_packed_window
from energon_ordering.state_stamp import restore_state_rank
from energon_ordering.warmup.pack_cap import pack_target
from energon_ordering.warmup.schedule import SeqLenWarmup

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402
from test_planned_source import _readers  # noqa: E402

B, M, K, CAP = 1, 2, 2, 1024


def packed(**kw) -> OrderingConfig:
    return OrderingConfig(**{**dict(
        length_sort_mode="planned", length_sort_placement="pre-encode",
        length_sort_pool_holds="keys", micro_batches_per_step=M, seed=5, plan_window_steps=K,
        pack_seq_length=CAP, planned_mix="step"), **kw})


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return indexed_synthetic(
        tmp_path_factory.mktemp("planned_packs"),
        [SourceSpec("web", 160, "short", weight=0.7), SourceSpec("code", 96, "long", weight=0.3)],
        shard_size=32)


def _loader(data, *, rank=0, world_size=2, num_workers=0, repeat=True, **cfg):
    return build_train_loader(data, ordering=packed(**cfg), rank=rank, world_size=world_size,
                              num_workers=num_workers, batch_size=B, repeat=repeat,
                              packing_buffer_size=32,
                              task_encoder_factory=IndexedSyntheticTaskEncoder)


def expected_packs(data, world_size, micro_batches, warmup=None, K=K, mix="step"):
    """``packs[rank][b]``: the keys of each pack of rank's micro-batch b, from the pure plan."""
    readers = _readers(data)
    lengths = [np.array([r.visit(i)[2] for i in range(len(r))]) for r in readers]
    offsets = np.concatenate(([0], np.cumsum([len(x) for x in lengths])))
    cursor = PlanCursor.start(2)
    out = [[] for _ in range(world_size)]
    w = np.array([0.7, 0.3])
    while len(out[0]) < micro_batches:
        first = cursor.window * K
        plan = plan_packed_window(
            lengths, seed=5, cursor=cursor, weights=np.tile(w, (K, 1)),
            caps=[pack_target(first + t, CAP, warmup) for t in range(K)],
            world_size=world_size, micro_batch=B, micro_batches_per_step=M, mix=mix)
        for t in range(K):
            for r in range(world_size):
                ids, bounds = plan.rank_step(t, r)
                for m in range(M):
                    mb = []
                    for p in range(m * B, (m + 1) * B):
                        keys = []
                        for gid in ids[bounds[p]:bounds[p + 1]]:
                            s = int(np.searchsorted(offsets, gid, side="right") - 1)
                            keys.append(readers[s].key(int(gid - offsets[s])))
                        mb.append(tuple(keys))
                    out[r].append(tuple(mb))
        cursor = plan.next_cursor
    return [rank[:micro_batches] for rank in out]


def _packs_of(record):
    """A record's keys regrouped into its packs."""
    out, at = [], 0
    for pack in record.pack_lengths:
        out.append(tuple(record.keys[at:at + len(pack)]))
        at += len(pack)
    return tuple(out)


def test_every_rank_reads_the_plans_packs_within_the_cap(data):
    steps = 8  # 4 optimizer steps: windows 0 and 1
    records = run_ranks(data, ordering=packed(), world_size=2, steps=steps, batch_size=B,
                        packing_buffer_size=32, task_encoder_factory=IndexedSyntheticTaskEncoder)
    want = expected_packs(data, 2, steps)
    for rank in range(2):
        assert [_packs_of(r) for r in records[rank]] == want[rank]
        for r in records[rank]:
            assert all(sum(p) <= CAP for p in r.pack_lengths)
    assert any(len(p) > 1 for r in records[0] for p in r.pack_lengths)  # packs hold several


def test_short_samples_shrink_the_default_packed_window_and_it_is_stamped(data, monkeypatch):
    """A packed plan's default window holds at most WINDOW_MIX_PACKED_SAMPLES samples, read off
    the length index (its planning holds about 53 bytes a sample): here a budget of 2^7
    samples, so 2 ranks x 2 packs a step take 128 / (samples a pack) // 4 steps, fewer than
    the steps in which no source is drawn beyond its size (which bound it on this small data).
    The loader plans that window, stamps it, resumes in it and refuses a state of another."""
    from energon_ordering.pipeline.plan import BuildArgs, Source, packed_window_steps
    from energon_ordering.planned import window_size
    from test_stamp_fields import _saved_stamp

    cfg = dict(plan_window_steps=None, planned_mix="window")
    def make():
        return _loader(data, **cfg)

    readers = _readers(data)
    lengths = [np.array([r.visit(i)[2] for i in range(len(r))]) for r in readers]
    spp = window_size.packed_samples_per_pack(lengths, [[0.7, 0.3]], CAP)
    # on this small repeating data the window first holds one epoch of its sources at most
    epoch = window_size.steps_within_an_epoch([len(x) for x in lengths], [[0.7, 0.3]], 4 * spp)
    roomy = run_with_cuts(make, 2, [1])[1][1]
    assert _saved_stamp(roomy)["plan_window_steps"] == epoch < 4096  # not 2^17 packs / 4
    monkeypatch.setattr(window_size, "WINDOW_MIX_PACKED_SAMPLES", 1 << 7)
    args = BuildArgs(batch_size=B, world_size=2, packing_buffer_size=32,
                     sources=(Source(name="web", weight=0.7), Source(name="code", weight=0.3)))
    k = packed_window_steps(packed(**cfg), args, lengths)
    assert k == int(128 / spp) // 4 and 2 <= k < epoch
    # what inspect and check-resume report: the build's own
    assert planned_window_steps(data, packed(**cfg), world_size=2, batch_size=B,
                                packing_buffer_size=32,
                                task_encoder_factory=IndexedSyntheticTaskEncoder) == k
    steps = 6
    records = run_ranks(data, ordering=packed(**cfg), world_size=2, steps=steps, batch_size=B,
                        packing_buffer_size=32, task_encoder_factory=IndexedSyntheticTaskEncoder)
    want = expected_packs(data, 2, steps, K=k, mix="window")
    for rank in range(2):
        assert [_packs_of(r) for r in records[rank]] == want[rank]
    got, states = run_with_cuts(make, steps, [3])
    assert got == records[0]
    state = states[3]
    assert _saved_stamp(state)["plan_window_steps"] == k
    loader = make()
    restore_state_rank(loader, state)
    it = iter(loader)
    assert [record_batch(next(it)) for _ in range(steps - 3)] == records[0][3:]
    del it
    close_loader(loader)
    monkeypatch.undo()  # the packs' default again: the saved window is not this one
    loader = make()
    with pytest.raises(StateMismatchError, match="plan_window_steps"):
        restore_state_rank(loader, state)
    close_loader(loader)


def test_packs_follow_the_warmup_cap_of_their_step(data):
    warm = {"start": 256, "full": CAP, "warmup_steps": 4}
    steps = 10
    records = run_ranks(data, ordering=packed(seq_length_warmup=warm), world_size=2,
                        steps=steps, batch_size=B, packing_buffer_size=32,
                        task_encoder_factory=IndexedSyntheticTaskEncoder)
    warmup = SeqLenWarmup.from_dict(warm)
    want = expected_packs(data, 2, steps, warmup)
    caps = []
    for rank in range(2):
        assert [_packs_of(r) for r in records[rank]] == want[rank]
        for b, r in enumerate(records[rank]):
            cap = pack_target(b // M, CAP, warmup)
            caps.append(cap)
            assert all(sum(p) <= cap for p in r.pack_lengths), (b, cap, r.pack_lengths)
    assert min(caps) < CAP  # the warmup ran


@pytest.mark.parametrize("num_workers", [0, 1, pytest.param(2, marks=pytest.mark.slow),
                                         pytest.param(3, marks=pytest.mark.slow)])
def test_exact_resume_at_every_cut(data, num_workers):
    def make():
        return _loader(data, rank=1, num_workers=num_workers)

    total = 10
    cuts = range(total + 1)  # every cut, the last micro-batch and after it
    records, states = run_with_cuts(make, total + 3, cuts)
    for cut in cuts:
        loader = make()
        restore_state_rank(loader, states[cut])
        it = iter(loader)
        got = [record_batch(next(it)) for _ in range(total + 3 - cut)]
        del it
        close_loader(loader)
        assert got == records[cut:], cut


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_finite_epoch_draws_every_sample_once_and_resumes_exactly(data, num_workers):
    runs = []
    for rank in range(2):
        runs.append(run_saving_every_step(
            lambda rank=rank: _loader(data, rank=rank, repeat=False, num_workers=num_workers)))
    records = [r for r, _ in runs]
    assert len(records[0]) == len(records[1]) > 0 and len(records[0]) % M == 0
    keys = [k for rank in records for r in rank for k in r.keys]
    assert len(keys) == len(set(keys))  # no sample twice in the epoch
    assert len(keys) > 0.8 * 256  # and most of it drawn
    rec, states = runs[1]
    for cut in (0, 3, len(rec) - 1, len(rec)):  # the last: after the last step
        loader = _loader(data, rank=1, repeat=False, num_workers=num_workers)
        restore_state_rank(loader, pickle.loads(states[cut]))
        assert [record_batch(b) for b in loader] == rec[cut:], cut
        close_loader(loader)


def _finite_run(data, world_size, start_state=None, cut_step=None, **cfg):
    """Every rank's records of a finite epoch (from ``start_state`` if given), and each rank's
    state at optimizer step ``cut_step``."""
    records, states = [], []
    for rank in range(world_size):
        loader = _loader(data, rank=rank, world_size=world_size, repeat=False, **cfg)
        if start_state is not None:
            restore_state_rank(loader, start_state)
        got, state = [], None
        it = iter(loader) if start_state is not None else None
        b = 0
        while True:
            if cut_step is not None and b == cut_step * cfg.get("micro_batches_per_step", M):
                state = pickle.loads(pickle.dumps(loader.save_state_rank()))
            if it is None:
                it = iter(loader)
            try:
                got.append(record_batch(next(it)))
            except StopIteration:
                break
            b += 1
        del it
        close_loader(loader)
        records.append(got)
        states.append(state)
    return records, states


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_an_elastic_resume_draws_every_sample_of_a_finite_epoch_once(data, before, after):
    """2 ranks -> 1 (and back) inside a plan window, the same global batch of packs: the
    remaining steps' packs are dealt to the new ranks; nothing is lost or drawn twice."""
    cut = 3  # optimizer step 3: inside window 1 (K = 2)
    full, _ = _finite_run(data, before, micro_batches_per_step=M * 2 // before)
    first, states = _finite_run(data, before, cut_step=cut, micro_batches_per_step=M * 2 // before)
    rest, _ = _finite_run(data, after, start_state=states[0],
                          micro_batches_per_step=M * 2 // after)
    mb_before, mb_after = M * 2 // before, M * 2 // after
    seen = [k for rank in first for r in rank[:cut * mb_before] for k in r.keys]
    seen += [k for rank in rest for r in rank for k in r.keys]
    every = [k for rank in full for r in rank for k in r.keys]
    assert sorted(seen) == sorted(every)
    assert len(set(seen)) == len(seen)
    # every resumed step holds the packs the uninterrupted run had at that step
    for s in range(len(rest[0]) // mb_after):
        got = {p for rank in rest for r in rank[s * mb_after:(s + 1) * mb_after]
               for p in _packs_of(r)}
        want = {p for rank in full for r in rank[(cut + s) * mb_before:(cut + s + 1) * mb_before]
                for p in _packs_of(r)}
        assert got == want, s


def test_the_global_batch_changes_at_a_window_boundary_with_packing(data):
    cut = 2  # window 1 starts
    first, states = _finite_run(data, 2, cut_step=cut, allow_global_batch_change=True)
    rest, _ = _finite_run(data, 1, start_state=states[0], allow_global_batch_change=True)
    seen = [k for rank in first for r in rank[:cut * M] for k in r.keys]
    seen += [k for r in rest[0] for k in r.keys]
    assert len(set(seen)) == len(seen) > 0.8 * 256
    with pytest.raises(StateMismatchError, match="allow_global_batch_change"):
        _finite_run(data, 1, start_state=states[0])


@pytest.mark.timeout(120)
def test_the_next_finite_epoch_draws_every_source_anew(data):
    """An epoch shorter than one plan window: the next epoch plans its own window 0 (it came
    out as a replay of the first, from the plan kept of it), and its last steps, where the
    sources run low, have no empty pack (the source would never move past one)."""
    loader = _loader(data, repeat=False, plan_window_steps=64)
    epochs = [[k for b in loader for k in record_batch(b).keys] for _ in range(2)]
    close_loader(loader)
    assert len(epochs[0]) > 0 and len(epochs[1]) > 0
    assert len(set(epochs[1])) == len(epochs[1])
    assert epochs[0] != epochs[1]  # another permutation of each source


def test_packing_without_a_cap_is_refused(data):
    with pytest.raises(OrderingConfigError, match="pack_seq_length"):
        _loader(data, pack_seq_length=None)


def test_a_packed_step_over_the_budget_is_warned_about_once_at_build(data, caplog,
                                                                    monkeypatch):
    """Where one step alone holds more samples than a packed window's budget (here a budget of
    8 samples against 2 ranks x 2 packs of several samples), the build warns once, naming the
    peak and the fix; within it, nothing is said."""
    from energon_ordering.planned import window_size

    with caplog.at_level("WARNING"):
        close_loader(_loader(data, plan_window_steps=None, planned_mix="window"))
    assert not any("planned at once" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(window_size, "WINDOW_MIX_PACKED_SAMPLES", 8)
    with caplog.at_level("WARNING"):
        close_loader(_loader(data, plan_window_steps=None, planned_mix="window"))
    notes = [r.getMessage() for r in caplog.records if "planned at once" in r.getMessage()]
    assert len(notes) == 1 and "one optimizer step of 4 packs" in notes[0], notes


def test_a_pack_over_its_cap_is_counted_and_warned_about(data, caplog):
    """An encoder that measures samples longer than the length index: the packs go out as
    planned (every rank's plan is the same), counted and warned about once."""

    class Longer(IndexedSyntheticTaskEncoder):
        def ordering_sample_length(self, sample):
            return 4 * super().ordering_sample_length(sample)

    loader = build_train_loader(data, ordering=packed(), world_size=2, batch_size=B,
                                packing_buffer_size=32, task_encoder_factory=Longer)
    with caplog.at_level("WARNING"):
        it = iter(loader)
        for _ in range(4):
            next(it)
    assert sum("over its cap" in r.getMessage() for r in caplog.records) == 1
    del it
    close_loader(loader)


def test_a_nodes_loaders_share_the_packed_plans_and_read_the_same_packs(data, tmp_path,
                                                                        monkeypatch):
    from energon_ordering.pipeline.shared_plans import PLAN_DIR_ENV

    def run():
        return run_ranks(data, ordering=packed(), world_size=2, steps=6, batch_size=B,
                         packing_buffer_size=32,
                         task_encoder_factory=IndexedSyntheticTaskEncoder)

    monkeypatch.setenv(PLAN_DIR_ENV, "off")
    alone = run()
    monkeypatch.setenv(PLAN_DIR_ENV, str(tmp_path / "plans"))
    shared = run()
    assert shared == alone
    # closed loaders leave no plans behind (sharing between open loaders:
    # tests/test_shared_plans.py)
    assert not list((tmp_path / "plans").glob("plan-*.npy"))


# --- slow: two finite epochs, workers 2-3, cuts across both, CPU contention -------------------

_SPIN = "import os, sys\nparent = os.getppid()\nwhile os.getppid() == parent:\n    sum(range(10**6))\n"


@pytest.fixture
def busy_cpu(tmp_path):
    """Two processes spinning on the CPU for the test's duration (races hide on an idle
    machine); they end with the test, or when its process is gone."""
    import os
    import signal
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-c", _SPIN], start_new_session=True)
             for _ in range(2)]
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _two_epochs(make):
    """Records of two finite epochs of one loader, with the state before every micro-batch and
    after each epoch's last one (``states[i]`` resumes with ``records[i:]``)."""
    loader = make()
    records, states = [], []
    for _ in range(2):
        it = None
        while True:
            states.append(pickle.loads(pickle.dumps(loader.save_state_rank())))
            if it is None:
                it = iter(loader)
            try:
                records.append(record_batch(next(it)))
            except StopIteration:
                states.pop()  # the state after the last micro-batch is the next epoch's first
                break
        del it
    states.append(pickle.loads(pickle.dumps(loader.save_state_rank())))
    close_loader(loader)
    return records, states


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("num_workers", [2, 3])
def test_cuts_across_two_finite_epochs_under_a_busy_cpu(data, busy_cpu, num_workers):
    def make():
        return _loader(data, rank=1, repeat=False, num_workers=num_workers,
                       seq_length_warmup={"start": 256, "full": CAP, "warmup_steps": 6})

    records, states = _two_epochs(make)
    n = len(records)
    assert n > 8
    cuts = sorted({0, 1, 2, 5, n // 2 - 1, n // 2, n // 2 + 1, n - 2, n - 1, n} | set(range(0, n, 7)))
    for cut in cuts:
        loader = make()
        restore_state_rank(loader, states[cut])
        got = []
        for _ in range(2):  # the rest of this epoch, then the next one if any
            got.extend(record_batch(b) for b in loader)
            if len(got) >= n - cut:
                break
        close_loader(loader)
        assert got[:n - cut] == records[cut:], cut
    assert all(p.poll() is None for p in busy_cpu)  # the contention lasted


def test_a_packed_state_of_an_older_plan_version_is_refused_naming_it(data):
    """A packed planned state stamped with PACKED_PLAN_VERSION 2 (its steps' sample counts
    searched otherwise, so its position names other packs) is refused, naming the field, both
    versions and the fix."""
    from energon_ordering.planned.packs import PACKED_PLAN_VERSION
    from energon_ordering.state_stamp import _find_saved_class

    _, states = run_with_cuts(lambda: _loader(data, rank=0), 3, [2])
    entry = _find_saved_class(states[2].worker_states[0], "PlannedPackSourceDataset")
    entry["_stamp"]["packing"]["packed_plan_version"] = 2
    loader = _loader(data, rank=0)
    with pytest.raises(StateMismatchError, match=(
            rf"packing: saved .*'packed_plan_version': 2.* != configured "
            rf".*'packed_plan_version': {PACKED_PLAN_VERSION}.*packs with other logic.*start "
            r"the data stream fresh")):
        restore_state_rank(loader, states[2])
    close_loader(loader)


@pytest.mark.parametrize("saved_packed", [True, False], ids=["packed-to-padded", "padded-to-packed"])
def test_a_state_saved_with_packing_turned_on_or_off_is_refused_naming_packing(data,
                                                                               saved_packed):
    """Found by review (7 December 2026): a padded planned state restored with packing on
    raised a bare KeyError deep in Energon; the other way it named no setting."""
    def loader(packed_run):
        if packed_run:
            return _loader(data)
        return build_train_loader(data, ordering=packed(pack_seq_length=None), rank=0,
                                  world_size=2, batch_size=B,
                                  task_encoder_factory=IndexedSyntheticTaskEncoder)
    state = run_with_cuts(lambda: loader(saved_packed), 3, [2])[1][2]
    other = loader(not saved_packed)
    with pytest.raises(StateMismatchError, match="saved with packing and is configured without "
                       "it, or the other way round.*pack_seq_length.*packing_buffer_size"):
        restore_state_rank(other, state)
    close_loader(other)


def test_a_cap_below_a_media_items_tokens_is_named_not_the_length_index(data, caplog):
    """Found by review (7 December 2026): a warmup starting below an image's 64 tokens made
    packs over their cap, and the warning told the user to rebuild a correct length index."""
    import logging

    warm = {"start": 32, "full": CAP, "warmup_steps": 8}
    with caplog.at_level(logging.WARNING, logger="energon_ordering"):
        records = run_ranks(data, ordering=packed(seq_length_warmup=warm), world_size=2,
                            steps=2, batch_size=B, packing_buffer_size=32,
                            task_encoder_factory=IndexedSyntheticTaskEncoder)
    assert records[0]
    text = " ".join(r.getMessage() for r in caplog.records if "planned packing" in r.getMessage())
    assert "its media tokens alone are over the cap" in text and "seq_length_warmup.start" in text
    assert "Rebuild the index" not in text
