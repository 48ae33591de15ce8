r"""Megatron-LM integration: dataloader provider, loud dataloader-state restore, lockstep stop.

Drop-in for ``examples/multimodal/dataloader_provider.py`` (run with ``--dataloader-type external``)::

    from energon_ordering.integrations.megatron_lm import add_energon_ordering_args, train_valid_test_dataloaders_provider

    def extra_args(parser):  # keep the example's flags (--dataloader-save, --packing-buffer-size, ...)
        return add_energon_ordering_args(add_multimodal_extra_args(parser))

    class TE(OrderingTaskEncoder, TaskEncoder): ...          # the example's encoder, mixin first
    provider = functools.partial(train_valid_test_dataloaders_provider, task_encoder=TE())
    provider.is_distributed = True
    pretrain(provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=extra_args)

Works with megatron-core 0.16.1 through 0.19.x (one code path). Like the example it decodes images
to PIL (``image_decode="pil"``), passes ``--packing-buffer-size`` to Energon, and gives validation
batches that repeat at every evaluation (``LimitDataset(reset_after_epoch=True)``).

``megatron.training`` (not in the megatron-core wheel) and ``megatron.core`` are imported lazily;
the rest of the package imports without them. Pass ``args=`` to use the provider without
``megatron.training`` (the tests do).

Dataloader state: Megatron-LM's ``checkpointing.py`` (``maybe_save_dataloader_state``) calls
``save_state()`` on the training iterator (``train_iterator.iterable``; run with
``--dataloader-type external`` so Megatron passes this provider's iterator through) on the ranks
of the first pipeline stage with tensor-parallel rank 0, and ``torch.save``\ s
``{"dataloader_state_dict": state}`` to ``get_checkpoint_name(--dataloader-save, iteration,
basename=f"train_dataloader_dprank{dp:03d}.pt")``, i.e.
``{--dataloader-save}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/train_dataloader_dprank{dp:03d}.pt``.
On resume the example provider calls ``torch.load`` without ``weights_only=False``, which fails
on Energon state with torch >= 2.6; it catches the error, prints "Skipping" and restarts the data
stream from zero. This provider loads the file with ``weights_only=False`` and RAISES if a state
that should exist (``--load`` set, ``args.iteration > 0``) is missing or unreadable, unless
``--allow-dataloader-restart`` is given (then a loud warning). After the restore it checks that
the restored loader has consumed as many micro-batches as Megatron's own num-microbatches
calculator draws over ``args.iteration`` iterations (``--rampup-batch-size`` included).

Steps during batch-size ramp-up: the schedule and the warmup see ``consumed micro-batches //
micro_batches_per_step`` (the final, constant count), i.e. the step in units of the full global
batch: ``consumed samples // --global-batch-size``, as Megatron's sample-based learning-rate
schedule counts. A step is the same function of the micro-batch index before and after a resume,
and the last step of ``--train-samples`` is ``--train-samples // --global-batch-size``, which is
what ``total_steps`` is set to under ramp-up (Megatron's ``--train-iters`` counts more, smaller
iterations).
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron.energon import (
    DefaultTaskEncoder,
    LimitDataset,
    RepeatDataset,
    WorkerConfig,
    get_loader,
    get_savable_loader,
    get_train_dataset,
    get_val_dataset,
)

from energon_ordering.errors import OrderingConfigError, OrderingError, StateMismatchError
from energon_ordering.integrations.megatron_args import (
    add_energon_ordering_args,
    micro_batches_per_step,
    ordering_config_from_args,
)
from energon_ordering.state_stamp import (
    check_state_shape,
    loader_stamp,
    restore_state_rank,
    saved_stamp,
)
from energon_ordering.task_encoder import OrderingTaskEncoder
from energon_ordering.warmup.token_layout import TokenLayout
from energon_ordering.errors import show

__all__ = [
    "DataloaderRestoreError",
    "OrderingDataIterator",
    "add_energon_ordering_args",
    "consumed_micro_batches",
    "dataloader_path_rule",
    "dataloader_state_path",
    "expected_consumed_micro_batches",
    "megatron_token_layout",
    "ordering_config_from_args",
    "train_valid_test_dataloaders_provider",
]


class DataloaderRestoreError(OrderingError, RuntimeError):
    """A dataloader state that should be restored is missing, unreadable or inconsistent."""


class _DefaultOrderingTaskEncoder(OrderingTaskEncoder, DefaultTaskEncoder):
    """Used when no task encoder is given: Energon's default encoder with the ordering stages."""


