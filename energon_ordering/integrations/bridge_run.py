"""The ordering and Megatron-Bridge's run must agree: the checks, as pure functions of both.

A recipe is written once; a Bridge run's shape comes from its ``ConfigContainer`` and may be
changed on the command line. :func:`agree_with_run` compares the two before any data is read and
completes what the run decides:

- ``micro_batches_per_step`` is ``train.global_batch_size / (train.micro_batch_size x
  data-parallel size)``; derived when the recipe and ``ordering`` do not give it, refused when
  they give another value.
- The schedule's ``total_steps`` (``OrderingConfig.total_steps`` or the schedule's own) must equal
  ``train.train_iters`` (under ``train.rampup_batch_size``: the full global batches those
  iterations draw, :attr:`RunShape.ramp_steps`); with ``scale_schedule_to_run`` the schedule is
  stretched to the run instead (:func:`~energon_ordering.mixture.rescale.rescale_schedule`).
- The sequence-length warmup's ``full`` must equal ``model.seq_length`` (the warmup ends at the
  model's length, in the same tokens the model computes on).

:func:`missing_split` says why a prepared dataset or metadataset has no split of a name (Energon
otherwise fails with a bare ``KeyError: 'val'`` when the loader is built), and
:func:`unmatched_sources` which sources of a recipe's mixture schedule the data lacks (a packaged
recipe such as ``llava_pretrain`` names five). Bridge itself is not
imported here; :class:`RunShape` holds the numbers read from its config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

from energon_ordering.config import OrderingConfig
from energon_ordering.errors import OrderingConfigError
from energon_ordering.mixture.rescale import rescale_schedule

__all__ = ["RunShape", "agree_with_run", "missing_split", "unmatched_sources"]


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What a Bridge run fixes that the ordering depends on.

    Args:
        micro_batch_size: ``train.micro_batch_size`` (samples).
        global_batch_size: ``train.global_batch_size`` (samples per optimizer step, all ranks).
        data_parallel_size: ``ConfigContainer.data_parallel_size``.
        train_iters: ``train.train_iters`` (optimizer steps); None: not fixed by the run.
        ramp_steps: Under ``train.rampup_batch_size``: the run's length in full global batches
            (the samples Megatron's num-microbatches calculator draws in ``train_iters``
            iterations // the global batch size), the step the schedule and warmup count in;
            None: no ramp-up (every iteration is a full global batch).
        seq_length: ``model.seq_length`` (tokens); None: unknown.
        validation: True if Bridge will ask for validation samples (``validation.eval_iters``
            > 0 and ``validation.eval_interval`` set).
    """

    micro_batch_size: int
    global_batch_size: int
    data_parallel_size: int
    train_iters: int | None = None
    ramp_steps: int | None = None
    seq_length: int | None = None
    validation: bool = False

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches per optimizer step on one data-parallel rank."""
        per_rank = self.micro_batch_size * self.data_parallel_size
        if self.global_batch_size % per_rank:
            raise OrderingConfigError(
                f"train.global_batch_size = {self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size {self.micro_batch_size} x data-parallel size "
                f"{self.data_parallel_size} = {per_rank}; use a global batch of "
                f"{max(1, self.global_batch_size // per_rank) * per_rank}."
            )
        return self.global_batch_size // per_rank


def agree_with_run(config: OrderingConfig, run: RunShape, *, given: Collection[str],
                   scale_schedule_to_run: bool = False) -> OrderingConfig:
    """``config`` completed by ``run``, or a refusal naming the field, both values and the fix.

    Args:
        config: The ordering from the recipe and the provider's ``ordering``.
        run: The Bridge run.
        given: Names of the settings the user gave explicitly (others are defaults, which the
            run may fill in).
        scale_schedule_to_run: Stretch a schedule written for another ``total_steps`` to
            ``run.train_iters`` instead of refusing it.

    Returns:
        ``config`` with ``micro_batches_per_step`` (and, if stretched, the schedule and
        ``total_steps``) set from the run.

    Raises:
        OrderingConfigError: A contradiction between the ordering and the run.
    """
    changes: dict[str, object] = {}
    per_step = run.micro_batches_per_step
    if "micro_batches_per_step" in given and config.micro_batches_per_step != per_step:
        raise OrderingConfigError(
            f"OrderingConfig.micro_batches_per_step = {config.micro_batches_per_step}, but Bridge's "
            f"train.global_batch_size {run.global_batch_size} / (train.micro_batch_size "
            f"{run.micro_batch_size} x data-parallel size {run.data_parallel_size}) = {per_step}; "
            f"set dataset.ordering.micro_batches_per_step={per_step}, or leave it out of the recipe "
            "and `ordering` (it is then derived from the run)."
        )
    changes["micro_batches_per_step"] = per_step

    schedule = config.mixture_schedule
    written_for = config.total_steps if config.total_steps is not None else (
        schedule.total_steps if schedule is not None else None)
    run_steps = run.ramp_steps if run.ramp_steps is not None else run.train_iters
    if run_steps is not None and written_for is not None and written_for != run_steps:
        if not scale_schedule_to_run:
            field = "total_steps" if config.total_steps is not None else "mixture_schedule.total_steps"
            length = (f"Bridge's train.train_iters = {run.train_iters} iterations under "
                      f"train.rampup_batch_size draw {run_steps} full global batches (the steps "
                      "the schedule counts)" if run.ramp_steps is not None else
                      f"Bridge's train.train_iters = {run.train_iters}")
            raise OrderingConfigError(
                f"OrderingConfig.{field} = {written_for} (the run length the recipe was written for), "
                f"but {length}: the schedule's phases would "
                f"end at the wrong steps. Set dataset.ordering.total_steps={run_steps} (a "
                "schedule in fractions follows it), or dataset.scale_schedule_to_run=true to "
                "stretch the schedule to the run, or train.train_iters to match."
            )
        if schedule is not None:
            changes["mixture_schedule"] = rescale_schedule(schedule, run_steps)
        changes["total_steps"] = run_steps

    warmup = config.seq_length_warmup
    if warmup is not None and run.seq_length is not None and warmup.full != run.seq_length:
        raise OrderingConfigError(
            f"OrderingConfig.seq_length_warmup.full = {warmup.full}, but Bridge's "
            f"model.seq_length = {run.seq_length}: the warmup must end at the model's sequence "
            f"length. Set seq_length_warmup.full: {run.seq_length} in the recipe or "
            "dataset.ordering, or model.seq_length to the warmup's full length."
        )
    return dataclasses.replace(config, **changes)


def missing_split(path: str | Path, split: str) -> str | None:
    """Why the Energon dataset or metadataset at ``path`` has no ``split`` part; None if it has
    one. Reads only the dataset's metadata (``.nv-meta`` or the metadataset YAML)."""
    from megatron.energon import WorkerConfig
    from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError
    from megatron.energon.metadataset.loader import load_dataset

    try:
        load_dataset(path).get_datasets(
            training=False, split_part=split,
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        )
    except KeyError as e:
        return f"the metadataset has no split {e}"
    except EmptyDatasetError as e:
        return str(e)
    return None


def unmatched_sources(path: str | Path, sources: Collection[str]) -> tuple[list[str], list[str]]:
    """(the schedule's ``sources`` the training split of ``path`` lacks, the split's sources),
    the split's sources named as the pipeline names them (``subflavors: {source: NAME}``, else
    the folder name). Reads only the dataset's metadata."""
    from megatron.energon import WorkerConfig
    from megatron.energon.metadataset.loader import load_dataset

    from energon_ordering.pipeline.sources import source_name

    loaded = load_dataset(path).get_datasets(
        training=True, split_part="train", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
    ).datasets
    names = [source_name(d) for d in loaded]
    return [s for s in sources if s not in names], names
