"""The Megatron-LM provider in one process: flags it passes, validation, ramp-up, bad states.

One-process tests run under a real world-size-1 gloo group with
``megatron.core.parallel_state.initialize_model_parallel(1, 1)``; the loaders are real Energon
loaders over real prepared datasets.
"""

from __future__ import annotations

import argparse
import sys
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
from megatron.energon import stateless

from energon_ordering import OrderingConfig, OrderingConfigError, TokenLayout
from energon_ordering.inspect.pool_memory import find_stage
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder
from energon_ordering.integrations.megatron_args import ordering_config_from_args
from energon_ordering.integrations.megatron_lm import (
    DataloaderRestoreError,
    _restore,
    consumed_micro_batches,
    dataloader_state_path,
    expected_consumed_micro_batches,
    train_valid_test_dataloaders_provider,
)

pytest.importorskip("megatron.core")

sys.path.insert(0, str(Path(__file__).parent))
from gloo_group import gloo_group_of_one  # noqa: E402


def _args(data, **kw) -> argparse.Namespace:
    base = dict(
        data_path=[str(data)], micro_batch_size=4, global_batch_size=8, train_iters=100, train_samples=None,
        seq_length=4096, decoder_seq_length=None, seed=1234, num_workers=0, eval_iters=0,
        dataloader_save=None, load=None, iteration=0, dataloader_type="external",
        length_sort_pool_size=16, length_sort_mode="batch", data_mixture_schedule=None,
        data_blend_policy=None, seq_length_warmup_steps=None, seq_length_warmup_start=None,
        seq_length_warmup_multiple_of=None, seq_length_warmup_overflow=None, ordering_seed=None,
        allow_dataloader_restart=False, data_parallel_size=1, packing_buffer_size=None,
        rampup_batch_size=None,
    )
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture(scope="module")
def mpu(tmp_path_factory):
    from megatron.core import parallel_state

    with gloo_group_of_one(tmp_path_factory.mktemp("mpu") / "init"):
        parallel_state.initialize_model_parallel(1, 1)
        yield parallel_state
        parallel_state.destroy_model_parallel()


def test_a_missing_dataloader_type_external_is_refused(small_dataset):
    with pytest.raises(OrderingConfigError, match=r"--dataloader-type = 'single'.*Add --dataloader-type external"):
        train_valid_test_dataloaders_provider(None, SyntheticTaskEncoder(), args=_args(small_dataset, dataloader_type="single"))


def test_finite_data_with_rampup_is_refused(small_dataset):
    with pytest.raises(OrderingConfigError, match=r"--rampup-batch-size = \[4, 4, 64\] with finite data"):
        train_valid_test_dataloaders_provider(None, SyntheticTaskEncoder(), args=_args(small_dataset, rampup_batch_size=[4, 4, 64]),
                                              repeat=False)


def test_finite_data_over_a_weighted_blend_is_refused_naming_blend_epochized(tmp_path, mpu):
    """Energon draws a `blend` by weight forever; with repeat=False it only asserted."""
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    weighted = make_synthetic_dataset(tmp_path, [SourceSpec("web", 16, "short"), SourceSpec("code", 16, "short")],
                                      shard_size=8)
    with pytest.raises(OrderingConfigError, match=r"repeat=False \(finite data\): --data-path .*metadataset.yaml "
                                                  r"blends its training split by `weight`.*`blend_epochized`"):
        train_valid_test_dataloaders_provider(None, SyntheticTaskEncoder(), args=_args(weighted),
                                              repeat=False)


def test_the_provider_accepts_vp_stage():
    # megatron/training/training.py asserts this with virtual pipeline parallelism
    assert "vp_stage" in inspect.signature(train_valid_test_dataloaders_provider).parameters


class _PackingTE(SyntheticTaskEncoder):
    """Packs nothing (one sample per pack); enough for Energon to build its packing stage."""

    def select_samples_to_pack(self, samples):
        return [[s] for s in samples]

    @stateless
    def pack_selected_samples(self, samples):
        return samples[0]


def test_packing_buffer_size_reaches_energon(small_dataset, mpu):
    from megatron.energon.wrappers.packing_dataset import PackingDataset

    for size, built in ((None, False), (8, True)):  # (what packing does with the pool: issue 15)
        args = _args(small_dataset, packing_buffer_size=size, length_sort_pool_size=0)
        train, _, _ = train_valid_test_dataloaders_provider(None, _PackingTE(), args=args, image_decode=None)
        next(train)
        assert (find_stage(train.loader.dataset, PackingDataset) is not None) == built
        close_loader(train.loader)


class _MegatronLikeTE(SyntheticTaskEncoder):
    """Has the two attributes of examples/multimodal's TaskEncoder the provider reads."""

    img_token_id = 7
    num_image_embeddings_per_tile = 576
    ordering_token_layout = TokenLayout()  # Megatron's encoder sets none: the mixin's default


