"""``length_sort_mode: planned`` on real pipelines: every rank reads the plan's micro-batches,
exact resume, the refusals (issue 23).

Real prepared datasets with length indexes, real ``get_train_dataset`` + ``get_savable_loader``
per simulated rank (``WorkerConfig(rank=r, world_size=R)``); the expected order is computed
directly with :func:`energon_ordering.planned.window.plan_window`.
"""

from __future__ import annotations

import dataclasses

import itertools
import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
from megatron.energon import WorkerConfig, load_dataset

from energon_ordering import OrderingConfig
from energon_ordering.errors import LengthIndexError, OrderingConfigError, StateMismatchError
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    record_batch,
    resume,
    run_ranks,
    run_saving_every_step,
    run_with_cuts,
)
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.index import LengthIndex
from energon_ordering.pipeline.planned_source import PlannedSourceDataset
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.window import plan_window, window_weights
from energon_ordering.pool.byte_range_reader import ByteRangeReader
from energon_ordering.state_stamp import restore_state_rank
import sys

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

B, M, K = 4, 2, 2


def planned(**kw) -> OrderingConfig:
    return OrderingConfig(**{**dict(length_sort_mode="planned", length_sort_placement="pre-encode",
                                    length_sort_pool_holds="keys", micro_batches_per_step=M,
                                    seed=5, plan_window_steps=K, planned_mix="step"), **kw})


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two indexed sources (web: short, code: long; weights 0.7 / 0.3) and their metadataset."""
    return indexed_synthetic(
        tmp_path_factory.mktemp("planned"),
        [SourceSpec("web", 160, "short", weight=0.7), SourceSpec("code", 96, "long", weight=0.3)],
        shard_size=32)


def _readers(path: Path) -> list[ByteRangeReader]:
    """Byte-range readers of the sources of ``path`` (a dataset or the metadataset), in
    Energon's shard order, with their length indexes: the test's own view of the sample ids."""
    folders = [path] if path.is_dir() else [path.parent / "web", path.parent / "code"]
    readers = []
    for folder in folders:
        wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
        factory = load_dataset(folder).get_datasets(
            training=True, split_part="train", worker_config=wc,
        ).datasets[0].dataset
        shards = [(s.name, s.count) for s in factory.shards]
        index = LengthIndex.open(folder)
        readers.append(ByteRangeReader(folder, shards, lengths=index.path))
    return readers


def expected_keys(path: Path, weights: list[float], world_size: int, micro_batches: int
                  ) -> list[list[tuple[str, ...]]]:
    """``keys[rank][b]``: the plan's samples of each rank's micro-batch b, from plan_window."""
    readers = _readers(path)
    lengths = [np.array([r.visit(i)[2] for i in range(len(r))]) for r in readers]
    sizes = [len(x) for x in lengths]
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    cursor = PlanCursor.start(len(readers))
    out: list[list[tuple[str, ...]]] = [[] for _ in range(world_size)]
    w = np.asarray(weights) / sum(weights)
    while len(out[0]) < micro_batches:
        plan = plan_window(lengths, seed=5, cursor=cursor,
                           weights=window_weights(w, cursor.window, K), window_steps=K,
                           world_size=world_size, micro_batch=B, micro_batches_per_step=M)
        for t in range(K):
            for r in range(world_size):
                for m in range(M):
                    keys = []
                    for gid in plan.ids[t, r, m]:
                        s = int(np.searchsorted(offsets, gid, side="right") - 1)
                        keys.append(readers[s].key(int(gid - offsets[s])))
                    out[r].append(tuple(keys))
        cursor = plan.next_cursor
    return [rank[:micro_batches] for rank in out]


@pytest.mark.parametrize("which", ["dataset", "metadataset"])
def test_every_rank_reads_the_plans_micro_batches(data, which):
    path = data.parent / "web" if which == "dataset" else data
    weights = [1.0] if which == "dataset" else [0.7, 0.3]
    steps = 10  # 5 optimizer steps: windows 0, 1 and 2
    records = run_ranks(path, ordering=planned(), world_size=3, steps=steps, batch_size=B,
                        task_encoder_factory=IndexedSyntheticTaskEncoder)
    want = expected_keys(path, weights, 3, steps)
    for rank in range(3):
        assert [r.keys for r in records[rank]] == want[rank]
    if which == "metadataset":
        # every optimizer step (all ranks, M micro-batches) holds each source's exact count
        G = 3 * M * B
        for step in range(steps // M):
            keys = [k for r in range(3) for b in range(step * M, step * M + M)
                    for k in records[r][b].keys]
            web = sum(k.startswith("web") for k in keys)
            assert abs(web - 0.7 * G) <= 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_at_cuts(data, num_workers):
    def make():
        return build_train_loader(data, ordering=planned(), rank=1, world_size=3,
                                  num_workers=num_workers, batch_size=B,
                                  task_encoder_factory=IndexedSyntheticTaskEncoder)

    total = 12
    cuts = [0, 3, 6, total - 1]  # the last cut: before the last micro-batch
    records, states = run_with_cuts(make, total, cuts)
    if num_workers == 0:
        assert [r.keys for r in records] == expected_keys(data, [0.7, 0.3], 3, total)[1]
    for cut in cuts:
        assert resume(make, states[cut], total - cut) == records[cut:], cut


@pytest.mark.slow
def test_loader_workers_deliver_the_same_order(data):
    """Micro-batch b from loader worker b % num_workers: 2 workers give the 0-worker order."""
    runs = [run_ranks(data, ordering=planned(), world_size=3, steps=8, batch_size=B,
                      num_workers=w, task_encoder_factory=IndexedSyntheticTaskEncoder)
            for w in (0, 2)]
    assert runs[0] == runs[1]


def _pool_cfg() -> OrderingConfig:
    return OrderingConfig(length_sort_pool_size=32, length_sort_mode="batch", seed=5,
                          length_sort_placement="pre-encode", length_sort_pool_holds="keys",
                          micro_batches_per_step=M)


@pytest.mark.parametrize("saved,restored", [("pool", "planned"), ("planned", "pool")])
def test_state_of_the_other_mode_is_refused(data, saved, restored):
    cfgs = {"pool": _pool_cfg(), "planned": planned()}

    def make(cfg):
        return build_train_loader(data, ordering=cfg, batch_size=B,
                                  task_encoder_factory=IndexedSyntheticTaskEncoder)

    _, states = run_with_cuts(lambda: make(cfgs[saved]), 3, [2])
    loader = make(cfgs[restored])
    with pytest.raises(StateMismatchError, match="length_sort_mode: saved"):
        restore_state_rank(loader, states[2])


def test_the_pipeline_has_the_planned_source_and_no_energon_walk(data):
    loader = build_train_loader(data, ordering=planned(), batch_size=B,
                                task_encoder_factory=IndexedSyntheticTaskEncoder)
    stages, stack = [], [loader.dataset]
    while stack:
        ds = stack.pop()
        stages.append(type(ds).__name__)
        stack.extend([ds.dataset] if hasattr(ds, "dataset") else [])
    assert stages[-1] == PlannedSourceDataset.__name__
    assert "WebdatasetSampleLoaderDataset" not in stages and "BlendDataset" not in stages
    assert "ShuffleBufferDataset" not in stages


def test_unused_energon_settings_are_logged_once(data, caplog):
    with caplog.at_level(logging.INFO, logger="energon_ordering.task_encoder"):
        build_train_loader(data, ordering=planned(), batch_size=B, shuffle_buffer_size=32,
                           max_samples_per_sequence=16,
                           task_encoder_factory=IndexedSyntheticTaskEncoder)
    lines = [r.getMessage() for r in caplog.records if "planned" in r.getMessage()]
    assert len(lines) == 1
    assert "shuffle_buffer_size = 32" in lines[0] and "max_samples_per_sequence" in lines[0]


def test_a_dataset_without_length_index_is_refused(data, tmp_path):
    # the indexes are looked for in an empty folder: none for either source
    with pytest.raises(LengthIndexError, match="no length index"):
        build_train_loader(data, ordering=planned(length_index_dir=str(tmp_path)), batch_size=B,
                           task_encoder_factory=IndexedSyntheticTaskEncoder)


@pytest.mark.filterwarnings("ignore:length index .* was computed by test")
def test_a_length_index_missing_samples_is_refused(data, tmp_path):
    # an index of the web dataset without its last 10 keys, in a folder of its own
    from energon_ordering.length_index.index import write_length_index

    web = data.parent / "web"
    reader = _readers(web)[0]
    pairs = [reader.visit(i)[1:] for i in range(len(reader) - 10)]
    write_length_index(web, pairs, computed_by="test", index_dir=tmp_path)
    with pytest.raises(LengthIndexError, match=r"sample 'web-\d+' .* is not in the length index"):
        build_train_loader(web, ordering=planned(length_index_dir=str(tmp_path)), batch_size=B,
                           task_encoder_factory=IndexedSyntheticTaskEncoder)


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=None), "batch_size"),
])
def test_unsupported_builds_are_refused(data, kwargs, match):
    with pytest.raises(OrderingConfigError, match=match):
        build_train_loader(data, ordering=planned(), task_encoder_factory=IndexedSyntheticTaskEncoder,
                           **{"batch_size": B, **kwargs})


# -- configuration ---------------------------------------------------------------------------


def test_planned_config_defaults_the_window():
    from energon_ordering.planned.window import DEFAULT_WINDOW_STEPS

    cfg = OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                         length_sort_pool_holds="keys")
    assert cfg.planned and not cfg.length_sort_enabled
    assert cfg.plan_window_steps is None  # the mix's default, for the global batch
    assert cfg.window_steps(8192, 4) == (1 << 22) // (8192 * 4)  # auto: the window mix's
    step = dataclasses.replace(cfg, planned_mix="step")
    assert step.window_steps(8192, 4) == DEFAULT_WINDOW_STEPS
    assert OrderingConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("kwargs,match", [
    (dict(length_sort_pool_size=1024), r"length_sort_pool_size = 1024.*plan_window_steps"),
    (dict(plan_window_steps=0), r"plan_window_steps = 0.*int >= 1"),
    (dict(plan_window_steps=2.5), r"plan_window_steps = 2.5"),
    (dict(length_sort_placement="post-encode", length_sort_pool_holds="raw"),
     r"length_sort_placement = 'post-encode'.*'pre-encode'"),
    (dict(length_sort_pool_holds="raw"), r"length_sort_pool_holds = 'raw'.*'keys'"),
])
def test_planned_config_refusals(kwargs, match):
    base = dict(length_sort_mode="planned", length_sort_placement="pre-encode",
                length_sort_pool_holds="keys")
    with pytest.raises(OrderingConfigError, match=match):
        OrderingConfig(**{**base, **kwargs})


def test_plan_window_steps_outside_planned_mode_is_refused():
    with pytest.raises(OrderingConfigError, match=r"plan_window_steps = 8 applies to "
                       r"length_sort_mode = 'planned' only"):
        OrderingConfig(length_sort_pool_size=64, length_sort_mode="batch", plan_window_steps=8)


def test_a_recipe_takes_the_planned_keys(tmp_path):
    recipe = tmp_path / "planned.yaml"
    recipe.write_text("length_sort_mode: planned\nplacement: pre-encode\n"
                      "length_sort_pool_holds: keys\nmicro_batches_per_step: 4\nseed: 7\n"
                      "plan_window_steps: 16\n")
    cfg = OrderingConfig.from_yaml(recipe)
    assert (cfg.length_sort_mode, cfg.plan_window_steps, cfg.micro_batches_per_step) == (
        "planned", 16, 4)
    recipe.write_text("length_sort_mode: planned\nplacement: pre-encode\n"
                      "length_sort_pool_holds: keys\nlength_sort_pool_size: 4096\n")
    with pytest.raises(OrderingConfigError, match=r"planned\.yaml: .*plan_window_steps"):
        OrderingConfig.from_yaml(recipe)


# -- elastic resume --------------------------------------------------------------------------

EK = 4  # plan_window_steps of the elastic tests: a restore inside a window re-plans its tail


def _loader(data, world_size, mbps, rank, num_workers=0):
    return build_train_loader(data, ordering=planned(micro_batches_per_step=mbps,
                                                     plan_window_steps=EK),
                              rank=rank, world_size=world_size, num_workers=num_workers,
                              batch_size=B, task_encoder_factory=IndexedSyntheticTaskEncoder)


def _steps(records, mbps):
    """``records[rank][micro-batch]`` -> per optimizer step, the sorted keys of all ranks."""
    n = len(records[0]) // mbps
    return [sorted(k for rank in records for b in rank[s * mbps:(s + 1) * mbps] for k in b.keys)
            for s in range(n)]


def _run(data, world_size, mbps, start_step, end_step, state=None, num_workers=0):
    """Steps ``start_step..end_step-1`` on every rank (each restored from ``state``, one rank's
    state, if given); returns the per-step keys and rank 0's state after the last step."""
    records, end_state = [], None
    for rank in range(world_size):
        loader = _loader(data, world_size, mbps, rank, num_workers)
        if state is not None:
            restore_state_rank(loader, state)
        it = iter(loader)
        records.append([record_batch(next(it)) for _ in range((end_step - start_step) * mbps)])
        if rank == 0:
            end_state = pickle.loads(pickle.dumps(loader.save_state_rank()))
        del it
        close_loader(loader)
    return _steps(records, mbps), end_state


