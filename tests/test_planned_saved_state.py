"""Hand-edited planned states are refused with one typed line (issue 31).

The pure check (:func:`energon_ordering.planned.saved_state.check_planned_state`) on a state
as ``PlannedSourceDataset`` saves it, each field edited; then end to end: a real planned
loader's state, edited, restored with ``energon_ordering.restore_state_rank`` into a fresh
loader (exact and elastic). The end-to-end refusals need the check wired into
``PlannedSourceDataset.restore_state`` / ``restore_elastic``.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from energon_ordering import OrderingConfig, restore_state_rank
from energon_ordering.errors import StateMismatchError
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.planned.saved_state import check_offset_in_micro_batch, check_planned_state

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

B, M, K = 4, 2, 2
SIZES = [160, 96]


def _state(**edits: Any) -> dict[str, Any]:
    """A planned state as the source saves it after 5 micro-batches (1 rank, no workers)."""
    state = {
        "__class__": "PlannedSourceDataset",
        "_stamp": {"mode": "planned", "sizes": SIZES, "window_steps": K, "world_size": 1,
                   "micro_batches_per_step": M, "batch_size": B, "finite": False},
        "_epoch": 0, "_next": 5, "_offset": 0,
        "_cursor": {"window": 1, "drawn": [11, 5], "carry": [-0.2, 0.2]},
        "_start_step": 0, "_history": [], "_epoch_offset": 0,
    }
    state.update(edits)
    return state


def _check(state: Any, **kw: Any) -> None:
    check_planned_state(state, **{**dict(sizes=SIZES, micro_batches_per_step=M, batch_size=B,
                                         window_steps=K, workers=1), **kw})


def test_a_saved_state_passes():
    _check(_state())
    _check(_state(_next=None, _cursor={"window": 0, "drawn": [0, 0], "carry": [0.0, 0.0]}))
    _check(_state(_next=9, _start_step=4, _cursor={"window": 2, "drawn": [30, 10],
                                                   "carry": [0, 0.5]},
                  _history=[{"at_step": 4, "world_size": 2, "micro_batches_per_step": 1,
                             "batch_size": 4}, {"at_step": 2, "world_size": 4,
                                                "micro_batches_per_step": 1}]))
    _check(_state(), elastic=True)
    # the window mix's deferred samples (sample ids of both sources)
    _check(_state(_cursor={**CURSOR, "deferred": [0, 255, 17]}))


CURSOR = {"window": 1, "drawn": [11, 5], "carry": [-0.2, 0.2]}


@pytest.mark.parametrize("edit,match", [
    (dict(_offset=B), r"_offset = 4 \(int\) must be an int in \[0, 3\]"),
    (dict(_offset=-1), r"_offset = -1 \(int\) must be an int in \[0, 3\]"),
    (dict(_offset="1"), r"_offset = '1' \(str\)"),
    (dict(_offset=1.0), r"_offset = 1.0 \(float\)"),
    (dict(_next=None, _offset=2), r"_offset = 2 .* must be an int in \[0, 0\]"),
    (dict(_next=-3), r"_next = -3 \(int\) must be an int >= 0"),
    (dict(_next="5"), r"_next = '5' \(str\)"),
    (dict(_next=True), r"_next = True \(bool\)"),
    (dict(_next=3, _start_step=2), r"_next = 3 \(int\) must be an int >= 4"),
    (dict(_epoch=-1), r"_epoch = -1 \(int\) must be an int >= 0"),
    (dict(_start_step=None), r"_start_step = None \(NoneType\)"),
    (dict(_cursor=[1, [11, 5], [0, 0]]), r"_cursor = \[1, \[11, 5\], \[0, 0\]\] \(list\)"),
    (dict(_cursor={**CURSOR, "drawn": [-1, 5]}), r"_cursor\['drawn'\]\[0\] = -1 .* >= 0"),
    (dict(_cursor={**CURSOR, "drawn": [11]}), r"_cursor\['drawn'\] = \[11\] \(list\) .* 2 ints"),
    (dict(_cursor={**CURSOR, "carry": [math.nan, 0.0]}), r"_cursor\['carry'\]\[0\] = nan .* "
     "finite number"),
    (dict(_cursor={**CURSOR, "carry": [0.0, math.inf]}), r"_cursor\['carry'\]\[1\] = inf"),
    (dict(_cursor={**CURSOR, "window": 7}), r"_cursor\['window'\] = 7 .* \[0, 1\]"),
    (dict(_cursor={**CURSOR, "deferred": [3, 256]}),
     r"_cursor\['deferred'\]\[1\] = 256 .* \[0, 255\]"),
    (dict(_cursor={**CURSOR, "deferred": [-1]}), r"_cursor\['deferred'\]\[0\] = -1"),
    (dict(_cursor={**CURSOR, "deferred": 3}), r"_cursor\['deferred'\] = 3 \(int\) must be a list"),
    (dict(_cursor={**CURSOR, "deferred": [0] * 1025}), r"_cursor\['deferred'\] = .* at most 1024"),
    (dict(_epoch_offset=1), r"_epoch_offset = 1 \(int\) must be an int in \[0, 0\]"),
    (dict(_epoch_offset=None), r"_epoch_offset = None \(NoneType\)"),
    (dict(_history={"at_step": 0}), r"_history = \{'at_step': 0\} \(dict\) must be a list"),
    (dict(_history=[{"at_step": 0, "world_size": 0, "micro_batches_per_step": 1}]),
     r"_history\[0\]\['world_size'\] = 0 .* >= 1"),
    (dict(_history=[{"at_step": 0, "world_size": 2, "micro_batches_per_step": "2"}]),
     r"_history\[0\]\['micro_batches_per_step'\] = '2' \(str\)"),
    (dict(_history=[{"at_step": 0, "world_size": 2, "micro_batches_per_step": 1,
                     "batch_size": 2.5}]), r"_history\[0\]\['batch_size'\] = 2.5"),
    (dict(_history=[{"at_step": 9, "world_size": 2, "micro_batches_per_step": 1}]),
     r"_history\[0\]\['at_step'\] = 9 .* \[0, 0\]"),
])
def test_an_edited_field_is_refused_in_one_line(edit, match):
    with pytest.raises(StateMismatchError, match=match) as info:
        _check(_state(**edit))
    message = str(info.value)
    assert "\n" not in message and message.startswith("PlannedSourceDataset: the saved ")
    assert "restore the state exactly as save_state_rank() wrote it" in message


def test_a_missing_field_or_stamp_is_refused():
    state = _state()
    del state["_history"]
    with pytest.raises(StateMismatchError, match=r"state \(missing _history\)"):
        _check(state)
    with pytest.raises(StateMismatchError, match=r"_stamp = None"):
        _check(_state(_stamp=None), elastic=True)
    state = _state()
    del state["_stamp"]
    with pytest.raises(StateMismatchError, match=r"missing _stamp"):
        _check(state, elastic=True)
    with pytest.raises(StateMismatchError, match=r"the saved state = 3 \(int\)"):
        _check(3)


@pytest.mark.parametrize("key,value", [("world_size", 0), ("micro_batches_per_step", None),
                                       ("batch_size", "4")])
def test_the_elastic_path_reads_a_checked_saved_shape(key, value):
    state = _state()
    state["_stamp"] = {**state["_stamp"], key: value}
    _check(state)  # an exact restore compares the whole stamp elsewhere
    with pytest.raises(StateMismatchError, match=rf"_stamp\['{key}'\] = {value!r}"):
        _check(state, elastic=True)


def test_the_elastic_path_counts_in_the_saved_shape():
    state = _state(_offset=5)  # the saved micro-batch held 8 samples
    state["_stamp"] = {**state["_stamp"], "batch_size": 8}
    _check(state, elastic=True)
    with pytest.raises(StateMismatchError, match=r"_offset = 5"):
        _check(state)


def test_next_past_a_finite_epochs_end_is_refused():
    ended = _state(_next=12, _cursor={"window": 2, "drawn": [36, 12], "carry": [0, 0]})
    _check(ended, end_step=6, finite=True)  # the worker's last micro-batch was 11
    _check(ended, end_step=lambda: 6)
    with pytest.raises(StateMismatchError, match=r"_next = 13 .* below 13: the finite epoch "
                       r"ends after optimizer step 5 \(2 micro-batches per step, 1 loader"):
        _check({**ended, "_next": 13}, end_step=6)
    _check({**ended, "_next": 13}, end_step=6, workers=2)


def test_a_finite_epochs_draws_start_at_the_epochs_start():
    state = _state(_epoch=1, _cursor={"window": 1, "drawn": [170, 100], "carry": [0, 0]})
    _check(state, finite=True)
    with pytest.raises(StateMismatchError, match=r"_cursor\['drawn'\]\[1\] = 95 .* >= 96"):
        _check({**state, "_cursor": {**state["_cursor"], "drawn": [170, 95]}}, finite=True)


def test_a_packed_micro_batch_checks_its_offset_from_the_plan():
    _check(_state(_offset=11), packed=True)  # the plan knows the count
    check_offset_in_micro_batch("PlannedPackSourceDataset", 10, 11, 5)
    with pytest.raises(StateMismatchError, match=r"PlannedPackSourceDataset: the saved _offset "
                       r"= 11 \(int\) must be below the 11 samples of micro-batch 5"):
        check_offset_in_micro_batch("PlannedPackSourceDataset", 11, 11, 5)


# -- end to end: a real planned loader's state, edited, restored into a fresh loader -----------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return indexed_synthetic(
        tmp_path_factory.mktemp("planned-edits"),
        [SourceSpec("web", 160, "short", weight=0.7), SourceSpec("code", 96, "long", weight=0.3)],
        shard_size=32)


def _loader(data: Path, world_size: int = 1, rank: int = 0, mbps: int = M):
    cfg = OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                         length_sort_pool_holds="keys", micro_batches_per_step=mbps, seed=5,
                         plan_window_steps=K)
    return build_train_loader(data, ordering=cfg, rank=rank, world_size=world_size,
                              batch_size=B, task_encoder_factory=IndexedSyntheticTaskEncoder)


def planned_state(loader_state: Any) -> dict[str, Any]:
    """The PlannedSourceDataset's state inside a no-worker ``save_state_rank()`` result."""
    stack = list(loader_state.worker_states)
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("__class__") == "PlannedSourceDataset":
                return node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    raise AssertionError("no PlannedSourceDataset state")


