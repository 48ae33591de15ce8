"""``planned_mix = "window"`` through config, state and pipeline (issue 32): exact and elastic
resume as for ``"step"``, the stamp, and the mix the window holds.

Real prepared datasets with length indexes, real ``get_train_dataset`` +
``get_savable_loader`` per simulated rank; compared by what the model sees (each sample's key
and its tokens after the warmup's cut, and the packs when packing), with test_elastic_exact's
loaders, runs and data.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from energon_ordering import restore_state_rank
from energon_ordering.errors import StateMismatchError
from energon_ordering.inspect.rank_simulation import (
    close_loader,
    resume,
    run_with_cuts,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_elastic_exact import B, K, _packs_seen, _seen, data  # noqa: E402,F401  (data: fixture)
from energon_ordering.planned.window_size import steps_within_an_epoch  # noqa: E402

#: test_elastic_exact's sources: web 300 samples, code 160.
SIZES = (300, 160)
from test_elastic_exact import _loader as _any_loader  # noqa: E402
from test_elastic_exact import _run as _any_run  # noqa: E402
from tiers import cases  # noqa: E402


def _loader(data, world_size, mbps, rank, num_workers=0, mix="window", **kw):
    """Rank ``rank``'s planned loader of test_elastic_exact (warmup, K = 4), with ``mix``."""
    return _any_loader(data, world_size, mbps, rank, num_workers, planned_mix=mix, **kw)


def _run(data, world_size, mbps, micro_batches, mix="window", **kw):
    """test_elastic_exact's run of every rank, with ``mix``."""
    return _any_run(data, world_size, mbps, micro_batches, planned_mix=mix, **kw)


# -- exact resume: cuts mid-window and before a window's last micro-batch, workers 0-3 ---------

EXACT = {
    "padded-0": dict(num_workers=0),
    "packed-0": dict(num_workers=0, pack=True, pack_seq_length=1024),
    "packed-2": dict(num_workers=2, pack=True, pack_seq_length=1024),
    "padded-1": dict(num_workers=1),
    "padded-2": dict(num_workers=2),
    "padded-3": dict(num_workers=3),
}


@pytest.mark.parametrize("case", cases(EXACT))
def test_window_mix_resumes_exactly(data, case):
    """Rank 1 of 2 ranks x 2 micro-batches (a window is 8 of its micro-batches), saved before
    micro-batches 0, 3 (mid-window), 7 (a window's last), 8 and 13: each state continues as
    the uninterrupted run, sample for sample and token for token."""
    kw = EXACT[case]
    total = 16
    cuts = [0, 3, 7, 8, 13]

    def make():
        return _loader(data, 2, 2, 1, **kw)

    records, states = run_with_cuts(make, total, cuts)
    for cut in cuts:
        assert resume(make, states[cut], total - cut) == records[cut:], cut


# -- elastic resume: the same steps' samples at another shape ----------------------------------

ELASTIC = {
    "padded": dict(),
    "packed": dict(pack=True, pack_seq_length=1024),
    "packed-workers": dict(pack=True, pack_seq_length=1024, num_workers=2),
    "padded-workers": dict(num_workers=2),
    "padded-3-workers": dict(num_workers=3),
}


@pytest.mark.parametrize("case", cases(ELASTIC))
def test_window_mix_elastic_resume_keeps_each_steps_samples(data, case):
    """3 ranks x 2 micro-batches saved at step 6 (inside plan window 1 and the warmup), resumed
    on 2 ranks x 3 (packed: 2 x 2 -> 1 x 4): every step holds the uninterrupted run's samples,
    cut to the same lengths (packed: in the same packs); a state the resumed loader saves
    mid-step then resumes exactly."""
    kw = dict(ELASTIC[case])
    workers = kw.pop("num_workers", 0)
    (r1, m1), (r2, m2) = ((2, 2), (1, 4)) if kw.get("pack") else ((3, 2), (2, 3))
    seen = _packs_seen if kw.get("pack") else _seen
    steps, at = 10, 6
    whole, _ = _run(data, r1, m1, steps * m1, **kw)
    _, states = _run(data, r1, m1, at * m1, save_at={at * m1}, num_workers=workers, **kw)
    n = (steps - at) * m2
    rest, saved = _run(data, r2, m2, n, state=states[at * m1], save_at={1},
                       num_workers=workers, **kw)
    assert seen(rest, m2) == seen(whole, m1)[at:]
    resumed = resume(lambda: _loader(data, r2, m2, 0, workers, **kw), saved[1], n - 1)
    assert resumed == rest[0][1:]


# -- what the window mix is -------------------------------------------------------------------

def test_the_window_mix_holds_each_windows_share_and_moves_samples_between_its_steps(data):
    """Each window of K steps holds each source within one sample of its share of the window,
    and the steps hold other samples than the step mix's (banded by length); without the mix
    passed through, the two runs would be the same."""
    runs = {mix: _run(data, 2, 2, 8 * 2, mix=mix, seq_length_warmup=None)[0]
            for mix in ("step", "window")}
    steps = {mix: [[k for k, _ in pairs] for pairs in _seen(r, 2)] for mix, r in runs.items()}
    G = 2 * 2 * B
    for w in range(2):
        window = [k for s in steps["window"][w * K:(w + 1) * K] for k in s]
        assert abs(sum(k.startswith("web") for k in window) - 0.7 * K * G) <= 1
    assert all(len(s) == G for s in steps["window"])
    assert steps["window"] != steps["step"]


