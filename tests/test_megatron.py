"""Megatron-LM integration: flags, provider, loud dataloader restore, lockstep stop.

The multi-process tests start real processes with torch.distributed (gloo, CPU) and
``megatron.core.parallel_state.initialize_model_parallel(1, 1)``; every one is bounded by a
timeout, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pickle
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from energon_ordering import OrderingConfig, OrderingConfigError
from energon_ordering.integrations.megatron_args import FLAGS, add_energon_ordering_args, ordering_config_from_args
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
from energon_ordering.warmup.schedule import SeqLenWarmup

sys.path.insert(0, str(Path(__file__).parent))
import megatron_lm_sources  # noqa: E402
from gloo_group import gloo_group_of_one  # noqa: E402

RECIPES = Path(__file__).parent.parent / "recipes"

# Flags of Megatron-LM's megatron/training/arguments.py and examples/multimodal/multimodal_args.py
# in the families ours live in (core_v0.16.1); argparse refuses a duplicate option string.
MEGATRON_FLAGS = {
    "--seq-length": dict(type=int, default=None),
    "--decoder-seq-length": dict(type=int, default=None),
    "--seed": dict(type=int, default=1234),
    "--data-parallel-random-init": dict(action="store_true"),
    "--micro-batch-size": dict(type=int, default=None),
    "--global-batch-size": dict(type=int, default=None),
    "--train-iters": dict(type=int, default=None),
    "--train-samples": dict(type=int, default=None),
    "--num-workers": dict(type=int, default=2),
    "--data-path": dict(nargs="*", default=None),
    "--data-cache-path": dict(default=None),
    "--dataloader-type": dict(default=None),
    "--dataloader-save": dict(default=None),
    "--load": dict(default=None),
    "--save": dict(default=None),
    "--tensor-model-parallel-size": dict(type=int, default=1),
    "--pipeline-model-parallel-size": dict(type=int, default=1),
    "--context-parallel-size": dict(type=int, default=1),
    "--eval-iters": dict(type=int, default=100),
    # examples/multimodal/multimodal_args.py: sequence packing
    "--packing-buffer-size": dict(type=int, default=None),
    "--packing-seq-length": dict(type=int, default=0),
}


def megatron_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    for flag, kw in MEGATRON_FLAGS.items():
        parser.add_argument(flag, **kw)
    return add_energon_ordering_args(parser)


CMD = (
    "--seq-length 2048 --micro-batch-size 4 --global-batch-size 512 --train-iters 19073 "
    "--num-workers 4 --data-path /data/meta.yaml --dataloader-save /ckpt/dataloader "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    f"--data-mixture-schedule {RECIPES / 'slm_350m_20b.yaml'} "
    "--length-sort-pool-size 1024 --length-sort-mode batch --data-blend-policy random "
    "--seq-length-warmup-steps 1000 --seq-length-warmup-start 256 --ordering-seed 7"
)


def _parse(cmd: str, world_size: int = 64) -> argparse.Namespace:
    args = megatron_parser().parse_args(cmd.split())
    args.world_size = world_size  # Megatron sets it from the launcher
    return args


def test_flags_do_not_collide_with_megatron():
    megatron_parser()  # argparse raises on a conflicting option string
    assert not set(FLAGS) & set(MEGATRON_FLAGS)
    group = [g for g in megatron_parser()._action_groups if g.title == "energon ordering"]
    assert len(group) == 1 and {o for a in group[0]._group_actions for o in a.option_strings} == set(FLAGS)


def test_realistic_command_line():
    cfg = ordering_config_from_args(_parse(CMD))
    assert cfg.length_sort_pool_size == 1024 and cfg.length_sort_mode == "batch"
    assert cfg.blend_policy == "random"  # the flag overrides the recipe's deterministic
    assert cfg.seed == 7
    assert cfg.total_steps == 19073
    # 64 GPUs / (TP 2 x PP 2) = 16 data-parallel ranks: 512 / (4 x 16) = 8 micro-batches
    assert cfg.micro_batches_per_step == 8
    assert cfg.seq_length_warmup == SeqLenWarmup(start=256, full=2048, warmup_steps=1000)
    assert cfg.mixture_schedule.sources == ("web", "code", "books", "curated")


def test_placement_flag_overrides_the_recipe(tmp_path):
    recipe = tmp_path / "lean.yaml"
    recipe.write_text("length_sort_pool_size: 10000\nlength_sort_mode: batch\nplacement: pre-encode\n")
    base = "--seq-length 2048 --micro-batch-size 4 --global-batch-size 32"
    cfg = ordering_config_from_args(_parse(f"{base} --data-mixture-schedule {recipe}", 8))
    assert cfg.length_sort_placement == "pre-encode" and cfg.length_sort_pool_size == 10000
    cfg = ordering_config_from_args(
        _parse(f"{base} --data-mixture-schedule {recipe} --length-sort-placement post-encode", 8))
    assert cfg.length_sort_placement == "post-encode"


def test_megatron_packing_flags_are_honoured():
    base = "--seq-length 4096 --micro-batch-size 1 --global-batch-size 8"
    cfg = ordering_config_from_args(_parse(f"{base} --packing-buffer-size 100 --packing-seq-length 4096", 8))
    assert cfg.packing_buffer_size == 100 and cfg.pack_seq_length == 4096
    cfg = ordering_config_from_args(_parse(base, 8))  # Megatron's defaults: packing off
    assert cfg.packing_buffer_size is None and cfg.pack_seq_length is None
    with pytest.raises(OrderingConfigError, match=r"--packing-buffer-size = -1: must be an int > 0"):
        ordering_config_from_args(_parse(f"{base} --packing-buffer-size -1", 8))


def test_megatron_defaults_and_train_samples():
    args = _parse("--seq-length 4096 --micro-batch-size 2 --global-batch-size 32 "
                  "--train-samples 3200", world_size=8)
    cfg = ordering_config_from_args(args)
    assert cfg == OrderingConfig(seed=1234, total_steps=100, micro_batches_per_step=2)


def test_bare_schedule_file(tmp_path):
    sched = tmp_path / "mix.yaml"
    sched.write_text("sources:\n  a: {weight: 1}\n  b: {weight: {step: {0: 1, 50: 3}}}\n")
    args = _parse(f"--micro-batch-size 1 --global-batch-size 8 --train-iters 100 "
                  f"--data-mixture-schedule {sched}", world_size=8)
    cfg = ordering_config_from_args(args)
    assert cfg.mixture_schedule.weights(50) == {"a": 0.25, "b": 0.75}


@pytest.mark.parametrize(
    "cmd,match",
    [
        ("--length-sort-pool-size -1", r"--length-sort-pool-size = -1"),
        ("--length-sort-pool-size 1023 --length-sort-mode batch",
         r"--length-sort-pool-size = 1023: must be a multiple of --micro-batch-size \(4\).*use 1020"),
        ("--seq-length-warmup-steps 100", r"--seq-length-warmup-start = None: is required"),
        ("--seq-length-warmup-steps -5", r"--seq-length-warmup-steps = -5"),
        ("--seq-length-warmup-steps 100 --seq-length-warmup-start 4096",
         r"--seq-length-warmup-start = 4096: must lie in \[1, --seq-length = 2048\]"),
        ("--seq-length-warmup-steps 100 --seq-length-warmup-start 4",
         r"--seq-length-warmup-start = 4: must be >= --seq-length-warmup-multiple-of = 8"),
        ("--seq-length-warmup-steps 100 --seq-length-warmup-start 256 --seq-length-warmup-multiple-of 0",
         r"--seq-length-warmup-multiple-of = 0"),
        # found by review (7 December 2026): read alone, they were silently dropped
        ("--seq-length-warmup-start 512",
         r"--seq-length-warmup-start = 512: is read only with --seq-length-warmup-steps N > 0"),
        ("--seq-length-warmup-multiple-of 64",
         r"--seq-length-warmup-multiple-of = 64: is read only with --seq-length-warmup-steps"),
        ("--packing-buffer-size 0", r"--packing-buffer-size = 0: must be an int > 0"),
        ("--global-batch-size 100", r"--global-batch-size = 100: must be a multiple of --micro-batch-size \(4\) x data-parallel size \(8\)"),
        ("--data-mixture-schedule /nope.yaml", r"--data-mixture-schedule = '/nope.yaml'.*no file"),
    ],
)
def test_bad_values_name_the_flag(cmd, match):
    args = _parse("--seq-length 2048 --micro-batch-size 4 --global-batch-size 64 --train-iters 10 " + cmd,
                  world_size=8)
    with pytest.raises(OrderingConfigError, match=match):
        ordering_config_from_args(args)


def test_recipe_written_for_other_total_steps_is_refused():
    args = _parse(f"--micro-batch-size 4 --global-batch-size 64 --train-iters 500 "
                  f"--data-mixture-schedule {RECIPES / 'slm_350m_20b.yaml'}", world_size=16)
    with pytest.raises(OrderingConfigError, match=r"--train-iters = 500: the recipe .* total_steps = 19073"):
        ordering_config_from_args(args)


@pytest.mark.parametrize("flag,value", [("--length-sort-mode", "bucket"), ("--seq-length-warmup-overflow", "skip"),
                                        ("--length-sort-pool-size", "many")])
def test_argparse_rejects_bad_choices_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit):
        megatron_parser().parse_args([flag, value])
    assert flag in capsys.readouterr().err


def test_package_imports_without_megatron_training():
    import subprocess
    import sys

    code = ("import sys; sys.modules['megatron.training'] = None\n"
            "import energon_ordering, energon_ordering.integrations.megatron_lm, energon_ordering.cli\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# ---- dataloader-state restore (single process) ----------------------------------------------


def _restore_args(tmp_path, **kw):
    base = dict(load=str(tmp_path / "ckpt"), iteration=3, dataloader_save=str(tmp_path / "dl"),
                micro_batch_size=4, global_batch_size=8, data_parallel_size=1,
                allow_dataloader_restart=False)
    return argparse.Namespace(**{**base, **kw})


def _saved_state(small_dataset, batches):
    loader = build_train_loader(small_dataset, ordering=OrderingConfig(length_sort_pool_size=16))
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = loader.save_state_rank()
    del it
    close_loader(loader)
    return state


def test_missing_or_unreadable_state_raises_instead_of_restarting(small_dataset, tmp_path):
    from energon_ordering.integrations.megatron_lm import DataloaderRestoreError, _restore, dataloader_state_path

    loader = build_train_loader(small_dataset, ordering=OrderingConfig(length_sort_pool_size=16))
    with pytest.raises(DataloaderRestoreError, match=r"iter_0000003/mp_rank_00/train_dataloader_dprank000.pt .* is missing.*--allow-dataloader-restart"):
        _restore(loader, args=_restore_args(tmp_path), dp_rank=0)
    path = dataloader_state_path(tmp_path / "dl", 3, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a torch file")
    with pytest.raises(DataloaderRestoreError, match=r"is unreadable: UnpicklingError"):
        _restore(loader, args=_restore_args(tmp_path), dp_rank=0)
    with pytest.warns(RuntimeWarning, match="RESTARTING THE DATA STREAM FROM ZERO"):
        _restore(loader, args=_restore_args(tmp_path, allow_dataloader_restart=True), dp_rank=0)
    with pytest.raises(DataloaderRestoreError, match=r"--dataloader-save is not set"):
        _restore(loader, args=_restore_args(tmp_path, dataloader_save=None), dp_rank=0)
    close_loader(loader)


def test_restore_checks_the_iteration(small_dataset, tmp_path):
    from energon_ordering.integrations.megatron_lm import DataloaderRestoreError, _restore, consumed_micro_batches, dataloader_state_path

    state = _saved_state(small_dataset, 6)  # 6 micro-batches = 3 iterations of 2
    assert consumed_micro_batches(state) == 6
    for iteration in (3, 4):  # the right file, and the same state misplaced under iteration 4
        path = dataloader_state_path(tmp_path / "dl", iteration, 0)
        path.parent.mkdir(parents=True)
        torch.save({"dataloader_state_dict": state}, path)  # as Megatron-LM's checkpointing does
    loader = build_train_loader(small_dataset, ordering=OrderingConfig(length_sort_pool_size=16))
    with pytest.raises(DataloaderRestoreError, match=r"saved after 6 micro-batches, but iteration 4 x 2"):
        _restore(loader, args=_restore_args(tmp_path, iteration=4), dp_rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _restore(loader, args=_restore_args(tmp_path, iteration=3), dp_rank=0)
    close_loader(loader)


def test_changed_micro_batch_size_is_refused_naming_it(small_dataset, tmp_path):
    """Half the micro-batch size at the same global batch doubles the micro-batches per step:
    the count check alone said "saved after 6 micro-batches, but iteration 3 x 4 = 12"."""
    from energon_ordering.integrations.megatron_lm import DataloaderRestoreError, _restore, dataloader_state_path

    state = _saved_state(small_dataset, 6)  # micro-batches of 4, 3 iterations of 2
    path = dataloader_state_path(tmp_path / "dl", 3, 0)
    path.parent.mkdir(parents=True)
    torch.save({"dataloader_state_dict": state}, path)
    loader = build_train_loader(small_dataset, ordering=OrderingConfig(length_sort_pool_size=16),
                                batch_size=2)
    with pytest.raises(DataloaderRestoreError,
                       match=r"saved with --micro-batch-size 4, but this run has --micro-batch-size 2.*"
                             r"Resume with --micro-batch-size 4"):
        _restore(loader, args=_restore_args(tmp_path, micro_batch_size=2), dp_rank=0)
    close_loader(loader)


def test_state_path_matches_megatron_get_checkpoint_name(tmp_path):
    from energon_ordering.integrations.megatron_lm import dataloader_state_path

    assert dataloader_state_path("/ckpt/dl", 1500, 12, pipeline_parallel=False, expert_parallel=False,
                                 expert_rank=0) == Path("/ckpt/dl/iter_0001500/mp_rank_00/train_dataloader_dprank012.pt")
    assert dataloader_state_path("/ckpt/dl", 7, 0, pipeline_parallel=True, expert_parallel=True,
                                 expert_rank=3) == Path("/ckpt/dl/iter_0000007/mp_rank_00_000_003/train_dataloader_dprank000.pt")


def test_fresh_start_needs_no_state(small_dataset, tmp_path):
    from energon_ordering.integrations.megatron_lm import _restore

    loader = build_train_loader(small_dataset, ordering=OrderingConfig())
    _restore(loader, args=_restore_args(tmp_path, iteration=0), dp_rank=0)
    _restore(loader, args=_restore_args(tmp_path, load=None), dp_rank=0)
    close_loader(loader)


# ---- real processes: torch.distributed (gloo) + megatron.core.parallel_state -----------------


needs_mcore = pytest.mark.skipif(
    importlib.util.find_spec("megatron.core") is None,
    reason="needs the megatron extra: pip install -e '.[megatron]'",
)


def _dist_worker(rank: int, world: int, init_file: str, data: str, phase: str, out: str,
                 steps: int, more: int, num_workers: int, repeat: bool) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from energon_ordering.integrations.megatron_lm import dataloader_state_path, train_valid_test_dataloaders_provider
    from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1)
    dp = parallel_state.get_data_parallel_rank()
    mbps = 2
    args = argparse.Namespace(
        data_path=[data], micro_batch_size=4, global_batch_size=4 * world * mbps, train_iters=100,
        seq_length=4096, seed=1234, num_workers=num_workers, eval_iters=0,
        dataloader_save=str(Path(out) / "dl"), load=None, iteration=0,
        length_sort_pool_size=32, length_sort_mode="batch", data_mixture_schedule=None,
        data_blend_policy=None, seq_length_warmup_steps=10, seq_length_warmup_start=256,
        seq_length_warmup_multiple_of=None, seq_length_warmup_overflow=None, ordering_seed=None,
        allow_dataloader_restart=False, data_parallel_size=world, dataloader_type="external",
    )
    result: dict = {"rank": dp}
    try:
        if phase == "resume":
            args.load, args.iteration = str(Path(out) / "ckpt"), steps // mbps
        if phase == "finite_resume":
            args.load, args.iteration = str(Path(out) / "ckpt"), steps
        train, _, _ = train_valid_test_dataloaders_provider(None, SyntheticTaskEncoder(), args=args,
                                                            repeat=repeat, image_decode=None)
        if phase == "first":
            result["before"] = [list(next(train).keys) for _ in range(steps)]
            path = dataloader_state_path(args.dataloader_save, steps // mbps, dp)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"dataloader_state_dict": train.save_state()}, path)  # as checkpointing.py
            result["after"] = [list(next(train).keys) for _ in range(more)]
        elif phase == "resume":
            result["after"] = [list(next(train).keys) for _ in range(more)]
        elif phase in ("finite", "finite_resume"):
            from megatron.core.rerun_state_machine import RerunDataIterator

            it = RerunDataIterator(train)  # what pretrain() makes of an external loader
            iteration, drawn = args.iteration, []
            while iteration < args.train_iters:  # megatron/training/training.py's loop
                for _ in range(mbps):  # one train_step: forward_backward draws mbps micro-batches
                    drawn.append(list(next(it).keys))
                    dist.all_reduce(torch.ones(1), group=parallel_state.get_data_parallel_group())
                iteration += 1
                if phase == "finite" and iteration == steps:  # a checkpoint, as checkpointing.py
                    path = dataloader_state_path(args.dataloader_save, iteration, dp)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    torch.save({"dataloader_state_dict": it.iterable.save_state()}, path)
                    result["cut_at"] = len(drawn)
            result.update(batches=len(drawn), drawn=drawn, train_iters=args.train_iters, iteration=iteration)
    except Exception as e:  # reported to the test, which fails with the message
        result["error"] = f"{type(e).__name__}: {e}"
    Path(out, f"{phase}_rank{dp}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(tmp_path, phase, *, timeout=180, **kw):
    init = tmp_path / f"init_{phase}_{time.monotonic_ns()}"
    defaults = dict(data="", steps=6, more=10, num_workers=0, repeat=True)
    a = {**defaults, **kw}
    args = (2, str(init), a["data"], phase, str(tmp_path), a["steps"], a["more"], a["num_workers"],
            a["repeat"])
    return megatron_lm_sources.spawn_ranks(_dist_worker, args, tmp_path, phase, 2,
                                           "the 2-process run", timeout)


@needs_mcore
@pytest.mark.slow  # two gloo processes
@pytest.mark.parametrize("num_workers", [0, 1])
def test_two_processes_save_and_resume_like_megatron(small_dataset, tmp_path, num_workers):
    first = _spawn(tmp_path, "first", data=str(small_dataset), num_workers=num_workers)
    resumed = _spawn(tmp_path, "resume", data=str(small_dataset), num_workers=num_workers)
    for a, b in zip(first, resumed):
        assert b["after"] == a["after"], f"rank {a['rank']} continues differently after resume"
    keys = [set(k for batch in r["before"] + r["after"] for k in batch) for r in first]
    assert not keys[0] & keys[1]  # the two data-parallel ranks read disjoint samples


@needs_mcore
@pytest.mark.slow  # two gloo processes
def test_two_processes_refuse_a_corrupted_state(small_dataset, tmp_path):
    _spawn(tmp_path, "first", data=str(small_dataset))
    from energon_ordering.integrations.megatron_lm import dataloader_state_path

    dataloader_state_path(tmp_path / "dl", 3, 1).write_bytes(pickle.dumps("garbage")[:5])
    import torch.multiprocessing as mp

    init = tmp_path / "init_corrupt"
    ctx = mp.start_processes(_dist_worker, nprocs=2, join=False, start_method="spawn",
                             args=(2, str(init), str(small_dataset), "resume", str(tmp_path), 6, 10, 0, True))
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "hang"
    errors = {r: json.loads((tmp_path / f"resume_rank{r}.json").read_text()).get("error") for r in range(2)}
    assert errors[0] is None
    assert "DataloaderRestoreError" in errors[1] and "unreadable" in errors[1]


@needs_mcore
@pytest.mark.slow  # two gloo processes
def test_finite_data_stops_all_ranks_at_the_same_step(tmp_path):
    """Megatron's loop (``while iteration < args.train_iters``, 2 micro-batches per step, through
    Megatron's RerunDataIterator) ends after the last step every rank can fill, without an
    exception; a checkpoint inside the epoch resumes to the same end."""
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    # 81 samples: the two ranks' shares end after different numbers of micro-batches of 4
    make_synthetic_dataset(tmp_path / "data", [SourceSpec("web", 81, "short")], shard_size=10)
    path = tmp_path / "data" / "web"
    alone = []
    for rank in range(2):
        loader = build_train_loader(path, ordering=OrderingConfig(length_sort_pool_size=32,
                                    length_sort_mode="batch"), rank=rank, world_size=2, repeat=False)
        alone.append(sum(1 for _ in loader))
        close_loader(loader)
    assert alone[0] != alone[1], alone  # without lockstep one rank would wait in a collective
    out = _spawn(tmp_path, "finite", data=str(path), repeat=False, timeout=120, steps=2)
    full_steps = min(alone) // 2  # the last step every rank fills
    assert full_steps > 2
    for r in out:
        assert r["batches"] == 2 * full_steps and r["train_iters"] == r["iteration"] == full_steps
    resumed = _spawn(tmp_path, "finite_resume", data=str(path), repeat=False, timeout=120, steps=2)
    # a finite loader restored inside its last pool continues with exactly the remainder
    for a, b in zip(out, resumed):
        assert b["drawn"] == a["drawn"][a["cut_at"]:]
    assert all(b["train_iters"] == full_steps for b in resumed)


# ---- the lockstep iterator alone, with loader workers --------------------------------------


@pytest.fixture
def gloo_world_of_one(tmp_path):
    with gloo_group_of_one(tmp_path / "gloo_init"):
        yield


@pytest.mark.timeout(120)  # before the fix: save_state_rank() between iter() and next() hung here
@pytest.mark.slow  # loader worker processes under a gloo group
def test_lockstep_iterator_with_loader_workers_draws_and_resumes(tmp_path, gloo_world_of_one):
    """OrderingDataIterator on finite data with 2 loader workers (Megatron's default
    --num-workers): it never asks Energon for a state between iter(loader) and the first batch
    (that hangs with worker processes), draws the epoch in whole steps, and each step-boundary
    state, the first and the one at the end included, resumes with exactly the rest."""
    from argparse import Namespace

    from energon_ordering import restore_state_rank
    from energon_ordering.inspect.rank_simulation import record_batch
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
    from energon_ordering.integrations.megatron_lm import OrderingDataIterator

    # 66 samples: 2 workers x 33 -> 9 micro-batches of 4 each, the last one short: 18 in all
    make_synthetic_dataset(tmp_path / "data", [SourceSpec("web", 66, "short")], shard_size=11)
    cfg = OrderingConfig(length_sort_pool_size=16, length_sort_mode="batch")

    def loader():
        return build_train_loader(tmp_path / "data" / "web", ordering=cfg, num_workers=2,
                                  repeat=False, shuffle_buffer_size=None)

    plain = loader()
    epoch = [record_batch(b) for b in plain]
    close_loader(plain)
    steps = len(epoch) // 2
    assert len(epoch) == 18 and steps == 9

    def lockstep(iteration: int, state=None):
        ld = loader()
        if state is not None:
            restore_state_rank(ld, state)
        args = Namespace(iteration=iteration, train_iters=100)
        return ld, args, OrderingDataIterator(ld, lockstep=True, args=args, micro_batches_per_step=2)

    ld, args, it = lockstep(0)
    states = [pickle.loads(pickle.dumps(it.save_state()))]  # before the first batch
    drawn = []
    for batch in it:
        drawn.append(record_batch(batch))
        if len(drawn) % 2 == 0:
            states.append(pickle.loads(pickle.dumps(it.save_state())))
    close_loader(ld)
    assert drawn == epoch[: 2 * steps] and args.train_iters == steps
    for step in (0, 4, steps):  # the start, inside the epoch, the end (Megatron's final save)
        ld, args, it = lockstep(step, states[step])
        assert [record_batch(b) for b in it] == drawn[2 * step:], f"resumed at step {step}"
        assert args.train_iters == steps
        close_loader(ld)


def test_planned_mode_flags():
    base = ("--seq-length 2048 --micro-batch-size 4 --global-batch-size 32 "
            "--length-sort-mode planned --length-sort-placement pre-encode "
            "--length-sort-pool-holds keys")
    cfg = ordering_config_from_args(_parse(f"{base} --plan-window-steps 8", 8))
    assert (cfg.length_sort_mode, cfg.plan_window_steps, cfg.micro_batches_per_step) == (
        "planned", 8, 1)
    assert cfg.planned_mix == "auto" and cfg.resolved_planned_mix == "window"
    for mix in ("step", "window"):
        assert ordering_config_from_args(_parse(f"{base} --planned-mix {mix}", 8)).planned_mix == mix
    with pytest.raises(OrderingConfigError, match="length_sort_pool_size = 64.*plan_window_steps"):
        ordering_config_from_args(_parse(f"{base} --length-sort-pool-size 64", 8))
