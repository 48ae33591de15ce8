"""The pipeline stamp: what a training pipeline's continuation depends on, read off its plan.

:class:`~energon_ordering.state_stamp.PipelineStampDataset` adds the data-parallel rank, world
size and ``num_workers``; a restore compares the saved stamp field by field
(:func:`~energon_ordering.state_stamp.check_stamp`).
"""

from __future__ import annotations

from typing import Any

from energon_ordering.planned.window import PLAN_VERSION
from energon_ordering.pipeline.plan import BLEND, PACKING, REPEAT, SCHEDULED_BLEND, PipelinePlan
from energon_ordering.pipeline.plan import window_steps as plan_window_steps

__all__ = ["pipeline_stamp"]


def pipeline_stamp(plan: PipelinePlan, *, length_indexes: list[dict[str, Any]] | None,
                   window_steps: int | None = None) -> dict[str, Any]:
    """What a training pipeline's continuation depends on besides rank, world size and
    num_workers; plain builtin values only (Megatron-Bridge's restricted unpickler). A setting
    whose stage is off is stamped as None, so changing it is not refused.

    Args:
        plan: The pipeline's plan.
        length_indexes: The identity of each length index the pre-encode pool sorts by
            (collected while the sources were loaded); None or empty: none.
        window_steps: The planned order's K as the build settled it (packed: read off the
            length index, :func:`~energon_ordering.pipeline.plan.packed_window_steps`); None:
            the plan's.
    """
    stamp = _stamp(plan, length_indexes)
    if plan.config.planned:
        # the planned order reads no shard slices and has no shuffle buffer: Energon's loading
        # settings are unused (their changes are not refused); what decides it is stamped
        cfg = plan.config
        n = len(plan.args.sources)
        stamp.update({
            "max_samples_per_sequence": [None] * n,
            "shuffle_over_epochs": [None] * n,
            "parallel_shard_iters": [None] * n,
            "shuffle_buffer_size": None,
            "length_sort_mode": cfg.length_sort_mode,
            "length_sort_placement": cfg.length_sort_placement,
            "seed": cfg.seed,
            "micro_batches_per_step": cfg.micro_batches_per_step,
            "plan_window_steps": (plan_window_steps(cfg, plan.args,
                                                   plan.packing_buffer_size is not None)
                                  if window_steps is None else int(window_steps)),
            "plan_version": PLAN_VERSION,
        })
    return stamp


def _stamp(plan: PipelinePlan, length_indexes: list[dict[str, Any]] | None) -> dict[str, Any]:
    cfg, args = plan.config, plan.args
    pool = cfg.length_sort_enabled
    schedule = cfg.mixture_schedule
    warmup = cfg.seq_length_warmup
    step_based = schedule is not None or warmup is not None
    sources = args.sources
    shuffle = args.shuffle_buffer_size
    blend = plan.stage(SCHEDULED_BLEND)
    packing = plan.stage(PACKING)
    packed = packing is not None
    # a cap cuts samples (and applies the overflow policy): the warmup, or the pack target
    capped = warmup is not None or (packed and cfg.pack_seq_length is not None)
    return {
        "datasets": [{"uuid": s.uuid, "split": s.split} for s in sources],
        "max_samples_per_sequence": [s.max_samples_per_sequence for s in sources],
        "shuffle_over_epochs": [s.shuffle_over_epochs for s in sources],
        "parallel_shard_iters": [s.parallel_shard_iters for s in sources],
        "repeat": bool(args.repeat),
        "shuffle_buffer_size": shuffle if (shuffle or 0) > 1 else None,
        "length_sort_pool_size": cfg.length_sort_pool_size,
        "length_sort_mode": cfg.length_sort_mode if pool else None,
        "length_sort_placement": cfg.length_sort_placement if pool else None,
        "seed": cfg.seed if pool else None,
        "length_index": list(length_indexes) if length_indexes else None,
        "mixture_schedule": list(schedule.sources) if schedule is not None else None,
        "blend_policy": cfg.blend_policy if schedule is not None else None,
        "seq_length_warmup": warmup.to_dict() if warmup is not None else None,
        "micro_batches_per_step": cfg.micro_batches_per_step if step_based else None,
        "schedule_lag_compensation": (
            cfg.schedule_lag_compensation if schedule is not None and pool else None
        ),
        "schedule_lag_batches": (
            float(blend.kwargs["lag_batches"]) if blend is not None else None
        ),
        # since stamp version 2
        # always: the pools group by it, the schedule, warmup and pack caps count steps in
        # micro-batches, and with loader workers Energon takes micro-batches from the workers
        # in turn, so even with every ordering stage off a smaller one continues otherwise
        "batch_size": args.batch_size,
        "blend": _energon_blend(plan),
        "packing_buffer_size": packing.kwargs["buffer_size"] if packed else None,
        "pack_seq_length": cfg.pack_seq_length if packed else None,
        "pack_pool_placement": cfg.pack_pool_placement if packed and pool else None,
        "packer": [packing.kwargs["pre_packer"], packing.kwargs["final_packer"]] if packed else None,
        "seq_length_overflow": cfg.seq_length_overflow if capped else None,
    }


def _energon_blend(plan: PipelinePlan) -> dict[str, Any] | None:
    """What Energon's own blend draws by (the metadataset's weights, or its repetitions), from
    the plan's Energon blend and repeat stages; None if nothing (one source, or the schedule
    replaces the metadataset's blend)."""
    out: dict[str, Any] = {}
    for stage in plan.stages:
        if stage.energon and stage.name in (BLEND, REPEAT):
            out.update({k: list(v) if isinstance(v, tuple) else v for k, v in stage.settings})
    return out or None
