"""Every setting that changes the continuation is stamped, and a change of it is refused (issue 22).

Each row saves a real state (real prepared data, real loader), then restores it into a loader
built with ONE setting changed, and expects :class:`StateMismatchError` naming that setting with
both values. Before these fields were stamped, each of these restores either went through
silently (and continued with other data) or failed inside Energon without naming the setting.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tiers
from megatron.energon import stateless

from energon_ordering import OrderingConfig, StateMismatchError, restore_state_rank
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, resume, run_with_cuts
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder
from energon_ordering.pipeline import BuildArgs, Source, pipeline_stamp, plan_pipeline
from energon_ordering.state_stamp import PIPELINE_STAMP_VERSION, PipelineStampDataset

WARMUP = dict(start=256, full=2048, warmup_steps=6)
PACK = OrderingConfig(
    length_sort_pool_size=8, length_sort_mode="sample", micro_batches_per_step=2,
    packing_buffer_size=16, pack_seq_length=2048, seed=3,
)
WARM = OrderingConfig(length_sort_pool_size=8, micro_batches_per_step=2, seq_length_warmup=WARMUP)


class OwnPackerTE(SyntheticTaskEncoder):
    """A user's packer (packs like the default, but it is the user's code)."""

    def select_samples_to_pack(self, samples):
        return self.ordering_select_samples_to_pack(samples)

    @stateless
    def pack_selected_samples(self, samples):
        return self.ordering_pack_selected_samples(samples)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``one``: one source of 192 samples; ``meta``: a 1:1 metadataset of two sources, and
    ``meta91``: the same two prepared sources blended 9:1."""
    root = tmp_path_factory.mktemp("stamp_fields")
    make_synthetic_dataset(root / "one", [SourceSpec("web", 192, "trimodal")], shard_size=24)
    meta = make_synthetic_dataset(
        root / "m", [SourceSpec("web", 96, "short"), SourceSpec("code", 96, "medium")],
        shard_size=24,
    )
    text = meta.read_text()
    assert text.count("weight: 1.0") == 2
    meta91 = meta.with_name("metadataset_9to1.yaml")
    meta91.write_text(text.replace("weight: 1.0", "weight: 9.0", 1))
    return {"one": root / "one" / "web", "meta": meta, "meta91": meta91}


def _maker(path, cfg, **kw):
    kw.setdefault("batch_size", 4)
    kw.setdefault("shuffle_buffer_size", 8)
    kw.setdefault("max_samples_per_sequence", 8)
    return lambda: build_train_loader(path, ordering=cfg, **kw)


def _state(make, cut=5):
    return run_with_cuts(make, cut + 1, [cut])[1][cut]


def _refused(make, state, match, *, energon_restore=False):
    loader = make()
    try:
        with pytest.raises(StateMismatchError, match=match):
            if energon_restore:  # Energon's own restore: the top stage's check in the pipeline
                loader.restore_state_rank(state)
                next(iter(loader))
            else:
                restore_state_rank(loader, state)
    finally:
        close_loader(loader)


