r"""Megatron-LM integration: dataloader provider, loud dataloader-state restore, lockstep stop.

Drop-in for ``examples/multimodal/dataloader_provider.py``::

    from energon_ordering.integrations.megatron_lm import add_energon_ordering_args, train_valid_test_dataloaders_provider

    pretrain(train_valid_test_dataloaders_provider, model_provider, ModelType.encoder_or_decoder,
             forward_step, extra_args_provider=add_energon_ordering_args)

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
the restored loader has consumed ``args.iteration x micro_batches_per_step`` micro-batches.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_loader, get_savable_loader, get_train_dataset, get_val_dataset

from energon_ordering.errors import OrderingError
from energon_ordering.integrations.megatron_args import (
    add_energon_ordering_args,
    micro_batches_per_step,
    ordering_config_from_args,
)
from energon_ordering.task_encoder import OrderingTaskEncoder

__all__ = [
    "DataloaderRestoreError",
    "OrderingDataIterator",
    "add_energon_ordering_args",
    "consumed_micro_batches",
    "dataloader_state_path",
    "ordering_config_from_args",
    "train_valid_test_dataloaders_provider",
]


class DataloaderRestoreError(OrderingError, RuntimeError):
    """A dataloader state that should be restored is missing, unreadable or inconsistent."""


class _DefaultOrderingTaskEncoder(OrderingTaskEncoder, DefaultTaskEncoder):
    """Used when no task encoder is given: Energon's default encoder with the ordering stages."""