@pytest.mark.parametrize("shapes", [
    [(4, 1), (2, 2)],          # 4 -> 2 ranks
    [(4, 1), (2, 2), (4, 1)],  # 4 -> 2 -> 4 ranks, both inside one window
])
def test_elastic_resume_continues_the_global_order(data, shapes):
    end = 3 * EK  # windows 0, 1 and 2
    bounds = [0, EK + 1, EK + 3][: len(shapes)] + [end]  # the restores fall inside window 1
    whole, _ = _run(data, *shapes[0], 0, end)
    spliced, state = [], None
    for shape, start, stop in zip(shapes, bounds, bounds[1:]):
        part, state = _run(data, *shape, start, stop, state=state)  # rank 0's file only
        spliced += part
    assert len(spliced) == end
    flat_whole = [k for s in whole for k in s]
    flat_spliced = [k for s in spliced for k in s]
    # no source epoch ends in these steps: every sample once, the same samples as uninterrupted
    assert len(flat_spliced) == len(set(flat_spliced)) == len(flat_whole)
    assert set(flat_spliced) == set(flat_whole)
    # each window holds the same samples, each step the same count per source
    for w in range(3):
        win = slice(w * EK, (w + 1) * EK)
        assert sorted(k for s in spliced[win] for k in s) == sorted(k for s in whole[win] for k in s)
    # every step holds the samples of the uninterrupted run (dealt onto other ranks)
    assert spliced == whole