#: The two rules Megatron-LM has used for the dataloader state's folder (see the module docstring).
PATH_RULES = ("expert-suffix", "canonical")


def _core_version() -> tuple[int, ...] | None:
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return None
    parts = []
    for p in __version__.split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def dataloader_path_rule() -> str:
    """The rule of the installed Megatron: ``"canonical"`` (core >= 0.19) or ``"expert-suffix"``.

    core_v0.19.0's ``maybe_save_dataloader_state`` writes to the TP0/PP0 folder with no
    expert-parallel suffix; earlier tags (0.16.1 .. 0.18) append ``_{ep:03d}`` when EP > 1. The
    rule only matters with expert parallelism; the restore also probes the other rule's path.
    """
    version = _core_version()
    return "canonical" if version is not None and version >= (0, 19) else "expert-suffix"


def dataloader_state_path(
    save_dir: str | os.PathLike,
    iteration: int,
    dp_rank: int,
    *,
    pipeline_parallel: bool | None = None,
    expert_parallel: bool | None = None,
    expert_rank: int | None = None,
    rule: str | None = None,
) -> Path:
    """Where Megatron-LM's checkpointing writes a data-parallel rank's dataloader state.

    Mirrors ``maybe_save_dataloader_state`` + ``get_checkpoint_name`` for the saving ranks (tensor
    rank 0, pipeline rank 0): ``{save_dir}/iter_{iteration:07d}/mp_rank_00[_000][_{ep:03d}]/
    train_dataloader_dprank{dp:03d}.pt``; the ``_{ep:03d}`` suffix only with the
    ``"expert-suffix"`` rule. ``None`` arguments are read from ``megatron.core.parallel_state``
    when it is initialised (else: no pipeline/expert parallel) and from
    :func:`dataloader_path_rule`.
    """
    rule = dataloader_path_rule() if rule is None else rule
    if rule not in PATH_RULES:
        raise OrderingConfigError(f"dataloader_state_path: rule = {show(rule)} is unknown; use one of {list(PATH_RULES)}.")
    if pipeline_parallel is None or expert_parallel is None or expert_rank is None:
        try:
            from megatron.core import parallel_state as ps

            ready = ps.model_parallel_is_initialized()
        except ImportError:
            ready = False
        if pipeline_parallel is None:
            pipeline_parallel = ready and ps.get_pipeline_model_parallel_world_size() > 1
        if expert_parallel is None:
            expert_parallel = ready and ps.get_expert_model_parallel_world_size() > 1
        if expert_rank is None:
            expert_rank = ps.get_expert_model_parallel_rank() if ready else 0
    folder = "mp_rank_00" + ("_000" if pipeline_parallel else "")
    if expert_parallel and rule == "expert-suffix":
        folder += f"_{expert_rank:03d}"
    return Path(save_dir) / f"iter_{iteration:07d}" / folder / f"train_dataloader_dprank{dp_rank:03d}.pt"


def _find_state_file(save_dir: str | os.PathLike, iteration: int, dp_rank: int) -> Path:
    """The installed rule's path, or the other rule's if only that one exists (probing)."""
    rule = dataloader_path_rule()
    path = dataloader_state_path(save_dir, iteration, dp_rank, rule=rule)
    if not path.is_file():
        other = dataloader_state_path(save_dir, iteration, dp_rank,
                                      rule=next(r for r in PATH_RULES if r != rule))
        if other.is_file():
            return other
    return path


def _batch_size_schedule(args: Any) -> dict[str, Any]:
    """Megatron's batch-size schedule flags that are set: ``--rampup-batch-size`` (core <= 0.18)
    or ``--step-batch-size-schedule`` (core 0.19)."""
    out: dict[str, Any] = {}
    if getattr(args, "rampup_batch_size", None) and _rampup_honoured(args):
        out["rampup_batch_size"] = list(args.rampup_batch_size)
    if getattr(args, "step_batch_size_schedule", None):
        out["step_batch_size_schedule"] = args.step_batch_size_schedule
    return out