def test_the_packed_window_mix_is_planned_for_the_window(data):
    """With packing the window mix reaches plan_packed_window: each window holds each source's
    share of the window within one sample, and the steps' packs are not the step mix's."""
    kw = dict(pack=True, pack_seq_length=1024, seq_length_warmup=None)
    runs = {mix: _packs_seen(_run(data, 2, 2, 8 * 2, mix=mix, **kw)[0], 2)
            for mix in ("step", "window")}
    assert runs["window"] != runs["step"]
    for w in range(2):
        keys = [k for s in runs["window"][w * K:(w + 1) * K] for p in s for k, _ in p]
        assert abs(sum(k.startswith("web") for k in keys) - 0.7 * len(keys)) <= 1


@pytest.mark.parametrize("saved,restored", [("step", "window"), ("window", "step")])
def test_a_state_of_the_other_mix_is_refused_naming_both(data, saved, restored):
    """Exact (same shape) and elastic (another shape) restores both refuse it by name."""
    _, states = _run(data, 2, 2, 4, save_at={4}, mix=saved)
    loader = _loader(data, 2, 2, 0, mix=restored)
    with pytest.raises(StateMismatchError,
                       match=rf"planned_mix: saved '{saved}' != configured '{restored}'") as e:
        restore_state_rank(loader, states[4])
    # the fix is the mix, not a version of energon_ordering (the window mix's plan version is
    # stamped under the window mix only, so it differs too)
    assert "planned_mix set explicitly to the saved value" in str(e.value)
    assert "WINDOW_MIX_PLAN_VERSION" not in str(e.value)
    close_loader(loader)
    loader = _loader(data, 1, 4, 0, mix=restored)
    with pytest.raises(StateMismatchError,
                       match=rf"planned_mix = '{saved}'.*planned_mix = '{restored}'"):
        restore_state_rank(loader, states[4])
    close_loader(loader)


#: Steps 4-8 ramp web 0.8 -> 0.2: a schedule that changes the weights (test_elastic_exact's).
ANNEAL = {"total_steps": 16, "phases": [
    {"until": 0.25, "weights": {"web": 0.8, "code": 0.2}},
    {"until": 1.0, "ramp_steps": 4, "weights": {"web": 0.2, "code": 0.8}}]}
#: The blend's weights as a schedule that never changes them (only their scale moves).
FLAT = {"total_steps": 16, "sources": {"web": {"weight": {"linear": {0: 7, 16: 14}}},
                                       "code": {"weight": {"linear": {0: 3, 16: 6}}}}}


@pytest.mark.parametrize("schedule,resolved", [(None, "window"), (FLAT, "window"),
                                               (ANNEAL, "step")])
def test_auto_plans_what_it_resolves_to_on_real_pipelines(data, schedule, resolved):
    """planned_mix "auto" (the default) on 2 ranks x 2 micro-batches: every rank sees exactly
    the samples and tokens of the granularity it resolves to (the window mix without a schedule
    or with one that only scales the weights; the step mix where the schedule changes them),
    and a state saved under it resumes as that granularity, exactly."""
    kw = {} if schedule is None else {"mixture_schedule": schedule}
    auto, states = _run(data, 2, 2, 12, mix="auto", save_at={4}, **kw)
    assert auto == _run(data, 2, 2, 12, mix=resolved, **kw)[0]
    other = {"step": "window", "window": "step"}[resolved]
    assert auto != _run(data, 2, 2, 12, mix=other, **kw)[0]
    rest, _ = _run(data, 2, 2, 8, state=states[4], mix=resolved, **kw)
    assert rest == [rank[4:] for rank in auto]


def test_a_step_state_restored_under_auto_that_plans_per_window_is_refused_naming_the_fix(data):
    """A state of the step mix (the default before 'auto') restored where "auto" plans per
    window: refused, naming both granularities and the setting that resumes it."""
    _, states = _run(data, 2, 2, 4, save_at={4}, mix="step")
    loader = _loader(data, 1, 4, 0, mix="auto")
    with pytest.raises(StateMismatchError, match=r"planned_mix = 'step'.*planned_mix = 'window'"
                       r".*resume with planned_mix = 'step' set explicitly \(the default "
                       r"'auto'"):
        restore_state_rank(loader, states[4])
    close_loader(loader)
    whole, _ = _run(data, 2, 2, 6, mix="step")
    rest, _ = _run(data, 2, 2, 2, state=states[4], mix="step")  # set explicitly, it resumes
    assert rest == [rank[4:] for rank in whole]