@pytest.mark.slow  # both variants start loader workers
@pytest.mark.parametrize("num_workers", [0, 2])
def test_elastic_resume_onto_other_loader_workers(data, num_workers):
    """A state saved with 0 loader workers continues with 3, and one saved with 2 with 0, at
    the same data-parallel size: the very same order (every rank restored from rank 0's file)."""
    other = 3 if num_workers == 0 else 0
    end = 3 * EK
    whole, _ = _run(data, 2, 2, 0, end, num_workers=num_workers)
    first, state = _run(data, 2, 2, 0, EK + 1, num_workers=num_workers)
    rest, _ = _run(data, 2, 2, EK + 1, end, state=state, num_workers=other)
    assert first + rest == whole  # same shape: the very same order


def test_elastic_resume_keeps_the_global_batch(data):
    _, state = _run(data, 4, 1, 0, 2)
    loader = _loader(data, 2, 1, 0)
    with pytest.raises(StateMismatchError, match=r"global batch.*micro_batches_per_step = 2"):
        restore_state_rank(loader, state)


def test_pool_modes_still_refuse_another_world_size(data):
    def make(world_size):
        return build_train_loader(data, ordering=_pool_cfg(), world_size=world_size, batch_size=B,
                                  task_encoder_factory=IndexedSyntheticTaskEncoder)

    _, states = run_with_cuts(lambda: make(2), 2, [1])
    with pytest.raises(StateMismatchError, match="world_size: saved 2 != configured 1"):
        restore_state_rank(make(1), states[1])