#: Set once the ignored ``--rampup-batch-size`` has been warned about (one line per process).
_rampup_warned = False


def _rampup_honoured(args: Any) -> bool:
    """False (with one warning per run) when ``--rampup-batch-size`` is set but the installed
    megatron-core ignores it: Megatron-LM core_v0.19.0 does not pass it to the calculator, so
    every iteration draws the full global batch, and so is it counted here."""
    global _rampup_warned
    if core_honours_rampup():
        return True
    if not _rampup_warned:
        _rampup_warned = True
        logging.getLogger(__name__).warning(
            "--rampup-batch-size = %s has no effect with this megatron-core (0.19 deprecated it "
            "for --step-batch-size-schedule): every iteration draws the full global batch, and "
            "the ordering counts it so", show(list(args.rampup_batch_size)))
    return False


def core_honours_rampup() -> bool:
    """True if the installed megatron-core's num-microbatches calculator ramps up the batch
    with ``rampup_batch_size`` (core <= 0.18); megatron-core 0.19 accepts the argument of
    ``init_num_microbatches_calculator`` and ignores it (deprecated for its
    ``step_batch_size_schedule``), as Megatron-Bridge 0.6 passes it."""
    import inspect

    from megatron.core import num_microbatches_calculator as nmc

    return "rampup_batch_size" in inspect.signature(nmc._build_num_microbatches_calculator).parameters


def expected_consumed_micro_batches(args: Any, iteration: int) -> int:
    """Micro-batches one data-parallel rank draws in Megatron's first ``iteration`` iterations.

    Without a batch-size schedule: ``iteration x micro_batches_per_step(args)``. With
    ``--rampup-batch-size`` (megatron-core <= 0.18) or ``--step-batch-size-schedule`` (0.19),
    each iteration's count comes from Megatron's own num-microbatches calculator (a private
    instance built like ``init_num_microbatches_calculator`` builds the global one), updated with
    the consumed samples as ``megatron/training/training.py`` does before every ``train_step``
    (consumed += data-parallel size x micro-batch size x micro-batches).

    Raises:
        OrderingConfigError: A schedule flag the installed megatron-core does not know.
    """
    import inspect

    schedule = _batch_size_schedule(args)
    if not schedule:
        return iteration * micro_batches_per_step(args)
    from megatron.core import num_microbatches_calculator as nmc

    from energon_ordering.integrations.megatron_args import _data_parallel_size

    build = nmc._build_num_microbatches_calculator
    params = inspect.signature(build).parameters
    for name, value in schedule.items():
        if name not in params:
            raise OrderingConfigError(
                f"--{name.replace('_', '-')} = {show(value)}: the installed megatron-core has no such "
                "batch-size schedule (core <= 0.18 has --rampup-batch-size, core 0.19 "
                "--step-batch-size-schedule)."
            )
    mbs, dp = int(args.micro_batch_size), _data_parallel_size(args)
    kw: dict[str, Any] = dict(rank=1,  # not 0: the calculator logs on rank 0
                              global_batch_size=getattr(args, "global_batch_size", None),
                              micro_batch_size=mbs, data_parallel_size=dp,
                              decrease_batch_size_if_needed=bool(getattr(args, "decrease_batch_size_if_needed", False)),
                              **schedule)
    if "step_batch_size_schedule" in schedule and "seq_length" in params:
        kw["seq_length"] = getattr(args, "seq_length", None)  # as global_vars.py passes it
    if "rampup_batch_size" in params:
        kw.setdefault("rampup_batch_size", None)
    calc = build(**{k: v for k, v in kw.items() if k in params})
    # after --rampup-batch-size's ramp every iteration draws the full global batch: counted at once
    ramp_end = int(schedule["rampup_batch_size"][2]) if list(schedule) == ["rampup_batch_size"] else None
    consumed_samples = total = 0
    for done in range(iteration):
        calc.update(consumed_samples, consistency_check=False)
        n = calc.get()
        if ramp_end is not None and consumed_samples >= ramp_end:
            return total + n * (iteration - done)
        total += n
        consumed_samples += n * mbs * dp
    return total


