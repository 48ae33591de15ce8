"""The planned order under Megatron-LM's batch-size ramp-up (``--rampup-batch-size``).

During the ramp-up Megatron's iterations draw fewer micro-batches than the plan's optimizer step
holds (its step is the final global batch), so a checkpoint can fall inside a plan step. The
states are saved and restored through the provider's own ``_restore`` (the path Megatron's
``--load`` takes), with the micro-batch counts of Megatron's own num-microbatches calculator.

- Same data-parallel size: exact at a cut inside a plan step.
- Another data-parallel size (2 -> 1): the state counts the micro-batches of the size it was
  saved at, so the calculator is asked at that size; at a plan-step boundary the resumed rank
  draws the samples the two ranks would have drawn, and inside one the resume is refused with a
  message that names the ramp-up and what to do.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import pytest
import torch

from energon_ordering import OrderingConfig
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder

pytest.importorskip("megatron.core")

from energon_ordering.integrations.megatron_lm import (  # noqa: E402
    DataloaderRestoreError,
    _restore,
    dataloader_state_path,
    expected_consumed_micro_batches,
)

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

MBS, GBS, RAMPUP = 4, 32, [8, 8, 96]  # the global batch grows 8 -> 16 -> 24 -> 32


def _args(save: Path, dp: int, iteration: int) -> argparse.Namespace:
    return argparse.Namespace(dataloader_save=str(save), load="ckpt", iteration=iteration,
                              micro_batch_size=MBS, global_batch_size=GBS, data_parallel_size=dp,
                              rampup_batch_size=RAMPUP, allow_dataloader_restart=False)


def _loader(data: Path, dp: int, rank: int, num_workers: int = 0):
    cfg = OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                         length_sort_pool_holds="keys", micro_batches_per_step=GBS // (MBS * dp),
                         seed=3, plan_window_steps=4)
    return build_train_loader(data, ordering=cfg, rank=rank, world_size=dp, batch_size=MBS,
                              num_workers=num_workers, task_encoder_factory=IndexedSyntheticTaskEncoder)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return indexed_synthetic(tmp_path_factory.mktemp("rampup"),
                             [SourceSpec("web", 240, "short", weight=0.7),
                              SourceSpec("code", 160, "long", weight=0.3)], shard_size=40)


def _draw(loader, before: int, after: int):
    """The state after ``before`` micro-batches and the keys of the ``after`` that follow."""
    it = iter(loader)
    for _ in range(before):
        next(it)
    state = pickle.loads(pickle.dumps(loader.save_state_rank()))
    keys = [tuple(next(it).keys) for _ in range(after)]
    del it
    close_loader(loader)
    return state, keys


def _save(save: Path, iteration: int, dp_rank: int, state) -> None:
    path = dataloader_state_path(save, iteration, dp_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"dataloader_state_dict": state}, path)


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_exact_resume_inside_a_plan_step_during_the_rampup(data, tmp_path, num_workers):
    iteration = 7  # Megatron's calculator: 1, 1, 1, 1, 2, 2, 3 micro-batches per rank
    drawn = expected_consumed_micro_batches(_args(tmp_path, 2, iteration), iteration)
    assert drawn == 11 and drawn % (GBS // (MBS * 2))  # inside plan step 2 (4 per step)
    for rank in range(2):
        state, after = _draw(_loader(data, 2, rank, num_workers), drawn, 9)
        _save(tmp_path / "dl", iteration, rank, state)
        loader = _loader(data, 2, rank, num_workers)
        _restore(loader, args=_args(tmp_path / "dl", 2, iteration), dp_rank=rank)
        _, resumed = _draw(loader, 0, 9)
        assert resumed == after


def test_elastic_resume_during_the_rampup_at_a_plan_step(data, tmp_path):
    iteration = 6  # 1, 1, 1, 1, 2, 2: 8 micro-batches per rank, the end of plan step 1
    drawn = expected_consumed_micro_batches(_args(tmp_path, 2, iteration), iteration)
    assert drawn == 8
    m2 = GBS // MBS  # one rank: 8 micro-batches per plan step
    whole = []
    for rank in range(2):
        state, after = _draw(_loader(data, 2, rank), drawn, 2 * m2 // 2)
        whole.append(after)
        if rank == 0:
            _save(tmp_path / "dl", iteration, 0, state)  # Megatron's dprank000 file only
    loader = _loader(data, 1, 0)
    _restore(loader, args=_args(tmp_path / "dl", 1, iteration), dp_rank=0)
    _, resumed = _draw(loader, 0, 2 * m2)
    # plan steps 2 and 3 (the rest of window 0, re-planned for one rank) hold the samples the two
    # ranks would have drawn, each step the same count per source
    two = [sorted(k for rank in whole for b in rank[t * 4:(t + 1) * 4] for k in b) for t in range(2)]
    one = [sorted(k for b in resumed[t * m2:(t + 1) * m2] for k in b) for t in range(2)]
    assert sorted(two[0] + two[1]) == sorted(one[0] + one[1])
    assert len(set(one[0] + one[1])) == 2 * GBS
    for a, b in zip(one, two):
        assert sum(k.startswith("web") for k in a) == sum(k.startswith("web") for k in b)


def test_elastic_resume_inside_a_plan_step_names_the_rampup(data, tmp_path):
    iteration = 7  # 11 micro-batches per rank: inside plan step 2
    drawn = expected_consumed_micro_batches(_args(tmp_path, 2, iteration), iteration)
    state, _ = _draw(_loader(data, 2, 0), drawn, 0)
    _save(tmp_path / "dl", iteration, 0, state)
    loader = _loader(data, 1, 0)
    with pytest.raises(DataloaderRestoreError,
                       match=r"iteration 7 .*--rampup-batch-size = \[8, 8, 96\].*micro-batch 3 of plan step 2.*"
                             r"same data-parallel size"):
        _restore(loader, args=_args(tmp_path / "dl", 1, iteration), dp_rank=0)
    close_loader(loader)
