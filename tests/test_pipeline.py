"""The pipeline plan: which stages a configuration gets, in order, decided in one place.

The plan is a pure function of the config and Energon's build arguments, so most of this file
needs no dataset: each shipped recipe's stages are printed and checked, and every refusal is
raised by the plan itself. The last tests build real pipelines and check that the hooks built
exactly what the plan says, and that a build leaves nothing behind on the encoder.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

import pytest
from megatron.energon import WorkerConfig, get_train_dataset

from energon_ordering import OrderingConfig, OrderingConfigError
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder
from energon_ordering.mixture.scheduled_blend import ScheduledBlendDataset
from energon_ordering.packaged_recipes import recipe_names, resolve_recipe
from energon_ordering.pipeline import BuildArgs, Source, current_build, plan_pipeline
from energon_ordering.pool.finite_shuffle_buffer import FiniteShuffleBufferDataset
from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset
from energon_ordering.pool.length_pool_sort import LengthPoolSortDataset
from energon_ordering.pool.pack_pool_sort import PackPoolSortDataset
from energon_ordering.state_stamp import PipelineStampDataset
from energon_ordering.warmup.pack_cap import PackCapDataset
from energon_ordering.warmup.seq_warmup import SeqLenWarmupDataset

#: Every shipped recipe's stages, as planned for micro-batch 4, a shuffle buffer of 100 and two
#: loader workers. A new recipe must be added here.
RECIPE_STAGES = {
    "demo": [
        "load", "RepeatDataset", "FiniteShuffleBufferDataset", "ScheduledBlendDataset",
        "encode_sample", "LengthPoolSortDataset", "SeqLenWarmupDataset", "InputEndDataset", "BatchDataset",
        "PipelineStampDataset",
    ],
    "length_sync_batch": [
        "load", "RepeatDataset", "FiniteShuffleBufferDataset", "encode_sample",
        "LengthPoolSortDataset", "InputEndDataset", "BatchDataset", "PipelineStampDataset",
    ],
    "length_sync_lean": [
        "load", "Defer", "RepeatDataset", "FiniteShuffleBufferDataset", "KeyPoolSortDataset",
        "Materialize", "encode_sample", "InputEndDataset", "BatchDataset", "PipelineStampDataset",
    ],
    "length_sync_reference": [
        "load", "RepeatDataset", "FiniteShuffleBufferDataset", "encode_sample",
        "LengthPoolSortDataset", "InputEndDataset", "BatchDataset", "PipelineStampDataset",
    ],
    "llava_pretrain": [
        "load", "RepeatDataset", "FiniteShuffleBufferDataset", "ScheduledBlendDataset",
        "encode_sample", "LengthPoolSortDataset", "InputEndDataset", "BatchDataset", "PipelineStampDataset",
    ],
    "planned": [
        "PlannedSourceDataset", "encode_sample", "InputEndDataset", "BatchDataset",
        "PipelineStampDataset",
    ],
    "slm_350m_20b": [
        "load", "RepeatDataset", "FiniteShuffleBufferDataset", "ScheduledBlendDataset",
        "encode_sample", "PackCapDataset", "FinitePackingDataset", "PackPoolSortDataset",
        "InputEndDataset", "BatchDataset", "PipelineStampDataset",
    ],
}

#: The class each of the package's stages instantiates (their settings are constructor kwargs).
CLASSES = {
    "FiniteShuffleBufferDataset": FiniteShuffleBufferDataset,
    "ScheduledBlendDataset": ScheduledBlendDataset,
    "KeyPoolSortDataset": KeyPoolSortDataset,
    "LengthPoolSortDataset": LengthPoolSortDataset,
    "PackCapDataset": PackCapDataset,
    "PackPoolSortDataset": PackPoolSortDataset,
    "SeqLenWarmupDataset": SeqLenWarmupDataset,
}


def _recipe_args(cfg: OrderingConfig, **kw) -> BuildArgs:
    names = cfg.mixture_schedule.sources if cfg.mixture_schedule is not None else ("web",)
    kw.setdefault("batch_size", 4)
    kw.setdefault("shuffle_buffer_size", 100)
    kw.setdefault("num_workers", 2)
    return BuildArgs(sources=tuple(Source(name=n) for n in names), **kw)


def test_every_shipped_recipe_is_listed():
    assert sorted(RECIPE_STAGES) == recipe_names()


@pytest.mark.parametrize("name", sorted(RECIPE_STAGES))
def test_recipe_stages(name):
    cfg = OrderingConfig.from_yaml(resolve_recipe(name))
    plan = plan_pipeline(cfg, _recipe_args(cfg))
    text = plan.describe()
    print(f"--- {name}\n{text}")
    assert [s.name for s in plan] == RECIPE_STAGES[name]
    # each stage in order: its settings, then why
    lines = text.splitlines()[1:]
    assert len(lines) == 2 * len(plan.stages)
    for i, stage in enumerate(plan):
        assert lines[2 * i].startswith(f"  {i + 1:2d}. {stage}")
        assert lines[2 * i + 1].strip() == stage.why
    assert str(plan) == text
    assert "encode_sample  [Energon]\n        the task encoder's encode_sample" in text
    # the settings are constructor arguments of the stage's class (the hook adds the rest)
    for stage in plan:
        if stage.name in CLASSES:
            inspect.signature(CLASSES[stage.name]).bind_partial(None, **stage.kwargs)


def test_recipe_settings_are_read_off_the_config():
    slm = OrderingConfig.from_yaml(resolve_recipe("slm_350m_20b"))
    plan = plan_pipeline(slm, _recipe_args(slm))
    assert plan.packing_buffer_size == 256
    assert plan.default_packer
    cap = plan.stage("PackCapDataset").kwargs
    assert cap["pack_seq_length"] == 2048 and cap["warmup"] == slm.seq_length_warmup
    # the pool of packs decides where each pack goes: no per-pack targets from the cap stage
    assert cap["per_pack_targets"] is False and cap["overflow"] == "keep"
    pool = plan.stage("PackPoolSortDataset").kwargs
    assert pool == {"pool_size": 500, "mode": "sample", "batch_size": 4, "seed": 1234}
    blend = plan.stage("ScheduledBlendDataset").kwargs
    # lag compensation: (500 / 4 - 1) / 2 batches per worker, 2 workers
    assert blend["lag_batches"] == pytest.approx(124.0) and blend["policy"] == "deterministic"
    assert plan.stage("RepeatDataset").per_source and plan.stage("FiniteShuffleBufferDataset").per_source

    lean = OrderingConfig.from_yaml(resolve_recipe("length_sync_lean"))
    plan = plan_pipeline(lean, _recipe_args(lean))
    assert plan.stage("KeyPoolSortDataset").kwargs["keep_samples"] is True
    assert plan.stage("Defer").kwargs == {"index_fill": False}  # holds raw samples
    keys = dataclasses.replace(lean, length_sort_pool_holds="keys")
    assert plan_pipeline(keys, _recipe_args(keys)).stage("Defer").kwargs == {"index_fill": True}
    assert plan_pipeline(keys, _recipe_args(keys, index_fill=False)).stage("Defer").kwargs == {
        "index_fill": False
    }


def test_off_by_default_and_energon_blend_described():
    plan = plan_pipeline(OrderingConfig(), BuildArgs(batch_size=2))
    assert [s.name for s in plan] == ["load", "RepeatDataset", "encode_sample", "InputEndDataset", "BatchDataset",
                                      "PipelineStampDataset"]
    weighted = BuildArgs(batch_size=2, blend_mode="dataset_weight",
                         sources=(Source(weight=1), Source(weight=9)))
    blend = plan_pipeline(OrderingConfig(), weighted).stage("BlendDataset")
    assert blend.kwargs == {"mode": "dataset_weight", "weights": (1.0, 9.0)} and blend.energon
    # found by review (7 December 2026): Energon's bare AssertionError at the first batch
    for bad in (0.0, -1.0, float("nan")):
        zero = BuildArgs(batch_size=2, blend_mode="dataset_weight",
                         sources=(Source(weight=bad), Source(weight=1)))
        for cfg in (OrderingConfig(), OrderingConfig(length_sort_pool_size=8,
                                                     length_sort_mode="batch")):
            with pytest.raises(OrderingConfigError, match=r"blend weights are \{'entry 0': "
                               r".*give every `blend:` entry a weight > 0"):
                plan_pipeline(cfg, zero)
    epochized = BuildArgs(batch_size=2, blend_mode="sample_repetitions", repeat=False,
                          sources=(Source(repetitions=2), Source(repetitions=1)))
    names = [s.name for s in plan_pipeline(OrderingConfig(), epochized)]
    assert names == ["load", "RepeatDataset", "BlendDataset", "encode_sample", "InputEndDataset", "BatchDataset",
                     "PipelineStampDataset"]


def test_packing_paths():
    pool = OrderingConfig(length_sort_pool_size=8, pack_seq_length=512)
    samples = dataclasses.replace(pool, pack_pool_placement="samples")
    plain = OrderingConfig()
    args = BuildArgs(batch_size=2, packing_buffer_size=16, own_select_samples_to_pack=True)
    assert [s.name for s in plan_pipeline(pool, args)][3:8] == [
        "PackCapDataset", "FinitePackingDataset", "PackPoolSortDataset", "InputEndDataset", "BatchDataset"]
    assert [s.name for s in plan_pipeline(samples, args)][2:6] == [
        "encode_sample", "LengthPoolSortDataset", "PackCapDataset", "FinitePackingDataset"]
    # packing alone (the encoder's own packer): still the cap stage (a no-op without a target)
    # and the finite-safe packer, so a finite epoch resumes exactly there too
    plan = plan_pipeline(plain, args)
    assert [s.name for s in plan][3:7] == ["PackCapDataset", "FinitePackingDataset", "InputEndDataset", "BatchDataset"]
    assert plan.stage("FinitePackingDataset").energon
    # the config's packing buffer turns packing on without the build argument
    via_config = OrderingConfig(packing_buffer_size=16, pack_seq_length=512)
    assert plan_pipeline(via_config, BuildArgs(batch_size=2)).packing_buffer_size == 16
    # with packing the warmup is applied by the cap stage, not at batch time
    warm = OrderingConfig(seq_length_warmup={"start": 64, "full": 512, "warmup_steps": 4})
    assert plan_pipeline(warm, BuildArgs(batch_size=2)).has("SeqLenWarmupDataset")
    packed = plan_pipeline(warm, BuildArgs(batch_size=2, packing_buffer_size=8))
    assert not packed.has("SeqLenWarmupDataset") and packed.has("PackCapDataset")
    assert packed.stage("PackCapDataset").kwargs["per_pack_targets"] is True


def test_plan_is_immutable():
    plan = plan_pipeline(OrderingConfig(length_sort_pool_size=4), BuildArgs(batch_size=2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stages = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stage("LengthPoolSortDataset").settings = ()  # type: ignore[misc]
    assert isinstance(plan.stages, tuple)
    assert plan == plan_pipeline(OrderingConfig(length_sort_pool_size=4), BuildArgs(batch_size=2))


# ---- refusals, without a dataset --------------------------------------------------------------

REFUSALS = {
    "packing-buffer-given-twice": (
        OrderingConfig(packing_buffer_size=8, pack_seq_length=2048),
        BuildArgs(batch_size=2, packing_buffer_size=16),
        r"OrderingConfig.packing_buffer_size = 8 contradicts "
        r"get_train_dataset\(packing_buffer_size=16\); give it once",
    ),
    "pool-of-packs-before-encoding": (
        OrderingConfig(length_sort_pool_size=8, length_sort_placement="pre-encode",
                       pack_seq_length=512),
        BuildArgs(batch_size=2, packing_buffer_size=16),
        r"pack_pool_placement = 'packs' pools packs after packing.*use pack_pool_placement = "
        r"'samples' with the pre-encode pool",
    ),
    "default-packer-without-target": (
        OrderingConfig(length_sort_pool_size=8),
        BuildArgs(batch_size=2, packing_buffer_size=32, encoder="MyTE"),
        r"MyTE has no select_samples_to_pack, so packing \(packing_buffer_size = 32\).*needs "
        r"OrderingConfig.pack_seq_length",
    ),
    "grouping-with-pool-and-warmup": (
        OrderingConfig(length_sort_pool_size=8,
                       seq_length_warmup={"start": 64, "full": 512, "warmup_steps": 4}),
        BuildArgs(batch_size=2, own_batch_group_criterion=True, encoder="MyTE"),
        r"OrderingConfig.length_sort_pool_size = 8 and seq_length_warmup cannot be combined "
        r"with MyTE.batch_group_criterion",
    ),
    "batch-mode-without-batching": (
        OrderingConfig(length_sort_pool_size=8, length_sort_mode="batch"),
        BuildArgs(batch_size=None),
        r"length_sort_mode = 'batch' needs batching; pass batch_size",
    ),
    "schedule-with-epochized-blend": (
        OrderingConfig(mixture_schedule={"sources": {"a": {"weight": 1}, "b": {"weight": 1}}}),
        BuildArgs(batch_size=2, sources=(Source(name="a", repetitions=2), Source(name="b"))),
        r"entries \['a'\] use `blend_epochized` repetitions",
    ),
    "schedule-with-shared-names": (
        OrderingConfig(mixture_schedule={"sources": {"a": {"weight": 1}}}),
        BuildArgs(batch_size=2, sources=(Source(name="a"), Source(name="a"))),
        r"share source names \['a', 'a'\]; give each blend entry its own `subflavors: "
        r"\{source: NAME\}`",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(case):
    cfg, args, match = REFUSALS[case]
    with pytest.raises(OrderingConfigError, match=match):
        plan_pipeline(cfg, args)


def test_refusals_need_their_stage():
    """The same settings pass where the stage they concern is off."""
    plan_pipeline(OrderingConfig(), BuildArgs(batch_size=2, own_batch_group_criterion=True))
    plan_pipeline(OrderingConfig(length_sort_pool_size=8), BuildArgs(batch_size=None))
    plan_pipeline(OrderingConfig(length_sort_pool_size=8, pack_seq_length=512),
                  BuildArgs(batch_size=2, packing_buffer_size=8))
    plan_pipeline(OrderingConfig(), BuildArgs(batch_size=2, sources=(Source(repetitions=2),)))


# ---- the hooks build what the plan says -------------------------------------------------------


def _chain(dataset) -> list[str]:
    """Class names from the top of a built pipeline down its first source."""
    out = []
    while dataset is not None:
        out.append(type(dataset).__name__)
        inner = getattr(dataset, "dataset", None)
        if inner is None and getattr(dataset, "datasets", None):
            first = dataset.datasets[0]
            inner = first[1] if isinstance(first, tuple) else first
        dataset = inner
    return out


BUILT = {
    "pool": OrderingConfig(length_sort_pool_size=8, length_sort_mode="batch"),
    "warmup": OrderingConfig(seq_length_warmup={"start": 32, "full": 512, "warmup_steps": 3}),
    "packs": OrderingConfig(length_sort_pool_size=4, packing_buffer_size=8, pack_seq_length=512),
    "pack-samples": OrderingConfig(length_sort_pool_size=8, packing_buffer_size=8,
                                   pack_seq_length=512, pack_pool_placement="samples"),
}


@pytest.mark.parametrize("case", list(BUILT))
def test_hooks_build_the_plan_and_leave_no_state(small_dataset, case):
    te = SyntheticTaskEncoder()
    te.ordering = BUILT[case]
    before = dict(vars(te))
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    kw = dict(batch_size=4, worker_config=wc, task_encoder=te, shuffle_buffer_size=8,
              max_samples_per_sequence=8)
    ds = get_train_dataset(small_dataset, **kw)
    assert isinstance(ds, PipelineStampDataset)
    chain = _chain(ds)
    ours = {"FiniteShuffleBufferDataset", "LengthPoolSortDataset", "PackCapDataset",
            "FinitePackingDataset", "PackPoolSortDataset", "SeqLenWarmupDataset", "PipelineStampDataset"}
    planned = [s.name for s in reversed(_plan_of(te, small_dataset, kw).stages) if s.name in ours]
    assert [c for c in chain if c in ours] == planned
    # nothing of the build stays on the encoder, and no build is active any more
    assert vars(te) == before and current_build(te) is None


def _plan_of(te, path, kw):
    """The plan ``te`` makes for Energon's arguments of ``get_train_dataset(path, **kw)``."""
    seen = []

    class Spy(type(te)):
        def build_train_datasets(self, **kwargs):
            seen.append(self.ordering_plan(**kwargs))
            return super().build_train_datasets(**kwargs)

    spy = Spy()
    spy.ordering = te.ordering
    get_train_dataset(path, **{**kw, "task_encoder": spy})
    return seen[0]