def dataloader_state_path(
    save_dir: str | os.PathLike,
    iteration: int,
    dp_rank: int,
    *,
    pipeline_parallel: bool | None = None,
    expert_parallel: bool | None = None,
    expert_rank: int | None = None,
) -> Path:
    """Where Megatron-LM's checkpointing writes a data-parallel rank's dataloader state.

    Mirrors ``megatron.training.checkpointing.get_checkpoint_name`` for the saving ranks (tensor
    rank 0, pipeline rank 0): ``{save_dir}/iter_{iteration:07d}/mp_rank_00[_000][_{ep:03d}]/
    train_dataloader_dprank{dp:03d}.pt``. ``None`` arguments are read from
    ``megatron.core.parallel_state`` when it is initialised (else: no pipeline/expert parallel).
    """
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
    if expert_parallel:
        folder += f"_{expert_rank:03d}"
    return Path(save_dir) / f"iter_{iteration:07d}" / folder / f"train_dataloader_dprank{dp_rank:03d}.pt"


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

    With ``lockstep`` (finite data) every ``next()`` does one all_reduce(MAX) of an "exhausted"
    flag over the data-parallel group, so all ranks stop at the same step (first-exhausted
    policy): a rank whose share runs out first ends the epoch for everyone, instead of the
    others hanging in the next collective. Off for repeating data, where it costs nothing.
    """

    def __init__(self, loader: Any, *, lockstep: bool = False, group: Any = None):
        self.loader = loader
        self.lockstep = lockstep
        self.group = group
        self._iter = iter(loader)

    def __iter__(self) -> OrderingDataIterator:
        return self

    def __next__(self) -> Any:
        if not self.lockstep:
            return next(self._iter)
        import torch
        import torch.distributed as dist

        try:
            batch, exhausted = next(self._iter), 0
        except StopIteration:
            batch, exhausted = None, 1
        flag = torch.tensor([exhausted], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item():
            raise StopIteration
        return batch

    def save_state(self) -> Any:
        """The rank's loader state, as Megatron-LM's checkpointing saves it."""
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
    if isinstance(loaded, dict) and "dataloader_state_dict" in loaded:
        loaded = loaded["dataloader_state_dict"]
    return loaded


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
    state = _load_state(dataloader_state_path(save_dir, iteration, dp_rank), args=args, dp_rank=dp_rank)
    if state is None:
        return
    per_step = micro_batches_per_step(args)
    expected = iteration * per_step
    consumed = consumed_micro_batches(state)
    if consumed != expected:
        raise DataloaderRestoreError(
            f"The dataloader state for data-parallel rank {dp_rank} was saved after {consumed} "
            f"micro-batches, but iteration {iteration} x {per_step} "
            f"micro-batches per step = {expected}: it belongs to another checkpoint or another "
            "batch configuration. Use the state saved with this checkpoint."
        )
    loader.restore_state_rank(state)


def train_valid_test_dataloaders_provider(
    train_val_test_num_samples: Any,
    task_encoder: Any = None,
    *,
    args: Any = None,
    repeat: bool = True,
) -> tuple[Any, Any, Any]:
    """Megatron-LM dataloader provider: (train iterator, valid iterator, None).

    Builds the loaders only on tensor-parallel rank 0 of the first or last pipeline stage (the
    other ranks get None, as in Megatron's example); the WorkerConfig comes from
    ``megatron.core.parallel_state`` (data-parallel rank, size and group). Training uses
    ``get_savable_loader`` with the OrderingConfig from :func:`ordering_config_from_args`.

    Args:
        train_val_test_num_samples: As Megatron passes it (unused: Energon data is repeating).
        task_encoder: An Energon task encoder with the :class:`OrderingTaskEncoder` mixin
            (its ``ordering`` is set from the args); None uses Energon's DefaultTaskEncoder.
        args: Megatron args; None reads them with ``megatron.training.get_args()``.
        repeat: False for finite training data; then all data-parallel ranks stop together.
    """
    del train_val_test_num_samples
    if args is None:
        from megatron.training import get_args  # lazily: not in the megatron-core wheel

        args = get_args()
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_rank() != 0 or not (
        parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()
    ):
        return None, None, None
    if task_encoder is None:
        task_encoder = _DefaultOrderingTaskEncoder()
    if not isinstance(task_encoder, OrderingTaskEncoder):
        raise OrderingError(
            f"task_encoder {type(task_encoder).__name__} has no OrderingTaskEncoder mixin; define "
            f"class MyTE(OrderingTaskEncoder, {type(task_encoder).__name__}) and pass MyTE()."
        )
    task_encoder.ordering = ordering_config_from_args(args)
    dp_rank = parallel_state.get_data_parallel_rank()
    group = parallel_state.get_data_parallel_group()
    worker_config = WorkerConfig(
        rank=dp_rank,
        world_size=parallel_state.get_data_parallel_world_size(),
        num_workers=int(getattr(args, "num_workers", 2)),
        data_parallel_group=group,
    )
    data_path = args.data_path[0] if isinstance(args.data_path, (list, tuple)) else args.data_path
    train_ds = get_train_dataset(
        data_path,
        batch_size=args.micro_batch_size,
        task_encoder=task_encoder,
        worker_config=worker_config,
        max_samples_per_sequence=getattr(args, "max_samples_per_sequence", 100),
        shuffle_buffer_size=getattr(args, "shuffle_buffer_size", 100),
        split_part="train",
        repeat=repeat,
    )
    train_loader = get_savable_loader(train_ds)
    _restore(train_loader, args=args, dp_rank=dp_rank)
    train_iter = OrderingDataIterator(train_loader, lockstep=not repeat, group=group)

    valid_iter = None
    if getattr(args, "eval_iters", 0):
        valid_ds = get_val_dataset(
            data_path, batch_size=args.micro_batch_size, task_encoder=task_encoder,
            worker_config=worker_config, split_part="val",
        )
        valid_iter = _cyclic(get_loader(valid_ds))  # Megatron draws eval_iters batches per eval
    return train_iter, valid_iter, None


def _cyclic(loader: Any) -> Any:
    while True:
        yield from loader


# Megatron-LM's pretrain() builds the loaders on every data-parallel rank itself.
train_valid_test_dataloaders_provider.is_distributed = True  # type: ignore[attr-defined]