# -- finite epochs ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["dataset", "metadataset"])
def test_a_finite_epoch_ends_at_the_same_step_on_every_rank(data, which):
    path = data.parent / "web" if which == "dataset" else data
    records = run_ranks(path, ordering=planned(), world_size=3, steps=None, repeat=False,
                        batch_size=B, task_encoder_factory=IndexedSyntheticTaskEncoder)
    G = 3 * M * B
    # web alone: 160 // 24 = 6 steps; the blend: web (0.7 x 24 = 16.8 per step) runs out first,
    # after 9 steps (151 of its 160 samples)
    steps = 6 if which == "dataset" else 9
    assert [len(r) for r in records] == [steps * M] * 3
    keys = [k for rank in records for b in rank for k in b.keys]
    assert len(keys) == len(set(keys)) == steps * G  # each sample at most once in the epoch
    assert records == run_ranks(path, ordering=planned(), world_size=3, steps=None, repeat=False,
                                batch_size=B, task_encoder_factory=IndexedSyntheticTaskEncoder)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_finite_epoch_resumes_exactly_and_to_nothing_after_its_last_step(data, num_workers):
    def make():
        return build_train_loader(data, ordering=planned(), rank=2, world_size=3, repeat=False,
                                  num_workers=num_workers, batch_size=B,
                                  task_encoder_factory=IndexedSyntheticTaskEncoder)

    records, states = run_saving_every_step(make)
    assert len(records) == 9 * M and len(states) == len(records) + 1
    for cut in (0, 5, len(records) - 1, len(records)):  # the last: after the last step
        loader = make()
        restore_state_rank(loader, pickle.loads(states[cut]))
        assert [record_batch(b) for b in loader] == records[cut:], cut
        close_loader(loader)


