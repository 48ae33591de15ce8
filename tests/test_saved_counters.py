"""Hand-edited counters of the pool and warmup states are refused in one typed line (issue 31).

The shared checks (:mod:`energon_ordering.saved_counters`) as pure functions, then end to end:
a real loader's state (length pool, key pool, pool of packs, pack cap), one counter edited,
restored with ``energon_ordering.restore_state_rank`` into a fresh loader.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from energon_ordering import OrderingConfig, restore_state_rank
from energon_ordering.errors import StateMismatchError
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.build import build_length_index
from energon_ordering.saved_counters import (
    check_saved_bool,
    check_saved_counts,
    check_saved_float,
    check_saved_int,
    check_saved_list,
)

OWNER = "LengthPoolSortDataset"


def test_the_shared_checks_pass_saved_values():
    assert check_saved_int(OWNER, "_pool_index", np.int64(3)) == 3
    assert check_saved_float(OWNER, "x", 2) == 2.0
    assert check_saved_bool(OWNER, "_inner_done", np.bool_(True)) is True
    assert check_saved_list(OWNER, "_emit_keys", ("a", "b"), length=2) == ["a", "b"]
    check_saved_counts(OWNER, "_counts", {"seen": 3, "dropped": 0}, ["seen", "dropped"])


@pytest.mark.parametrize("call,match", [
    (lambda: check_saved_int(OWNER, "_pool_index", -1), r"_pool_index = -1 \(int\) must be an "
     r"int >= 0"),
    (lambda: check_saved_int(OWNER, "_pool_index", "2"), r"_pool_index = '2' \(str\)"),
    (lambda: check_saved_int(OWNER, "_pool_index", True), r"_pool_index = True \(bool\)"),
    (lambda: check_saved_int(OWNER, "o", 5, maximum=3), r"o = 5 .* int in \[0, 3\]"),
    (lambda: check_saved_float(OWNER, "c", math.nan), r"c = nan \(float\) must be a finite"),
    (lambda: check_saved_bool(OWNER, "_inner_done", None), r"_inner_done = None \(NoneType\) "
     "must be True or False"),
    (lambda: check_saved_list(OWNER, "k", [1], length=2), r"k = \[1\] \(list\) must be a list "
     "of 2 items"),
    (lambda: check_saved_counts(OWNER, "_counts", {"seen": -4}, ["seen"]),
     r"_counts\['seen'\] = -4"),
    (lambda: check_saved_counts(OWNER, "_counts", {"seen": 1}, ["seen", "dropped"]),
     r"_counts = \{'seen': 1\} \(dict\) must be a dict of the counters \['dropped', 'seen'\]"),
    (lambda: check_saved_counts(OWNER, "_counts", [1, 2], ["seen"]), r"_counts = \[1, 2\]"),
])
def test_the_shared_checks_refuse_in_one_line(call, match):
    with pytest.raises(StateMismatchError, match=match) as info:
        call()
    assert "\n" not in str(info.value) and str(info.value).startswith(f"{OWNER}: the saved ")


# -- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def indexed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("counters")
    make_synthetic_dataset(root, [SourceSpec("web", 320, "trimodal")], shard_size=32)
    build_length_index(root / "web", task_encoder=IndexedSyntheticTaskEncoder())
    return root / "web"


WARMUP = dict(start=256, full=2048, warmup_steps=6)
CONFIGS = {
    "length pool": OrderingConfig(length_sort_pool_size=8, length_sort_mode="sample", seed=3),
    "key pool": OrderingConfig(length_sort_pool_size=8, length_sort_mode="sample", seed=3,
                               length_sort_placement="pre-encode",
                               length_sort_pool_holds="keys"),
    "packs": OrderingConfig(length_sort_pool_size=8, length_sort_mode="sample", seed=3,
                            micro_batches_per_step=2, seq_length_warmup=WARMUP,
                            packing_buffer_size=16, pack_seq_length=2048),
    "warmup": OrderingConfig(micro_batches_per_step=2, seq_length_warmup=WARMUP),
}


def _loader(data: Path, which: str):
    return build_train_loader(data, ordering=CONFIGS[which], batch_size=2,
                              task_encoder_factory=IndexedSyntheticTaskEncoder)


def _stage_state(state: Any, name: str) -> dict[str, Any]:
    stack = list(state.worker_states)
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("__class__") == name:
                return node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    raise AssertionError(f"no {name} state")


@pytest.fixture(scope="module")
def saved(indexed) -> dict[str, Any]:
    out = {}
    for which in CONFIGS:
        loader = _loader(indexed, which)
        it = iter(loader)
        for _ in range(5):
            next(it)
        out[which] = loader.save_state_rank()
        del it
        close_loader(loader)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which,stage,field,value,match", [
    ("length pool", "LengthPoolSortDataset", "_pool_index", -1, r"_pool_index = -1"),
    ("length pool", "LengthPoolSortDataset", "_pool_index", "1", r"_pool_index = '1' \(str\)"),
    ("length pool", "LengthPoolSortDataset", "_inner_done", None, r"_inner_done = None"),
    ("key pool", "KeyPoolSortDataset", "_pool_index", -3, r"_pool_index = -3"),
    ("key pool", "KeyPoolSortDataset", "_collect_lengths", ["x"], r"_collect_lengths = \['x'\] "
     r"\(list\) must be a list of \d+ items|_collect_lengths\[0\] = 'x'"),
    ("key pool", "KeyPoolSortDataset", "_emit_keys", None, r"_emit_keys = None"),
    ("packs", "PackPoolSortDataset", "_pool_index", 2.0, r"_pool_index = 2.0 \(float\)"),
    ("packs", "PackCapDataset", "_counts", {"seen": -1},
     r"PackCapDataset: the saved _counts\['seen'\] = -1"),
    ("packs", "PackCapDataset", "_counts", "lots", r"_counts = 'lots' \(str\)"),
    ("packs", "PackCapDataset", "_epoch", {"passed": "3", "dropped": 0},
     r"_epoch\['passed'\] = '3' \(str\)"),
    # these two stages' restores are wired by the lead (seq_warmup.py, state_stamp.py)
    ("warmup", "SeqLenWarmupDataset", "_counts", {"truncated": -2},
     r"SeqLenWarmupDataset: the saved _counts\['truncated'\] = -2"),
    ("warmup", "SeqLenWarmupDataset", "_epoch", None, r"_epoch = None \(NoneType\)"),
    ("length pool", "PipelineStampDataset", "_ended", "no", r"_ended = 'no' \(str\)"),
    ("length pool", "PipelineStampDataset", "_epochs", -1, r"_epochs = -1 \(int\)"),
])
def test_an_edited_counter_is_refused_at_restore(indexed, saved, which, stage, field, value,
                                                 match):
    state = copy.deepcopy(saved[which])
    node = _stage_state(state, stage)
    if field == "_counts" and isinstance(value, dict):
        value = {**node["_counts"], **value}
    node[field] = value
    loader = _loader(indexed, which)
    try:
        with pytest.raises(StateMismatchError, match=match) as info:
            restore_state_rank(loader, state)
            next(iter(loader))
        assert str(info.value).count("\n") == 0
    finally:
        close_loader(loader)


# -- Megatron-LM's provider: a worker entry of None --------------------------------------------


@pytest.mark.parametrize("entries", [[None], ["not a worker state"]])
def test_a_megatron_state_file_with_a_worker_entry_of_none_is_refused(indexed, tmp_path, entries):
    """``worker_states = [None]`` used to end in ``AttributeError: 'NoneType' object has no
    attribute 'state'`` (counting the consumed micro-batches). Energon never writes None for a
    worker: one that has not started is a checkpoint without a state."""
    import argparse

    import torch

    from energon_ordering.integrations.megatron_lm import _restore, dataloader_state_path

    loader = _loader(indexed, "length pool")
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.save_state_rank()
    del it
    close_loader(loader)
    state.worker_states = list(entries)
    path = dataloader_state_path(tmp_path / "dl", 3, 0)
    path.parent.mkdir(parents=True)
    torch.save({"dataloader_state_dict": state}, path)
    args = argparse.Namespace(load=str(tmp_path / "ckpt"), iteration=3, micro_batch_size=2,
                              dataloader_save=str(tmp_path / "dl"), global_batch_size=2,
                              data_parallel_size=1, allow_dataloader_restart=False,
                              rampup_batch_size=None)
    loader = _loader(indexed, "length pool")
    try:
        with pytest.raises(StateMismatchError, match=rf"Dataloader state {path} \(data-parallel "
                           rf"rank 0\): restore_state_rank: worker_states\[0\] is "
                           rf"{entries[0]!r} .* it must be a FlexState") as info:
            _restore(loader, args=args, dp_rank=0)
        assert "\n" not in str(info.value)
    finally:
        close_loader(loader)
