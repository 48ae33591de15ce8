"""The ordering against a Megatron-Bridge run (integrations/bridge_run.py): pure checks, no Bridge
needed, so they run on the default Python; test_bridge.py runs them through Bridge's real
ConfigContainer."""

from __future__ import annotations

import dataclasses

import pytest

from energon_ordering import OrderingConfig, OrderingConfigError
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.integrations.bridge_run import RunShape, agree_with_run, missing_split

RUN = RunShape(micro_batch_size=4, global_batch_size=32, data_parallel_size=2, train_iters=1000,
               seq_length=2048)
SCHEDULE = {"total_steps": 200, "phases": [{"until": 0.9, "weights": {"web": 1, "code": 1}},
                                           {"until": 1.0, "weights": {"web": 0, "code": 1}}]}


def test_micro_batches_per_step_is_derived_unless_given():
    assert agree_with_run(OrderingConfig(), RUN, given=()).micro_batches_per_step == 4
    given = OrderingConfig(micro_batches_per_step=4)
    assert agree_with_run(given, RUN, given={"micro_batches_per_step"}).micro_batches_per_step == 4
    with pytest.raises(OrderingConfigError, match=r"micro_batches_per_step = 2, but Bridge's "
                       r"train.global_batch_size 32 / \(train.micro_batch_size 4 x data-parallel "
                       r"size 2\) = 4; set dataset.ordering.micro_batches_per_step=4"):
        agree_with_run(OrderingConfig(micro_batches_per_step=2), RUN, given={"micro_batches_per_step"})
    with pytest.raises(OrderingConfigError, match=r"global_batch_size = 36 is not a multiple of .* = 8; "
                                                  r"use a global batch of 32"):
        agree_with_run(OrderingConfig(), RunShape(4, 36, 2), given=())


def test_schedule_length_against_train_iters():
    config = OrderingConfig(mixture_schedule=SCHEDULE)
    with pytest.raises(OrderingConfigError, match=r"mixture_schedule.total_steps = 200 .*train.train_iters = 1000: .*"
                                                  r"dataset.scale_schedule_to_run=true"):
        agree_with_run(config, RUN, given=())
    with pytest.raises(OrderingConfigError, match=r"OrderingConfig.total_steps = 200 .*train.train_iters = 1000"):
        agree_with_run(OrderingConfig(total_steps=200), RUN, given=())
    scaled = agree_with_run(config, RUN, given=(), scale_schedule_to_run=True)
    assert scaled.total_steps == scaled.mixture_schedule.total_steps == 1000
    assert [p.end for p in scaled.mixture_schedule.phases] == [900, 1000]
    same = OrderingConfig(total_steps=1000, mixture_schedule={**SCHEDULE, "total_steps": 1000})
    assert agree_with_run(same, RUN, given=()).mixture_schedule == same.mixture_schedule
    unknown = RunShape(4, 32, 2, train_iters=None)  # Bridge runs by train_samples: nothing to compare
    assert agree_with_run(config, unknown, given=()).mixture_schedule == config.mixture_schedule


def test_under_a_rampup_the_schedule_counts_full_global_batches():
    """train.rampup_batch_size: 1000 iterations draw fewer samples than 1000 global batches; the
    schedule's steps are the full global batches (ramp_steps), not the iterations."""
    ramp = dataclasses.replace(RUN, ramp_steps=980)
    with pytest.raises(OrderingConfigError, match=r"total_steps = 1000 .*train.train_iters = 1000 iterations "
                                                  r"under train.rampup_batch_size draw 980 full global "
                                                  r"batches.*total_steps=980"):
        agree_with_run(OrderingConfig(total_steps=1000), ramp, given=())
    assert agree_with_run(OrderingConfig(total_steps=980), ramp, given=()).total_steps == 980
    scaled = agree_with_run(OrderingConfig(mixture_schedule=SCHEDULE), ramp, given=(),
                            scale_schedule_to_run=True)
    assert scaled.total_steps == scaled.mixture_schedule.total_steps == 980
    assert [p.end for p in scaled.mixture_schedule.phases] == [882, 980]


def test_warmup_full_against_model_seq_length():
    warmup = {"start": 256, "full": 4096, "warmup_steps": 10}
    with pytest.raises(OrderingConfigError, match=r"seq_length_warmup.full = 4096, but Bridge's "
                                                  r"model.seq_length = 2048.*full: 2048"):
        agree_with_run(OrderingConfig(seq_length_warmup=warmup), RUN, given=())
    ok = OrderingConfig(seq_length_warmup={**warmup, "full": 2048})
    assert agree_with_run(ok, RUN, given=()).seq_length_warmup.full == 2048


def test_missing_split(tmp_path):
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 32, "trimodal")], shard_size=16)
    data = tmp_path / "web"
    assert missing_split(data, "train") is None
    assert "No shards found in split part 'val'" in missing_split(data, "val")
    meta = tmp_path / "meta.yaml"
    meta.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n"
                    f"  train: {{path: {data}}}\n")
    assert missing_split(meta, "val") == "the metadataset has no split 'val'"
    meta.write_text(meta.read_text() + f"  val: {{path: {data}, split_part: train}}\n")
    assert missing_split(meta, "val") is None