def test_megatron_encoder_gets_the_model_token_layout(small_dataset, mpu):
    te = _MegatronLikeTE()
    train, _, _ = train_valid_test_dataloaders_provider(None, te, args=_args(small_dataset), image_decode=None)
    assert te.ordering_token_layout == TokenLayout.megatron(7, 576)
    close_loader(train.loader)
    te = SyntheticTaskEncoder()  # its own layout is kept
    own = te.ordering_token_layout
    train, _, _ = train_valid_test_dataloaders_provider(None, te, args=_args(small_dataset), image_decode=None)
    assert te.ordering_token_layout == own
    close_loader(train.loader)


class _RecordingTE(SyntheticTaskEncoder):
    """Records the type of each decoded image (the synthetic encoder itself expects tensors)."""

    seen: list = []

    @stateless
    def encode_sample(self, sample):
        import numpy as np
        from PIL import Image

        _RecordingTE.seen.append(type(sample.image))
        if isinstance(sample.image, Image.Image):
            img = torch.from_numpy(np.asarray(sample.image)).permute(2, 0, 1).float() / 255
            sample = dataclasses.replace(sample, image=img)
        return super().encode_sample(sample)


def test_images_are_decoded_to_pil_like_the_example(small_dataset, mpu):
    from PIL import Image

    for decode, expected in (("pil", Image.Image), (None, torch.Tensor)):
        _RecordingTE.seen.clear()
        kw = {} if decode == "pil" else {"image_decode": None}  # "pil" is the default
        train, _, _ = train_valid_test_dataloaders_provider(None, _RecordingTE(), args=_args(small_dataset), **kw)
        next(train)
        assert _RecordingTE.seen and all(issubclass(t, expected) for t in _RecordingTE.seen), _RecordingTE.seen
        close_loader(train.loader)


def _val_dataset(tmp_path, small_dataset) -> Path:
    meta = tmp_path / "meta.yaml"
    meta.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n"
        f"  train:\n    path: {small_dataset}\n"
        f"  val:\n    path: {small_dataset}\n    split_part: train\n"
    )
    return meta


@pytest.mark.parametrize("num_workers", [0, 2])
def test_validation_repeats_the_same_batches_at_every_evaluation(small_dataset, tmp_path, mpu, num_workers):
    meta = _val_dataset(tmp_path, small_dataset)
    args = _args(meta, eval_iters=3, num_workers=num_workers)  # 3 iterations x 2 micro-batches
    _, valid, _ = train_valid_test_dataloaders_provider(None, SyntheticTaskEncoder(), args=args, image_decode=None)
    evals = [[tuple(next(valid).keys) for _ in range(6)] for _ in range(3)]
    assert evals[0] == evals[1] == evals[2]
    assert len(set(evals[0])) == 6  # six different batches per evaluation


# ---- restore: bad state files (issue 12), ramp-up -------------------------------------------