def test_the_next_finite_epoch_draws_every_source_anew(data):
    loader = build_train_loader(data, ordering=planned(), repeat=False, batch_size=B,
                                task_encoder_factory=IndexedSyntheticTaskEncoder)
    epochs = [[k for b in loader for k in record_batch(b).keys] for _ in range(2)]
    close_loader(loader)
    assert len(epochs[0]) == len(epochs[1]) > 0
    assert len(set(epochs[1])) == len(epochs[1])
    assert epochs[0] != epochs[1]  # another permutation of each source


def test_the_plan_of_a_planned_pipeline():
    from energon_ordering.pipeline import BuildArgs, plan_pipeline

    plan = plan_pipeline(planned(), BuildArgs(batch_size=B, shuffle_buffer_size=100))
    names = [s.name for s in plan]
    assert names == ["PlannedSourceDataset", "encode_sample", "InputEndDataset", "BatchDataset",
                     "PipelineStampDataset"]
    assert plan.stage("PlannedSourceDataset").kwargs["window_steps"] == K
    packed = plan_pipeline(planned(pack_seq_length=64),
                           BuildArgs(batch_size=B, packing_buffer_size=8))
    assert [s.name for s in packed] == [
        "PlannedSourceDataset", "encode_sample", "PlannedPackDataset", "InputEndDataset",
        "BatchDataset", "PipelineStampDataset"]
    with pytest.raises(OrderingConfigError, match="pack_seq_length"):
        plan_pipeline(planned(), BuildArgs(batch_size=B, packing_buffer_size=8))


# -- a step schedule ---------------------------------------------------------------------------

SWITCH = {"total_steps": 8, "phases": [{"until": 0.5, "weights": {"web": 0.8, "code": 0.2}},
                                        {"until": 1.0, "weights": {"web": 0.2, "code": 0.8}}]}


def test_a_schedule_sets_every_steps_counts_across_a_phase_switch(data):
    # windows of 3 steps: the switch at step 4 falls inside the second window; 6 steps (two
    # whole windows) draw neither source past its first epoch
    cfg = planned(mixture_schedule=SWITCH, plan_window_steps=3)
    steps = 6
    records = run_ranks(data, ordering=cfg, world_size=3, steps=steps * M, batch_size=B,
                        task_encoder_factory=IndexedSyntheticTaskEncoder)
    G = 3 * M * B
    web = [sum(k.startswith("web") for r in records for b in r[s * M:(s + 1) * M] for k in b.keys)
           for s in range(steps)]
    want = [0.8 * G] * 4 + [0.2 * G] * (steps - 4)
    assert all(abs(w - x) < 1 for w, x in zip(web, want)), web
    assert all(abs(sum(web[:s]) - sum(want[:s])) < 1 for s in range(steps + 1))  # the carry
    keys = [k for r in records for b in r for k in b.keys]
    assert len(keys) == len(set(keys)) == steps * G


def test_a_schedule_over_other_sources_is_refused(data):
    other = {"sources": {"web": {"weight": 1.0}, "books": {"weight": 1.0}}}
    with pytest.raises(OrderingConfigError, match=r"names the sources \['web', 'books'\].*"
                       r"\['web', 'code'\]"):
        build_train_loader(data, ordering=planned(mixture_schedule=other), batch_size=B,
                           task_encoder_factory=IndexedSyntheticTaskEncoder)