def megatron_token_layout(task_encoder: Any) -> TokenLayout | None:
    """:meth:`TokenLayout.megatron` for an ``examples/multimodal`` encoder, else None.

    Megatron's TaskEncoder has ``img_token_id`` and ``num_image_embeddings_per_tile``; its
    samples carry one placeholder per image and ``num_tiles``.
    """
    img = getattr(task_encoder, "img_token_id", None)
    emb = getattr(task_encoder, "num_image_embeddings_per_tile", None)
    if img is None or emb is None:
        return None
    return TokenLayout.megatron(int(img), int(emb))


def consumed_micro_batches(state: Any) -> int:
    """Micro-batches a rank's loader had yielded when ``save_state_rank()`` produced ``state``."""
    if state is None:
        return 0
    total = 0
    for ws in state.worker_states:
        if isinstance(ws, dict):  # no worker processes: the in-process wrapper's own counter
            total += int(ws.get("_sample_index", 0))
        else:  # a worker checkpoint: snapshot index + samples to replay after it
            snapshot = 0 if ws.state is None else int(ws.state.sample_index)
            total += snapshot + int(ws.offset)
    return total


class OrderingDataIterator:
    """The training iterator Megatron-LM sees: ``next()`` micro-batches, ``save_state()``.

    With ``lockstep`` (finite data) all data-parallel ranks stop at the same step boundary
    (first-exhausted policy) and the run ends the way Megatron's training loop ends a run: when
    a step is complete, the iterator draws the next step's ``micro_batches_per_step``
    micro-batches and does one all_reduce(MAX) of an "exhausted" flag over the data-parallel
    group (on the group's device: CUDA for NCCL). If any rank cannot fill that step, it sets
    ``args.train_iters`` to the number of completed iterations, so Megatron's ``while iteration <
    args.train_iters`` loop ends after this step and saves its final checkpoint as usual, instead
    of a rank raising ``StopIteration`` (which nothing in ``megatron/training`` catches) or
    hanging in the next collective. ``save_state()`` returns the state taken at the step
    boundary, before the look-ahead, so a checkpoint there resumes exactly. The first step is
    drawn when the iterator is built (Megatron builds it before its loop), so a run resumed from
    the checkpoint at the end of its data sets ``args.train_iters`` to the loaded iteration and
    draws nothing. Off for repeating data, where it costs nothing.

    The loader's iterator is created when the first micro-batch is drawn, after the first
    step-boundary state is taken: with loader workers (Megatron's ``--num-workers``, default 2)
    Energon's ``save_state_rank()`` between ``iter(loader)`` and the first ``next()`` waits
    forever for worker processes that only start at that ``next()``. Taken before
    ``iter(loader)``, the state is Energon's initial (or just restored) one.
    """

    def __init__(self, loader: Any, *, lockstep: bool = False, group: Any = None, args: Any = None,
                 micro_batches_per_step: int = 1):
        self.loader = loader
        self.lockstep = lockstep
        self.group = group
        self.args = args
        self.micro_batches_per_step = int(micro_batches_per_step)
        self._iter: Any = None  # iter(loader), created at the first draw (see the class docstring)
        self._ahead: list[Any] = []  # the current step's remaining micro-batches (lockstep)
        self._boundary_state: Any = None
        self._steps_done = int(getattr(args, "iteration", 0) or 0)
        self.exhausted = False
        if self.lockstep:
            # The first step is drawn now, so that a run resumed at the end of its data (the state
            # Megatron saves at the end of a finite run) ends before Megatron's loop draws.
            self._fill_step()
            self._end_training_if_exhausted()

    def __iter__(self) -> OrderingDataIterator:
        return self

    def _device(self) -> Any:
        import torch
        import torch.distributed as dist

        backend = dist.get_backend(self.group)
        if str(backend).lower() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _draw(self) -> Any:
        """The loader's next micro-batch (``iter(loader)`` at the first one)."""
        if self._iter is None:
            self._iter = iter(self.loader)
        return next(self._iter)

    def _fill_step(self) -> None:
        import torch
        import torch.distributed as dist

        self._boundary_state = self.loader.save_state_rank()
        batches = []
        for _ in range(self.micro_batches_per_step):
            try:
                batches.append(self._draw())
            except StopIteration:
                break
        short = int(len(batches) < self.micro_batches_per_step)
        flag = torch.tensor([short], dtype=torch.int64, device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            self.exhausted = True
            self._ahead = []
            return
        self._ahead = batches

    def _end_training_if_exhausted(self) -> None:
        if self.exhausted and self.args is not None:
            # Megatron's loop re-reads args.train_iters: it ends after the completed steps.
            self.args.train_iters = min(int(getattr(self.args, "train_iters", None) or self._steps_done),
                                        self._steps_done)

    def __next__(self) -> Any:
        if not self.lockstep:
            return self._draw()
        if self.exhausted:
            raise StopIteration
        batch = self._ahead.pop(0)
        if not self._ahead:  # the step is complete: look ahead for the next one
            self._steps_done += 1
            self._fill_step()
            self._end_training_if_exhausted()
        return batch

    def save_state(self) -> Any:
        """The rank's loader state, as Megatron-LM's checkpointing saves it.

        With lockstep: the state at the last step boundary (the look-ahead step not drawn).
        """
        if self.lockstep:
            return self._boundary_state  # None: Energon's initial state (nothing drawn yet)
        return self.loader.save_state_rank()


def _load_state(path: Path, *, args: Any, dp_rank: int) -> Any | None:
    import torch

    allow = bool(getattr(args, "allow_dataloader_restart", False))

    def fail(msg: str) -> None:
        if not allow:
            raise DataloaderRestoreError(
                f"{msg} Refusing to restart the data stream from zero (the run would repeat its "
                "first samples and never reach its last ones). Restore the file, or pass "
                "--allow-dataloader-restart to start the data stream fresh."
            )
        warnings.warn(f"{msg} --allow-dataloader-restart: RESTARTING THE DATA STREAM FROM ZERO.",
                      RuntimeWarning, stacklevel=3)

    if not path.is_file():
        fail(f"Dataloader state {path} (data-parallel rank {dp_rank}) is missing although --load "
             f"resumes iteration {getattr(args, 'iteration', 0)}.")
        return None
    try:
        loaded = torch.load(path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - any failure to read it is the same user problem
        fail(f"Dataloader state {path} (data-parallel rank {dp_rank}) is unreadable: "
             f"{type(e).__name__}: {e}.")
        return None
    # Megatron-LM saves {"dataloader_state_dict": state}; accept the bare state too.
    state = loaded
    if isinstance(loaded, dict):
        state = loaded.get("dataloader_state_dict")
    if state is None or not hasattr(state, "worker_states"):
        what = "None" if loaded is None else (
            "an empty dict" if loaded == {} else
            f"{{'dataloader_state_dict': {show(state)}}}" if isinstance(loaded, dict) and "dataloader_state_dict" in loaded
            else f"a {type(loaded).__name__} without 'dataloader_state_dict'")
        fail(f"Dataloader state {path} (data-parallel rank {dp_rank}) holds {what[:200]}, not an "
             "Energon loader state (save_state_rank()).")
        return None
    return state


def _restore(loader: Any, *, args: Any, dp_rank: int) -> None:
    save_dir = getattr(args, "dataloader_save", None)
    iteration = int(getattr(args, "iteration", 0) or 0)
    if not getattr(args, "load", None) or iteration == 0:
        return
    if not save_dir:
        if not getattr(args, "allow_dataloader_restart", False):
            raise DataloaderRestoreError(
                f"--load resumes iteration {iteration} but --dataloader-save is not set, so the "
                "dataloader state cannot be found. Set --dataloader-save to the folder the states "
                "were saved to, or pass --allow-dataloader-restart to start the data stream fresh."
            )
        warnings.warn("--allow-dataloader-restart: no --dataloader-save; RESTARTING THE DATA "
                      "STREAM FROM ZERO.", RuntimeWarning, stacklevel=2)
        return
    path = _find_state_file(save_dir, iteration, dp_rank)
    stamp = loader_stamp(loader) or {}
    planned = stamp.get("length_sort_mode") == "planned"
    if planned and not path.is_file() and dp_rank != 0:
        zero = _find_state_file(save_dir, iteration, 0)
        if zero.is_file():
            # every rank's state of the planned order holds the same global position
            logging.getLogger(__name__).warning(
                "no dataloader state %s for data-parallel rank %d: length_sort_mode = 'planned' "
                "continues from data-parallel rank 0's %s (elastic resume)", path, dp_rank, zero)
            path = zero
    state = _load_state(path, args=args, dp_rank=dp_rank)
    if state is None:
        return
    try:  # before anything reads the entries (a worker entry of None: an AttributeError)
        check_state_shape(state)
    except StateMismatchError as e:
        raise StateMismatchError(f"Dataloader state {path} (data-parallel rank {dp_rank}): {e}") \
            from None
    saved = saved_stamp(state) or {}
    elastic = planned and elastic_shape_change(saved, stamp)
    changed = None if planned else micro_batch_size_change(saved, stamp)
    if changed is not None:
        raise DataloaderRestoreError(
            f"The dataloader state for data-parallel rank {dp_rank} was saved with "
            f"--micro-batch-size {changed[0]}, but this run has --micro-batch-size {changed[1]}: "
            "the micro-batch size decides which samples meet in a micro-batch and the step every "
            f"stage counts by. Resume with --micro-batch-size {changed[0]} (length_sort_mode "
            "planned resumes at another one)."
        )
    # an elastic state counts the micro-batches of the data-parallel size it was saved at
    expected = (expected_at_saved_size(args, iteration, saved) if elastic
                else expected_consumed_micro_batches(args, iteration))
    consumed = consumed_micro_batches(state)
    if consumed != expected:
        per_step = int(saved["micro_batches_per_step"]) if elastic else micro_batches_per_step(args)
        how = (f"Megatron's num-microbatches calculator draws {expected} micro-batches in "
               f"{iteration} iterations with {_batch_size_schedule(args)}"
               if _batch_size_schedule(args) else
               f"iteration {iteration} x {per_step} micro-batches per step = {expected}")
        raise DataloaderRestoreError(
            f"The dataloader state for data-parallel rank {dp_rank} was saved after {consumed} "
            f"micro-batches, but {how}: it belongs to another checkpoint or another "
            "batch configuration. Use the state saved with this checkpoint."
        )
    refusal = _elastic_resume_inside_a_step(args, iteration, consumed, saved) if elastic else None
    if refusal:
        raise DataloaderRestoreError(refusal)
    # our restore: a state of another rank, world size, num_workers or dataset is refused with a
    # typed StateMismatchError before Energon's own bare asserts see it
    restore_state_rank(loader, state)


def expected_at_saved_size(args: Any, iteration: int, saved: dict[str, Any]) -> int:
    """Micro-batches one rank had drawn after ``iteration`` iterations at the data-parallel size
    and micro-batches per step a planned state was saved with (an elastic resume)."""
    if not _batch_size_schedule(args):
        return iteration * int(saved["micro_batches_per_step"])
    old = argparse.Namespace(**vars(args))
    old.data_parallel_size = int(saved["world_size"])
    return expected_consumed_micro_batches(old, iteration)


def micro_batch_size_change(saved: Mapping[str, Any], here: Mapping[str, Any]) -> tuple[int, int] | None:
    """(saved, this run's) micro-batch size if a state of stamp ``saved`` restores into a loader
    of stamp ``here`` with another one (both known), else None. Checked before the count of
    consumed micro-batches, which a changed micro-batch size also changes, so the refusal names
    the micro-batch size and not only the count."""
    old, new = saved.get("batch_size"), here.get("batch_size")
    if old is None or new is None or old == new:
        return None
    return int(old), int(new)


def elastic_shape_change(saved: Mapping[str, Any], here: Mapping[str, Any]) -> bool:
    """True if a state of stamp ``saved`` restores into a loader of stamp ``here`` at another
    data-parallel size or micro-batches per step (both known): an elastic resume."""
    return any(k in saved and k in here and saved[k] != here[k]
               for k in ("world_size", "micro_batches_per_step"))


def _elastic_resume_inside_a_step(args: Any, iteration: int, consumed: int,
                                  saved: dict[str, Any]) -> str | None:
    """Why a planned state saved ``consumed`` micro-batches into a batch-size ramp-up cannot
    continue at another data-parallel size (None: it can). A plan step is the full global
    batch, and its micro-batches are re-dealt to the new size only at a step boundary; during
    the ramp-up an iteration draws fewer micro-batches, so a checkpoint may fall inside one.
    (Without a batch-size schedule every iteration is a whole step.)"""
    per_step = int(saved["micro_batches_per_step"])
    schedule = _batch_size_schedule(args)
    if not schedule or consumed % per_step == 0:
        return None
    step, within = divmod(consumed, per_step)
    name, value = next(iter(schedule.items()))
    named = "--" + name.replace("_", "-")
    return (
        f"The dataloader state of iteration {iteration} was saved at data-parallel size "
        f"{saved['world_size']} during the batch-size ramp-up ({named} = {show(value)}), after "
        f"micro-batch {within} of plan step {step} (a plan step is the full global batch size): "
        "length_sort_mode = 'planned' re-deals a step to another data-parallel size only at a "
        f"step boundary. Resume at the same data-parallel size ({saved['world_size']}), or from "
        "a checkpoint whose consumed samples are a multiple of the global batch size (every one "
        "after the ramp-up is)."
    )


def _num_microbatches(args: Any) -> int:
    """Megatron's current micro-batches per iteration (its calculator if set up, else the args)."""
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return int(get_num_microbatches())
    except Exception:  # noqa: BLE001 - the global calculator is not initialised outside pretrain()
        return micro_batches_per_step(args)


def _check_args(args: Any, repeat: bool) -> None:
    dl_type = getattr(args, "dataloader_type", "external")
    if dl_type != "external":
        raise OrderingConfigError(
            f"--dataloader-type = {show(dl_type)}: this provider returns Energon iterators, which "
            "Megatron-LM passes through only with --dataloader-type external (with 'single' or "
            "'cyclic' it wraps them in a torch DataLoader and fails). Add --dataloader-type external."
        )
    if not repeat and _batch_size_schedule(args):
        name, value = next(iter(_batch_size_schedule(args).items()))
        raise OrderingConfigError(
            f"--{name.replace('_', '-')} = {show(value)} with finite data (repeat=False): the "
            "lockstep stop needs a constant number of micro-batches per step; use repeating data "
            "or no batch-size schedule."
        )


def _is_data_stage(parallel_state: Any, vp_stage: int | None) -> bool:
    """Tensor rank 0 of the first or last pipeline stage (of this virtual stage, if given)."""
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return False
    if vp_stage is None:
        return parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))