def _restore_args(tmp_path, **kw):
    base = dict(load=str(tmp_path / "ckpt"), iteration=3, dataloader_save=str(tmp_path / "dl"),
                micro_batch_size=4, global_batch_size=8, data_parallel_size=1,
                allow_dataloader_restart=False, rampup_batch_size=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("content,what", [
    (None, "holds None"),
    ({"dataloader_state_dict": None}, r"holds \{'dataloader_state_dict': None\}"),
    ({}, "holds an empty dict"),
    ({"model": 1}, "holds a dict without 'dataloader_state_dict'"),
])
def test_an_empty_state_file_is_refused_not_a_silent_restart(small_dataset, tmp_path, content, what):
    loader = build_train_loader(small_dataset, ordering=OrderingConfig(length_sort_pool_size=16))
    path = dataloader_state_path(tmp_path / "dl", 3, 0)
    path.parent.mkdir(parents=True)
    torch.save(content, path)
    with pytest.raises(DataloaderRestoreError, match=rf"{what}, not an Energon loader state.*--allow-dataloader-restart"):
        _restore(loader, args=_restore_args(tmp_path), dp_rank=0)
    with pytest.warns(RuntimeWarning, match="RESTARTING THE DATA STREAM FROM ZERO"):
        _restore(loader, args=_restore_args(tmp_path, allow_dataloader_restart=True), dp_rank=0)
    close_loader(loader)


def _megatron_loop_micro_batches(args, iterations):
    """Micro-batches Megatron's training loop draws: update_num_microbatches(consumed) before each
    train_step, consumed += DP x MBS x num_microbatches after it (global calculator, as pretrain())."""
    from megatron.core import num_microbatches_calculator as nmc

    nmc.init_num_microbatches_calculator(0, args.rampup_batch_size, args.global_batch_size,
                                         args.micro_batch_size, args.data_parallel_size)
    consumed = total = 0
    per_iteration = []
    for _ in range(iterations):
        nmc.update_num_microbatches(consumed, consistency_check=True)
        n = nmc.get_num_microbatches()
        per_iteration.append(n)
        total += n
        consumed += args.data_parallel_size * args.micro_batch_size * n
    nmc.destroy_num_microbatches_calculator()
    return total, per_iteration


def test_rampup_expected_count_is_megatrons(tmp_path):
    args = _restore_args(tmp_path, micro_batch_size=4, global_batch_size=64, data_parallel_size=2,
                         rampup_batch_size=[8, 8, 256])
    total, per_iteration = _megatron_loop_micro_batches(args, 6)
    assert per_iteration[0] == 1 and per_iteration != [8] * 6  # the ramp is real
    assert expected_consumed_micro_batches(args, 6) == total != 6 * 8
    for iterations in (1, 9, 40):
        assert expected_consumed_micro_batches(args, iterations) == _megatron_loop_micro_batches(args, iterations)[0]


def test_resume_under_rampup(small_dataset, tmp_path):
    args = _restore_args(tmp_path, iteration=6, micro_batch_size=4, global_batch_size=64,
                         data_parallel_size=2, rampup_batch_size=[8, 8, 256])
    drawn, _ = _megatron_loop_micro_batches(args, 6)
    cfg = OrderingConfig(length_sort_pool_size=16, micro_batches_per_step=8)
    loader = build_train_loader(small_dataset, ordering=cfg)
    it = iter(loader)
    for _ in range(drawn):
        next(it)
    state = loader.save_state_rank()
    after = [tuple(next(it).keys) for _ in range(5)]
    del it
    close_loader(loader)
    assert consumed_micro_batches(state) == drawn
    path = dataloader_state_path(tmp_path / "dl", 6, 0)
    path.parent.mkdir(parents=True)
    torch.save({"dataloader_state_dict": state}, path)
    loader = build_train_loader(small_dataset, ordering=cfg)
    _restore(loader, args=args, dp_rank=0)
    it = iter(loader)
    assert [tuple(next(it).keys) for _ in range(5)] == after
    del it
    close_loader(loader)
    # the same state claimed for 7 iterations is refused, naming the calculator
    path7 = dataloader_state_path(tmp_path / "dl", 7, 0)
    path7.parent.mkdir(parents=True)
    torch.save({"dataloader_state_dict": state}, path7)
    loader = build_train_loader(small_dataset, ordering=cfg)
    with pytest.raises(DataloaderRestoreError, match=rf"saved after {drawn} micro-batches, but Megatron's num-microbatches calculator draws"):
        _restore(loader, args=_restore_args(tmp_path, iteration=7, micro_batch_size=4, global_batch_size=64,
                                            data_parallel_size=2, rampup_batch_size=[8, 8, 256]), dp_rank=0)
    close_loader(loader)


def test_rampup_total_steps_count_full_global_batches():
    args = _args("x", rampup_batch_size=[8, 8, 256], train_iters=None, train_samples=6400,
                 global_batch_size=64, data_parallel_size=2)
    args.train_iters = 120  # what Megatron's update_train_iters sets (more, smaller iterations)
    assert ordering_config_from_args(args).total_steps == 100


# ---- the warmup's full length (issues 12 and 13) ----------------------------------------------


def test_warmup_grows_to_the_decoder_seq_length():
    # Megatron's multimodal model_provider sets args.seq_length to the image embeddings (576)
    args = _args("x", seq_length=576, decoder_seq_length=4096, seq_length_warmup_steps=100,
                 seq_length_warmup_start=1024)
    cfg = ordering_config_from_args(args)
    assert cfg.seq_length_warmup.full == 4096 and cfg.seq_length_warmup.start == 1024
    args.seq_length_warmup_start = 8192
    with pytest.raises(OrderingConfigError, match=r"--seq-length-warmup-start = 8192: must lie in \[1, --decoder-seq-length = 4096\]"):
        ordering_config_from_args(args)


def test_a_recipe_warmup_above_the_model_length_is_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("seq_length_warmup: {start: 256, full: 8192, warmup_steps: 10}\n")
    args = _args("x", seq_length=4096, data_mixture_schedule=str(recipe))
    with pytest.raises(OrderingConfigError, match=r"seq_length_warmup.full = 8192 exceeds --seq-length = 4096"):
        ordering_config_from_args(args)
    args.decoder_seq_length = 8192
    assert ordering_config_from_args(args).seq_length_warmup.full == 8192


# ---- check-resume on dict batches (Megatron's encode_batch) -------------------------------------


def test_record_batch_reads_dict_batches():
    from energon_ordering.errors import OrderingTypeError
    from energon_ordering.inspect.rank_simulation import BatchRecord, record_batch

    megatron_dict = {"__key__": ["a", "b"], "__restore_key__": [(), ()], "__subflavor__": None,
                     "tokens": torch.zeros(2, 8), "num_tiles": torch.ones(2)}
    assert record_batch(megatron_dict) == BatchRecord(("a", "b"), (), ())
    assert record_batch({"__keys__": ["a"], "total_len": torch.tensor([5])}) == BatchRecord(("a",), (5,), ())
    with pytest.raises(OrderingTypeError, match=r"a dict batch has no keys .*`__key__`"):
        record_batch({"tokens": torch.zeros(1)})


class _DictBatchTE(SyntheticTaskEncoder):
    """encode_batch returns a dict, as Megatron-LM's multimodal TaskEncoder does."""

    def encode_batch(self, batch):
        return {"__key__": list(batch.keys), "tokens": batch.tokens}


def test_check_resume_passes_on_dict_batches(small_dataset, tmp_path):
    from click.testing import CliRunner

    from energon_ordering.cli import main

    # a pool that fits the small dataset's share (a larger one is refused with repeating data)
    recipe = tmp_path / "batch_pool.yaml"
    recipe.write_text("length_sort_pool_size: 64\nlength_sort_mode: batch\nseed: 1234\n")
    res = CliRunner().invoke(main, ["check-resume", str(small_dataset), "--recipe", str(recipe),
                                    "--cut", "5", "--steps", "12", "--task-encoder",
                                    "tests.test_megatron_provider:_DictBatchTE"])
    assert res.exit_code == 0, res.output


def _core_019() -> bool:
    from megatron.core.package_info import __version__

    return tuple(int(x) for x in __version__.split(".")[:2]) >= (0, 19)


@pytest.mark.py312
@pytest.mark.skipif(sys.version_info < (3, 12) or not _core_019(), reason="megatron-core 0.19.x (.ci/py312)")
def test_step_batch_size_schedule_count_is_megatrons_on_core_0_19(tmp_path):
    """core 0.19 replaced --rampup-batch-size by --step-batch-size-schedule."""
    from megatron.core import num_microbatches_calculator as nmc

    args = _restore_args(tmp_path, micro_batch_size=4, global_batch_size=64, data_parallel_size=2,
                         step_batch_size_schedule="0:16 128:32 512:64", seq_length=None)
    nmc.init_num_microbatches_calculator(rank=1, global_batch_size=None, micro_batch_size=4, data_parallel_size=2,
                                         step_batch_size_schedule=args.step_batch_size_schedule)
    consumed = total = 0
    per_iteration = []
    for _ in range(30):  # megatron/training/training.py: update before each train_step
        nmc.update_num_microbatches(consumed, consistency_check=True)
        n = nmc.get_num_microbatches()
        per_iteration.append(n)
        total += n
        consumed += 2 * 4 * n
    nmc.destroy_num_microbatches_calculator()
    assert per_iteration[0] == 2 and per_iteration[-1] == 8  # the schedule is real
    assert expected_consumed_micro_batches(args, 30) == total
    # Megatron-LM core_v0.19.0 ignores --rampup-batch-size (not passed to the calculator): every
    # iteration draws the full global batch, and so is it counted (not refused at resume)
    ramp = _restore_args(tmp_path, rampup_batch_size=[8, 8, 256])
    assert expected_consumed_micro_batches(ramp, 3) == 3 * 2  # 8 / (4 x 1 rank)
    assert ordering_config_from_args(_args("x", rampup_batch_size=[8, 8, 256], train_iters=None,
                                           train_samples=800)).total_steps == 100


@pytest.mark.py312
@pytest.mark.skipif(sys.version_info < (3, 12) or not _core_019(), reason="megatron-core 0.19.x (.ci/py312)")
def test_a_step_batch_size_schedule_steps_in_its_final_global_batch():
    """Megatron-LM 0.19 refuses --step-batch-size-schedule beside --global-batch-size and sets
    args.global_batch_size to micro-batch x DP (1 micro-batch); the ordering's step is the
    schedule's final batch, as under --rampup-batch-size (planned: 8 micro-batches per plan
    step, not 1)."""
    args = _args("x", micro_batch_size=4, global_batch_size=8, data_parallel_size=2,
                 step_batch_size_schedule="0:16 128:32 1K:64", train_iters=None, train_samples=6400)
    cfg = ordering_config_from_args(args)
    assert cfg.micro_batches_per_step == 8 and cfg.total_steps == 100
    with pytest.raises(OrderingConfigError, match=r"--step-batch-size-schedule = 'x:16'.*THRESHOLD:BATCH"):
        ordering_config_from_args(_args("x", step_batch_size_schedule="x:16", data_parallel_size=2))