# Each row: (path, saved with, restored with) -> expected message. cfg + build_train_loader kw.
CHANGED = {
    "packing_buffer_size": (
        "one", dict(cfg=PACK), dict(cfg=dataclasses.replace(PACK, packing_buffer_size=8)),
        r"packing_buffer_size: saved 16 != configured 8.*--packing-buffer-size",
    ),
    "pack_seq_length": (
        "one", dict(cfg=PACK), dict(cfg=dataclasses.replace(PACK, pack_seq_length=1024)),
        r"pack_seq_length: saved 2048 != configured 1024.*--packing-seq-length",
    ),
    "pack_pool_placement": (
        "one", dict(cfg=PACK), dict(cfg=dataclasses.replace(PACK, pack_pool_placement="samples")),
        # the only field named, and first: the pipeline's own check runs before the stages'
        r"(PipelineStampDataset|restore_state_rank): cannot restore a state written by a "
        r"different configuration \(pack_pool_placement: saved 'packs' != configured 'samples'\)"
        r".*OrderingConfig.pack_pool_placement",
    ),
    "packer-default-to-own": (
        "one", dict(cfg=PACK), dict(cfg=PACK, task_encoder_factory=OwnPackerTE),
        r"packer: saved \['OrderingTaskEncoder.ordering_select_samples_to_pack', "
        r"'OrderingTaskEncoder.ordering_pack_selected_samples'\] != configured "
        r"\['OwnPackerTE.select_samples_to_pack', 'OwnPackerTE.pack_selected_samples'\]",
    ),
    "blend-weights-1-to-9": (
        "meta", dict(cfg=OrderingConfig(length_sort_pool_size=8)),
        dict(cfg=OrderingConfig(length_sort_pool_size=8), path="meta91"),
        # Energon hands the weights over normalised
        r"blend: saved \{'mode': 'dataset_weight', 'weights': \[0.5, 0.5\]\} != configured "
        r"\{'mode': 'dataset_weight', 'weights': \[0.9, 0.1\]\}.*original metadataset",
    ),
    # with loader workers Energon restores a smaller micro-batch silently (other token caps)
    "micro-batch-4-to-2-with-warmup": (
        "one", dict(cfg=WARM, num_workers=2), dict(cfg=WARM, batch_size=2, num_workers=2),
        r"batch_size: saved 4 != configured 2.*--micro-batch-size",
    ),
    # without workers Energon refuses it with a bare AssertionError, with workers a ValueError
    "micro-batch-4-to-8": (
        "one", dict(cfg=OrderingConfig(length_sort_pool_size=8)),
        dict(cfg=OrderingConfig(length_sort_pool_size=8), batch_size=8),
        r"batch_size: saved 4 != configured 8",
    ),
    "micro-batch-4-to-8-with-workers": (
        "one", dict(cfg=OrderingConfig(length_sort_pool_size=8), num_workers=2),
        dict(cfg=OrderingConfig(length_sort_pool_size=8), batch_size=8, num_workers=2),
        r"batch_size: saved 4 != configured 8",
    ),
    # Energon itself resumes a smaller micro-batch (a divisor) with workers, but its loader
    # takes micro-batches from the workers in turn, so other samples follow (measured: they
    # differ from the third sample on), even with every ordering stage off
    "micro-batch-4-to-2-no-ordering-stage-workers": (
        "one", dict(cfg=OrderingConfig(), num_workers=2),
        dict(cfg=OrderingConfig(), batch_size=2, num_workers=2),
        r"batch_size: saved 4 != configured 2",
    ),
    "overflow-under-the-warmup": (
        "one", dict(cfg=WARM), dict(cfg=dataclasses.replace(WARM, seq_length_overflow="drop")),
        r"seq_length_overflow: saved 'keep' != configured 'drop'",
    ),
    "overflow-under-pack_seq_length": (
        "one", dict(cfg=PACK), dict(cfg=dataclasses.replace(PACK, seq_length_overflow="drop")),
        r"seq_length_overflow: saved 'keep' != configured 'drop'",
    ),
}


def _make(data, path, row):
    """The loader maker of one side of a row (``path`` unless the row names another)."""
    row = dict(row)
    cfg = row.pop("cfg")
    return _maker(data[row.pop("path", path)], cfg, **row)


@pytest.mark.parametrize("case", tiers.cases(CHANGED))
def test_a_changed_setting_is_refused_by_name(data, case):
    path, saved_with, restored_with, match = CHANGED[case]
    state = _state(_make(data, path, saved_with))
    _refused(_make(data, path, restored_with), state, match)


@pytest.mark.parametrize("case", ["pack_pool_placement", "packing_buffer_size",
                                  "overflow-under-the-warmup", "blend-weights-1-to-9"])
def test_energons_own_restore_names_the_setting_too(data, case):
    """Energon's ``loader.restore_state_rank`` (no pre-check): the pipeline's top stage checks
    the stamp before any stage below interprets the state. (A larger micro-batch is refused by
    Energon's loader itself before any stage sees the state, with its own AssertionError or
    ValueError: ``energon_ordering.restore_state_rank`` checks the stamp first, above.)"""
    path, saved_with, restored_with, match = CHANGED[case]
    state = _state(_make(data, path, saved_with))
    _refused(_make(data, path, restored_with), state, match, energon_restore=True)


def test_unchanged_packing_restore_continues_exactly(data):
    """The new fields refuse nothing that did not change: the same packing setup (pool of
    packs, pack target, the user's packer) resumes exactly."""
    make = _maker(data["one"], PACK, task_encoder_factory=OwnPackerTE)
    records, states = run_with_cuts(make, 10, [4])
    assert resume(make, states[4], 6) == records[4:]