def test_a_state_written_before_planned_mix_restores_as_the_step_mix(data):
    """A planned state without ``planned_mix`` in its stamp (written before it existed)
    continues as the step mix it was; the window mix refuses it, naming 'step'."""
    from energon_ordering.state_stamp import _find_saved_class

    _, states = _run(data, 2, 2, 4, save_at={4}, mix="step")
    current, _ = _run(data, 2, 2, 4, state=states[4], mix="step")
    entry = _find_saved_class(states[4].worker_states[0], "PlannedSourceDataset")
    del entry["_stamp"]["planned_mix"]
    assert _run(data, 2, 2, 4, state=states[4], mix="step")[0] == current
    loader = _loader(data, 2, 2, 0, mix="window")
    with pytest.raises(StateMismatchError, match=r"planned_mix: saved 'step' != configured"):
        restore_state_rank(loader, states[4])
    close_loader(loader)


def test_a_window_mix_state_of_an_older_plan_version_is_refused_naming_it(data):
    """A window-mix state stamped with an older WINDOW_MIX_PLAN_VERSION (2: its bands tied by
    id) is refused, naming the field, both versions and the fix."""
    from energon_ordering.planned.window import WINDOW_MIX_PLAN_VERSION
    from energon_ordering.state_stamp import _find_saved_class

    _, states = _run(data, 2, 2, 4, save_at={4})
    entry = _find_saved_class(states[4].worker_states[0], "PlannedSourceDataset")
    entry["_stamp"]["window_mix_plan_version"] = WINDOW_MIX_PLAN_VERSION - 1
    loader = _loader(data, 2, 2, 0)
    with pytest.raises(StateMismatchError, match=rf"window_mix_plan_version: saved "
                       rf"{WINDOW_MIX_PLAN_VERSION - 1} != configured {WINDOW_MIX_PLAN_VERSION}"
                       r"\).*resume with the energon_ordering version that wrote "
                       r"the state, or start the data stream fresh"):
        restore_state_rank(loader, states[4])
    close_loader(loader)


# -- the window sized by the global batch (plan_window_steps unset) ---------------------------

@pytest.mark.parametrize("workers", [0, 2])
def test_the_default_window_resumes_exactly_and_elastically(data, workers):
    """plan_window_steps unset: the window mix holds its default of steps for this small
    global batch (2^20 samples' worth under the warmup's caps, at most 4,096 steps: the whole
    run is one window). States at cuts inside it resume exactly, and a
    resume at another data-parallel size with the same global batch keeps the same K and every
    step's samples, cut to the same lengths (the warmup ramps inside the window)."""
    kw = dict(plan_window_steps=None, num_workers=workers)
    whole, _ = _run(data, 3, 2, 10 * 2, **kw)
    _, states = _run(data, 3, 2, 6 * 2, save_at={5, 6 * 2}, **kw)
    rest, _ = _run(data, 2, 3, 4 * 3, state=states[6 * 2], **kw)
    assert _seen(rest, 3) == _seen(whole, 2)[6:]

    def make():
        return _loader(data, 3, 2, 0, workers, plan_window_steps=None)

    assert resume(make, states[5], 20 - 5) == whole[0][5:]


def _refused(loader, state, match):
    """``restore_state_rank(loader, state)`` raises a StateMismatchError matching ``match``;
    the loader is closed either way."""
    try:
        with pytest.raises(StateMismatchError, match=match):
            restore_state_rank(loader, state)
    finally:
        close_loader(loader)


def test_a_global_batch_change_under_the_default_window_names_plan_window_steps(data):
    """The default K follows the global batch (on this small repeating data, through the
    steps in which no source is drawn beyond its size): a resume that changes it (allowed)
    would plan windows of another K, so it is refused naming plan_window_steps and the saved
    K."""
    kw = dict(plan_window_steps=None, allow_global_batch_change=True)
    saved, now = (steps_within_an_epoch(SIZES, [[0.7, 0.3]], 2 * m * B) for m in (2, 4))
    assert saved != now
    _, states = _run(data, 2, 2, 4, save_at={4}, **kw)
    _refused(_loader(data, 2, 4, 0, **kw), states[4],
             rf"plan_window_steps: saved {saved} != configured {now}.*set plan_window_steps")


@pytest.mark.parametrize("mix", ["step", "window"])
def test_a_state_of_the_old_fixed_window_is_refused_naming_plan_window_steps(data, mix):
    """A state saved when the default window was 32 steps (plan_window_steps: 32 stands for
    it) restored with today's default (here one epoch of the sources: fewer steps than either
    mix's own default): refused, naming the setting, both values and the fix; with
    plan_window_steps: 32 the same state resumes exactly."""
    k = steps_within_an_epoch(SIZES, [[0.7, 0.3]], 2 * 2 * B)
    _, states = _run(data, 2, 2, 4, save_at={3}, mix=mix, plan_window_steps=32)
    _refused(_loader(data, 2, 2, 0, mix=mix, plan_window_steps=None), states[3],
             rf"plan_window_steps: saved 32 != configured {k}.*set plan_window_steps")
    whole, _ = _run(data, 2, 2, 8, mix=mix, plan_window_steps=32)

    def make():
        return _loader(data, 2, 2, 0, mix=mix, plan_window_steps=32)

    assert resume(make, states[3], 5) == whole[0][3:]