@pytest.mark.parametrize("before,after", [
    ((3, 2, 0), (6, 1, 0)),
    pytest.param((3, 2, 2), (3, 2, 3), marks=pytest.mark.slow),
], ids=["3x2-to-6x1-ranks", "2-to-3-workers"])
def test_elastic_resume_of_a_finite_epoch_draws_every_sample_once(data, before, after):
    """(ranks, micro-batches per step, loader workers) change inside a finite epoch, with the
    same global batch: the epoch's samples, each once; a state after its last step resumes to
    nothing."""
    def make(world_size, mbps, workers, rank):
        return build_train_loader(
            data, ordering=planned(micro_batches_per_step=mbps, plan_window_steps=4),
            rank=rank, world_size=world_size, num_workers=workers, repeat=False, batch_size=B,
            task_encoder_factory=IndexedSyntheticTaskEncoder)

    whole = [run_saving_every_step(lambda: make(*before, r)) for r in range(before[0])]
    epoch = sorted(k for records, _ in whole for b in records for k in b.keys)
    cut = 5 * 2  # before step 5 (inside the second window of 4 steps)
    first = [k for records, _ in whole for b in records[:cut] for k in b.keys]
    rest = []
    for rank in range(after[0]):
        loader = make(*after, rank)
        restore_state_rank(loader, pickle.loads(whole[0][1][cut]))  # rank 0's file only
        rest += [k for b in loader for k in record_batch(b).keys]
        close_loader(loader)
    assert sorted(first + rest) == epoch and len(set(epoch)) == len(epoch)
    # after the last step: saved before the end was met, and after it (the epoch over)
    ended = make(*before, 0)
    assert len(list(ended)) == len(whole[0][0])
    for state in (pickle.loads(whole[0][1][-1]), ended.save_state_rank()):
        loader = make(*after, after[0] - 1)
        restore_state_rank(loader, state)
        assert list(loader) == []
        close_loader(loader)
    close_loader(ended)


def test_prefetched_reads_give_the_same_order(data):
    """The byte ranges of the current and next micro-batch are read on prefetch threads; the
    order is the plan's either way."""
    def run(threads):
        loader = build_train_loader(data, ordering=planned(), rank=1, world_size=3, batch_size=B,
                                    task_encoder_factory=IndexedSyntheticTaskEncoder)
        stack, source = [loader.dataset], None
        while source is None:
            ds = stack.pop()
            source = ds if isinstance(ds, PlannedSourceDataset) else None
            stack.extend([ds.dataset] if hasattr(ds, "dataset") else [])
        source.prefetch_threads = threads
        it = iter(loader)
        records = [record_batch(next(it)) for _ in range(6)]
        used = source._executor is not None
        del it
        close_loader(loader)
        return records, used

    (on, used_on), (off, used_off) = run(2), run(0)
    assert on == off and used_on and not used_off


@pytest.mark.slow  # imports megatron-core (~10 s)
def test_megatron_restore_reads_dprank0_at_another_data_parallel_size(data, tmp_path, caplog):
    """Megatron-LM: saved at 2 data-parallel ranks (2 micro-batches per step), resumed at 4 (1
    per step); rank 3 has no file of its own and continues from dprank 0's, honouring the
    iteration."""
    import argparse

    import torch

    from energon_ordering.integrations.megatron_lm import (
        DataloaderRestoreError,
        _restore,
        dataloader_state_path,
    )

    _, state = _run(data, 2, 2, 0, 3)  # 3 iterations at 2 ranks: rank 0's state
    for iteration in (3, 4):
        path = dataloader_state_path(tmp_path / "dl", iteration, 0)
        path.parent.mkdir(parents=True)
        torch.save({"dataloader_state_dict": state}, path)

    def args(iteration):
        return argparse.Namespace(load=str(tmp_path / "ckpt"), iteration=iteration,
                                  dataloader_save=str(tmp_path / "dl"), micro_batch_size=B,
                                  global_batch_size=16, data_parallel_size=4,
                                  allow_dataloader_restart=False)

    loader = _loader(data, 4, 1, 3)
    with caplog.at_level(logging.WARNING, logger="energon_ordering.integrations.megatron_lm"):
        _restore(loader, args=args(3), dp_rank=3)
    assert "continues from data-parallel rank 0's" in caplog.text
    it = iter(loader)
    got = [record_batch(next(it)) for _ in range(3)]
    del it
    close_loader(loader)
    direct = _loader(data, 4, 1, 3)
    assert resume(lambda: direct, state, 3) == got
    loader = _loader(data, 4, 1, 3)
    with pytest.raises(DataloaderRestoreError, match="saved after 6 micro-batches"):
        _restore(loader, args=args(4), dp_rank=3)
    close_loader(loader)