def test_a_failed_build_leaves_no_active_build(small_dataset):
    te = SyntheticTaskEncoder()
    te.ordering = OrderingConfig(length_sort_pool_size=10_000)  # larger than the data: refused
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    with pytest.raises(OrderingConfigError, match=r"larger than a loader worker's share"):
        get_train_dataset(small_dataset, batch_size=4, worker_config=wc, task_encoder=te,
                          shuffle_buffer_size=None, max_samples_per_sequence=8)
    assert current_build(te) is None


def test_a_build_is_private_to_its_thread(small_dataset):
    """Two threads building with one encoder do not see each other's plan (attributes set on
    the encoder for the call would be shared)."""
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    inside, seen_elsewhere = threading.Event(), []
    release = threading.Event()

    class Pausing(SyntheticTaskEncoder):
        def build_encode_sample(self, dataset, *, worker_config):
            inside.set()
            release.wait(30)
            return super().build_encode_sample(dataset, worker_config=worker_config)

    te = Pausing()
    te.ordering = OrderingConfig(length_sort_pool_size=8)
    worker = threading.Thread(target=get_train_dataset, args=(small_dataset,), kwargs=dict(
        batch_size=4, worker_config=wc, task_encoder=te, shuffle_buffer_size=None,
        max_samples_per_sequence=8))
    worker.start()
    try:
        assert inside.wait(60)
        seen_elsewhere.append(current_build(te))
    finally:
        release.set()
        worker.join(60)
    assert seen_elsewhere == [None]