def test_settings_of_stages_that_are_off_are_not_refused(data):
    """Without packing the pack settings do not matter, and the overflow only matters under a
    cap: changing them restores."""
    cfg = OrderingConfig(length_sort_pool_size=8)
    make = _maker(data["one"], cfg)
    records, states = run_with_cuts(make, 8, [4])
    other = dataclasses.replace(cfg, pack_seq_length=1024, pack_pool_placement="samples",
                                seq_length_overflow="drop")
    assert resume(_maker(data["one"], other), states[4], 4) == records[4:]


def _saved_stamp(state):
    """The (mutable) stamp inside a saved state of one in-process loader."""
    stack = [state.worker_states[0]]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("__class__") == PipelineStampDataset.__name__:
                return node["_stamp"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    raise AssertionError("no PipelineStampDataset state")


def test_a_state_of_the_previous_stamp_version_is_refused_clearly(data):
    make = _maker(data["one"], PACK)
    state = _state(make)
    stamp = _saved_stamp(state)
    assert stamp["stamp_version"] == PIPELINE_STAMP_VERSION >= 2
    # what version 1 wrote: the same layout without the fields added in version 2
    for field in ("batch_size", "packing_buffer_size", "pack_seq_length", "pack_pool_placement",
                  "packer", "blend"):
        del stamp[field]
    stamp["stamp_version"] = 1
    match = (rf"an older version of energon_ordering \(stamp_version: saved 1 != configured "
             rf"{PIPELINE_STAMP_VERSION}\).*start the data stream fresh")
    _refused(make, state, match)
    _refused(make, state, match, energon_restore=True)


def test_the_stamp_holds_plain_builtins_only(data):
    """Megatron-Bridge's restricted unpickler (tests/test_stamp_bridge_unpickler.py, py312)
    admits builtins only; the new fields are plain values too."""
    stamp = _saved_stamp(_state(_maker(data["one"], PACK, task_encoder_factory=OwnPackerTE)))

    def plain(v):
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        if isinstance(v, list):
            return all(plain(x) for x in v)
        return v is None or type(v) in (str, int, float, bool)

    assert plain(stamp), stamp
    assert stamp["packer"] == ["OwnPackerTE.select_samples_to_pack",
                               "OwnPackerTE.pack_selected_samples"]


def test_the_new_fields_are_read_off_the_plan():
    """Without a dataset: which fields a plan stamps, and None for a stage that is off."""
    def stamp(cfg, **kw):
        return pipeline_stamp(plan_pipeline(cfg, BuildArgs(**kw)), length_indexes=None)

    packed = stamp(PACK, batch_size=4, own_select_samples_to_pack=True,
                   packer=("MyTE.select_samples_to_pack", "MyTE.pack_selected_samples"))
    assert {k: packed[k] for k in ("batch_size", "packing_buffer_size", "pack_seq_length",
                                   "pack_pool_placement", "packer", "seq_length_overflow")} == {
        "batch_size": 4, "packing_buffer_size": 16, "pack_seq_length": 2048,
        "pack_pool_placement": "packs",
        "packer": ["MyTE.select_samples_to_pack", "MyTE.pack_selected_samples"],
        "seq_length_overflow": "keep",
    }
    plain = stamp(OrderingConfig(length_sort_pool_size=8), batch_size=2)
    assert [plain[k] for k in ("packing_buffer_size", "pack_seq_length", "pack_pool_placement",
                               "packer", "seq_length_overflow", "blend")] == [None] * 6
    # the packing buffer given to get_train_dataset counts like the config's
    assert stamp(OrderingConfig(pack_seq_length=512), batch_size=2,
                 packing_buffer_size=8)["packing_buffer_size"] == 8
    # Energon's blend: weights when it draws by weight, repetitions when it repeats
    two = (Source(weight=0.25), Source(weight=0.75))
    assert stamp(OrderingConfig(), batch_size=2, blend_mode="dataset_weight", sources=two)[
        "blend"] == {"mode": "dataset_weight", "weights": [0.25, 0.75]}
    assert stamp(OrderingConfig(), batch_size=2, blend_mode="sample_repetitions", repeat=False,
                 sources=(Source(repetitions=3),))["blend"] == {"repetitions": [3]}
    # a schedule replaces the metadataset's blend: its weights do not matter
    sched = OrderingConfig(mixture_schedule={"sources": {"a": {"weight": 1}, "b": {"weight": 1}}})
    assert stamp(sched, batch_size=2, blend_mode="dataset_weight",
                 sources=(Source(name="a", weight=1), Source(name="b", weight=9)))["blend"] is None