@pytest.fixture(scope="module")
def larger(tmp_path_factory) -> Path:
    """Two indexed sources of 1,100 and 700 samples (weights 0.7 / 0.3): a finite epoch of
    several steps at 8 ranks."""
    return indexed_synthetic(
        tmp_path_factory.mktemp("planned_larger"),
        [SourceSpec("web", 1100, "short", weight=0.7), SourceSpec("code", 700, "long", weight=0.3)],
        shard_size=64)


@pytest.mark.slow  # 30 real rank pipelines
@pytest.mark.parametrize("shapes,cuts", [
    ([(8, 3), (6, 4), (8, 3)], [3, 7]),  # 8 -> 6 -> 8 ranks, the global batch 96 each time
    ([(4, 2), (2, 4)], [5]),             # 4 -> 2 ranks
], ids=["8-6-8-ranks", "4-2-ranks"])
def test_elastic_resumes_in_a_chain_draw_a_finite_epoch_once(larger, shapes, cuts):
    """A finite epoch run on R1 ranks, saved at an optimizer step, resumed from rank 0's file
    on R2 ranks, saved again and resumed on R3: the epoch's samples, each exactly once, and the
    same as the uninterrupted run's."""
    def make(world_size, mbps, rank):
        return build_train_loader(
            larger, ordering=planned(micro_batches_per_step=mbps, plan_window_steps=4),
            rank=rank, world_size=world_size, repeat=False, batch_size=B,
            task_encoder_factory=IndexedSyntheticTaskEncoder)

    whole = [k for r in range(shapes[0][0]) for b in make(*shapes[0], r) for k in record_batch(b).keys]
    assert len(whole) == len(set(whole)) and len(whole) >= 10 * 96
    got, state, at = [], None, 0
    for i, (R, mbps) in enumerate(shapes):
        stop = cuts[i] if i < len(cuts) else None  # optimizer step to save at; None: the end
        for rank in range(R):
            loader = make(R, mbps, rank)
            if state is not None:
                restore_state_rank(loader, pickle.loads(state))  # rank 0's file only
            it = iter(loader)
            n = None if stop is None else (stop - at) * mbps
            for b in (itertools.islice(it, n) if n is not None else it):
                got += record_batch(b).keys
            if rank == 0 and stop is not None:
                saved = pickle.dumps(loader.save_state_rank())
            del it
            close_loader(loader)
        if stop is not None:
            state, at = saved, stop
    assert len(got) == len(set(got)), "a sample was drawn twice"
    assert sorted(got) == sorted(whole), "the resumed epoch lost or added samples"


@pytest.mark.slow  # loader workers, two finite epochs, resumes around the epoch boundary
@pytest.mark.parametrize("num_workers", [2, 3])
def test_the_epoch_after_a_resume_keeps_the_order_with_loader_workers(data, num_workers):
    """A restored loader keeps Energon's worker rotation (``WorkerConfig.worker_id_offset``) for
    its whole life, while every new epoch starts at its first worker process: the planned
    source must start the next epoch by process, not by the restored logical id (the epoch
    after a mid-epoch resume came out rotated before)."""
    from test_planned_packs import _two_epochs

    def make():
        return build_train_loader(data, ordering=planned(), rank=1, world_size=2, repeat=False,
                                  num_workers=num_workers, batch_size=B,
                                  task_encoder_factory=IndexedSyntheticTaskEncoder)

    records, states = _two_epochs(make)
    n = len(records)
    for cut in (1, 3, n // 2 - 3, n // 2 - 2, n // 2 - 1, n // 2, n // 2 + 1, n - 1):
        loader = make()
        restore_state_rank(loader, states[cut])
        got = []
        for _ in range(2):
            got.extend(record_batch(b) for b in loader)
            if len(got) >= n - cut:
                break
        close_loader(loader)
        assert got[:n - cut] == records[cut:], cut