def train_valid_test_dataloaders_provider(
    train_val_test_num_samples: Any,
    task_encoder: Any = None,
    *,
    args: Any = None,
    repeat: bool = True,
    vp_stage: int | None = None,
    image_decode: str | None = "pil",
) -> tuple[Any, Any, Any]:
    """Megatron-LM dataloader provider: (train iterator, valid iterator, None).

    Builds the loaders only on tensor-parallel rank 0 of the first or last pipeline stage (the
    other ranks get None, as in Megatron's example); the WorkerConfig comes from
    ``megatron.core.parallel_state`` (data-parallel rank, size and group). Training uses
    ``get_savable_loader`` with the OrderingConfig from :func:`ordering_config_from_args`. As the
    example does, images are decoded to PIL (``image_decode="pil"``), ``--packing-buffer-size``
    is passed to Energon, and validation is ``LimitDataset(RepeatDataset(val), eval_iters x
    micro-batches, reset_after_epoch=True)``, so every evaluation sees the same batches.

    If the encoder keeps the mixin's default ``ordering_token_layout`` and is Megatron's
    multimodal TaskEncoder (``img_token_id``, ``num_image_embeddings_per_tile``), the warmup counts
    model tokens with :meth:`TokenLayout.megatron`.

    Args:
        train_val_test_num_samples: As Megatron passes it (unused: Energon data is repeating).
        task_encoder: An Energon task encoder with the :class:`OrderingTaskEncoder` mixin
            (its ``ordering`` is set from the args); None uses Energon's DefaultTaskEncoder.
        args: Megatron args; None reads them with ``megatron.training.get_args()``.
        repeat: False for finite training data; then all data-parallel ranks stop together.
        vp_stage: The virtual pipeline stage Megatron passes with virtual pipeline parallelism.
        image_decode: Energon's image decoding, used when the encoder keeps Energon's default
            ``decoder``: ``"pil"`` as the example passes (Megatron's image processing needs PIL
            images); None keeps Energon's default (torch tensors). An encoder that sets its own
            ``decoder`` keeps it.

    Raises:
        OrderingConfigError: ``--dataloader-type`` is not ``external``, or a bad ordering flag.
        DataloaderRestoreError: A dataloader state that should be restored is missing or wrong.
    """
    del train_val_test_num_samples
    if args is None:
        from megatron.training import get_args  # lazily: not in the megatron-core wheel

        args = get_args()
    from megatron.core import parallel_state

    _check_args(args, repeat)
    if not _is_data_stage(parallel_state, vp_stage):
        return None, None, None
    if task_encoder is None:
        task_encoder = _DefaultOrderingTaskEncoder()
    if not isinstance(task_encoder, OrderingTaskEncoder):
        raise OrderingError(
            f"task_encoder {type(task_encoder).__name__} has no OrderingTaskEncoder mixin; define "
            f"class MyTE(OrderingTaskEncoder, {type(task_encoder).__name__}) and pass MyTE()."
        )
    task_encoder.ordering = ordering_config_from_args(args)
    if task_encoder.ordering_token_layout == TokenLayout():  # the mixin's default
        layout = megatron_token_layout(task_encoder)
        if layout is not None:
            task_encoder.ordering_token_layout = layout
    dp_rank = parallel_state.get_data_parallel_rank()
    group = parallel_state.get_data_parallel_group()
    worker_config = WorkerConfig(
        rank=dp_rank,
        world_size=parallel_state.get_data_parallel_world_size(),
        num_workers=int(getattr(args, "num_workers", 2)),
        data_parallel_group=group,
    )
    data_path = args.data_path[0] if isinstance(args.data_path, (list, tuple)) else args.data_path
    packing_buffer_size = getattr(args, "packing_buffer_size", None)
    decode: dict[str, Any] = {}
    if image_decode is not None and getattr(task_encoder, "decoder", None) is DefaultTaskEncoder.decoder:
        decode["image_decode"] = image_decode
    try:
        train_ds = get_train_dataset(
            data_path,
            batch_size=args.micro_batch_size,
            task_encoder=task_encoder,
            worker_config=worker_config,
            max_samples_per_sequence=getattr(args, "max_samples_per_sequence", 100),
            shuffle_buffer_size=getattr(args, "shuffle_buffer_size", 100),
            split_part="train",
            repeat=repeat,
            packing_buffer_size=packing_buffer_size,
            **decode,
        )
    except AssertionError as e:  # Energon's bare assert (task_encoder/base.py)
        if repeat or "Cannot blend with dataset weights" not in str(e):
            raise
        raise OrderingConfigError(
            f"repeat=False (finite data): --data-path {data_path} blends its training split by "
            "`weight`, which Energon only draws forever (\"Cannot blend with dataset weights\"). "
            "Write the split with `blend_epochized` (each entry's `repetitions: N`) instead of "
            "`blend`, or keep repeat=True."
        ) from e
    train_loader = get_savable_loader(train_ds)
    _restore(train_loader, args=args, dp_rank=dp_rank)
    train_iter = OrderingDataIterator(train_loader, lockstep=not repeat, group=group, args=args,
                                      micro_batches_per_step=micro_batches_per_step(args))

    valid_iter = None
    eval_iters = int(getattr(args, "eval_iters", 0) or 0)
    if eval_iters:
        valid_ds = get_val_dataset(
            data_path, batch_size=args.micro_batch_size, task_encoder=task_encoder,
            worker_config=worker_config, split_part="val", packing_buffer_size=packing_buffer_size,
            **decode,
        )
        valid_ds = LimitDataset(
            RepeatDataset(valid_ds, worker_config=worker_config),  # in case it is too short
            length=eval_iters * _num_microbatches(args),  # what one evaluation draws
            worker_config=worker_config,
            reset_after_epoch=True,
        )
        valid_iter = _cyclic(get_loader(valid_ds))  # each pass restarts at the same batches
    return train_iter, valid_iter, None


def _cyclic(loader: Any) -> Any:
    while True:
        yield from loader


# Megatron-LM's pretrain() builds the loaders on every data-parallel rank itself.
train_valid_test_dataloaders_provider.is_distributed = True  # type: ignore[attr-defined]