@pytest.fixture(scope="module")
def saved(data) -> Any:
    """Rank 0's state of a 2-rank run after 4 micro-batches (2 optimizer steps)."""
    loader = _loader(data, world_size=2)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.save_state_rank()
    del it
    close_loader(loader)
    return state


E2E = [
    ("_offset", B, r"_offset = 4 \(int\) must be an int in \[0, 3\]"),  # used to hang
    ("_offset", -2, r"_offset = -2"),
    ("_next", "4", r"_next = '4' \(str\)"),
    ("_history", [{"at_step": 99, "world_size": 2, "micro_batches_per_step": 2}],
     r"_history\[0\]\['at_step'\] = 99"),
    ("_cursor", {"window": 0, "drawn": [-1, 0], "carry": [0.0, 0.0]},
     r"_cursor\['drawn'\]\[0\] = -1"),
    ("_cursor", {"window": 0, "drawn": [0, 0], "carry": [math.nan, 0.0]},
     r"_cursor\['carry'\]\[0\] = nan"),
    ("_epoch", -1, r"_epoch = -1"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field,value,match", E2E)
def test_an_edited_state_is_refused_at_an_exact_restore(data, saved, field, value, match):
    state = copy.deepcopy(saved)
    planned_state(state)[field] = value
    loader = _loader(data, world_size=2)
    try:
        with pytest.raises(StateMismatchError, match=match):
            restore_state_rank(loader, state)
            next(iter(loader))
    finally:
        close_loader(loader)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field,value,match", [
    *[e for e in E2E if e[0] != "_offset"],
    ("_stamp", None, r"_stamp"),
])
def test_an_edited_state_is_refused_at_an_elastic_restore(data, saved, field, value, match):
    state = copy.deepcopy(saved)
    if field == "_stamp":
        del planned_state(state)["_stamp"]
    else:
        planned_state(state)[field] = value
    loader = _loader(data, world_size=1, mbps=2 * M)  # 2 ranks x 2 -> 1 rank x 4: elastic
    try:
        with pytest.raises(StateMismatchError, match=match):
            restore_state_rank(loader, state)
            next(iter(loader))
    finally:
        close_loader(loader)
