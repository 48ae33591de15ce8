"""Megatron-LM command-line flags for energon_ordering, and their mapping to OrderingConfig.

``add_energon_ordering_args(parser)`` adds an argparse group "energon ordering" that works as,
or inside, Megatron-LM's ``extra_args_provider``. No flag collides with Megatron-LM's own
(``megatron/training/arguments.py``, ``examples/multimodal/multimodal_args.py``): the full
target length of the warmup is the language model's sequence length (:func:`lm_seq_length`:
``--decoder-seq-length`` if set, else ``--seq-length``), the seed defaults to ``--seed``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from energon_ordering.config import (PLACEMENTS, PLANNED, PLANNED_MIX_SETTINGS, POOL_HOLDS,
                                     OrderingConfig)
from energon_ordering.errors import OrderingConfigError, OrderingError
from energon_ordering.pool.order import POOL_ORDERS
from energon_ordering.warmup.schedule import SeqLenWarmup
from energon_ordering.warmup.token_layout import OVERFLOW_POLICIES
from energon_ordering.mixture.policy import BLEND_POLICIES
from energon_ordering.yaml_file import load_yaml
from energon_ordering.errors import show

__all__ = ["add_energon_ordering_args", "lm_seq_length", "micro_batches_per_step", "ordering_config_from_args"]

#: The flags this module adds (checked against Megatron-LM's in the tests).
FLAGS = (
    "--length-sort-pool-size",
    "--length-sort-mode",
    "--length-sort-placement",
    "--length-sort-pool-holds",
    "--plan-window-steps",
    "--planned-mix",
    "--allow-global-batch-change",
    "--data-mixture-schedule",
    "--data-blend-policy",
    "--seq-length-warmup-steps",
    "--seq-length-warmup-start",
    "--seq-length-warmup-multiple-of",
    "--seq-length-warmup-overflow",
    "--ordering-seed",
    "--allow-dataloader-restart",
)


def add_energon_ordering_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the "energon ordering" flags to ``parser`` and returns it.

    Use directly as Megatron-LM's ``extra_args_provider``, or call it from your own provider.
    Defaults of None mean "take it from the recipe (--data-mixture-schedule) or Megatron".
    """
    g = parser.add_argument_group(title="energon ordering")
    g.add_argument("--length-sort-pool-size", type=int, default=None,
                   help="Samples per length pool per loader worker; 0 turns the pool off "
                        "(same flag name as the reference implementation).")
    g.add_argument("--length-sort-mode", choices=[*sorted(POOL_ORDERS), PLANNED], default=None,
                   help="sample: permute sorted samples (reference); batch: permute sorted "
                        "micro-batch chunks (near padding-free); planned: no pool, every rank "
                        "reads its micro-batches of one plan of the global order (needs "
                        "--length-sort-placement pre-encode, --length-sort-pool-holds keys and "
                        "a length index).")
    g.add_argument("--plan-window-steps", type=int, default=None,
                   help="With --length-sort-mode planned: optimizer steps per window of the "
                        "plan (the ranks are balanced within a window). Default: sized for the "
                        "global batch, about 2^19 samples in 32-128 steps with --planned-mix "
                        "step, about 2^22 samples (2^20 with a sequence-length warmup) in at most "
                        "4,096 steps with window.")
    g.add_argument("--planned-mix", choices=list(PLANNED_MIX_SETTINGS), default=None,
                   help="With --length-sort-mode planned: where the blend's mix holds; step: "
                        "every optimizer step; window: every plan window, its steps banded by "
                        "length (less idle and padding at 1-2 micro-batches per step); auto "
                        "(default): step where --data-mixture-schedule changes the weights over "
                        "training, else window.")
    g.add_argument("--allow-global-batch-change", action="store_true", default=None,
                   help="With --length-sort-mode planned: a resume may change the global batch "
                        "size (at a plan window boundary; the order continues with the new one).")
    g.add_argument("--length-sort-placement", choices=list(PLACEMENTS), default=None,
                   help="post-encode: pool encoded samples (default); pre-encode: pool the "
                        "samples before decoding (compressed files, or keys only; lengths from "
                        "a length index, see `energon-ordering index`).")
    g.add_argument("--length-sort-pool-holds", choices=list(POOL_HOLDS), default=None,
                   help="With pre-encode: raw (default; the compressed files) or keys (restore "
                        "key + length only; each sample is read again when emitted).")
    g.add_argument("--data-mixture-schedule", type=str, default=None,
                   help="A recipe YAML (OrderingConfig settings) or a bare schedule YAML "
                        "(sources: / phases:); weights become a function of the step.")
    g.add_argument("--data-blend-policy", choices=list(BLEND_POLICIES), default=None,
                   help="How the scheduled blend draws sources.")
    g.add_argument("--seq-length-warmup-steps", type=int, default=None,
                   help="Sequence-length warmup over this many steps (0 = off); grows to the "
                        "language model's length (--decoder-seq-length if set, else --seq-length).")
    g.add_argument("--seq-length-warmup-start", type=int, default=None,
                   help="Sequence length at step 0 of the warmup, in model tokens (a media "
                        "placeholder counts as the embeddings it expands to).")
    g.add_argument("--seq-length-warmup-multiple-of", type=int, default=None,
                   help="Warmup lengths are rounded down to a multiple of this (default 8).")
    g.add_argument("--seq-length-warmup-overflow", choices=list(OVERFLOW_POLICIES), default=None,
                   help="A sample whose media tokens alone exceed the cap: keep, drop or error.")
    g.add_argument("--ordering-seed", type=int, default=None,
                   help="Seed of the ordering (identical on all ranks); default --seed.")
    g.add_argument("--allow-dataloader-restart", action="store_true", default=False,
                   help="If a dataloader state that should be restored is missing or "
                        "unreadable, warn loudly and restart the data stream instead of failing.")
    return parser


def _err(flag: str, value: Any, msg: str) -> OrderingConfigError:
    return OrderingConfigError(f"{flag} = {show(value)}: {msg}")


def _data_parallel_size(args: Any) -> int:
    dp = getattr(args, "data_parallel_size", None)
    if dp:
        return int(dp)
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_data_parallel_world_size()
    except ImportError:
        pass
    world = getattr(args, "world_size", 1) or 1
    model = (getattr(args, "tensor_model_parallel_size", 1) or 1) * (
        getattr(args, "pipeline_model_parallel_size", 1) or 1) * (
        getattr(args, "context_parallel_size", 1) or 1)
    return max(1, int(world) // int(model))


def global_batch_size(args: Any) -> int | None:
    """The run's full global batch: ``--global-batch-size``, or under megatron-core 0.19's
    ``--step-batch-size-schedule`` (which Megatron-LM refuses beside ``--global-batch-size``
    and then sets ``args.global_batch_size`` to micro-batch x data-parallel size) the schedule's
    final batch size, parsed by megatron-core's own calculator, as it takes it."""
    schedule = getattr(args, "step_batch_size_schedule", None)
    if schedule:
        from megatron.core.num_microbatches_calculator import (
            StepBatchsizeNumMicroBatchesCalculator as Steps,
        )

        try:
            return int(Steps._parse_schedule(str(schedule), None)[-1][1])
        except (ValueError, IndexError) as e:
            raise _err("--step-batch-size-schedule", schedule,
                       f"megatron-core cannot parse it ({e}); use 'THRESHOLD:BATCH ...'.") from e
    gbs = getattr(args, "global_batch_size", None)
    return None if gbs is None else int(gbs)


def micro_batches_per_step(args: Any) -> int:
    """``global_batch_size / (micro_batch_size * data_parallel_size)``, validated; the global
    batch is :func:`global_batch_size` (a step schedule's final batch)."""
    mbs = getattr(args, "micro_batch_size", None)
    gbs = global_batch_size(args)
    if not mbs or mbs < 1:
        raise _err("--micro-batch-size", mbs, "must be an int >= 1.")
    dp = _data_parallel_size(args)
    if gbs is None:
        return 1
    if gbs % (mbs * dp):
        raise _err("--step-batch-size-schedule" if getattr(args, "step_batch_size_schedule", None)
                   else "--global-batch-size", gbs,
                   f"must be a multiple of --micro-batch-size ({mbs}) x data-parallel size ({dp}).")
    return gbs // (mbs * dp)


def lm_seq_length(args: Any) -> tuple[str, int | None]:
    """The language model's sequence length and the flag it came from.

    ``--decoder-seq-length`` if set, else ``--seq-length``: Megatron's multimodal
    ``model_provider`` overwrites ``args.seq_length`` with the image-embedding count (e.g. 576)
    before the data provider runs; the language model's length is ``--decoder-seq-length``.
    """
    dec = getattr(args, "decoder_seq_length", None)
    if dec:
        return "--decoder-seq-length", int(dec)
    seq = getattr(args, "seq_length", None)
    return "--seq-length", (int(seq) if seq else None)


def _total_steps(args: Any) -> int | None:
    samples = getattr(args, "train_samples", None)
    gbs = global_batch_size(args)
    if (getattr(args, "rampup_batch_size", None) or getattr(args, "step_batch_size_schedule", None)) and samples and gbs:
        # Under ramp-up our step is consumed samples // global batch size (see megatron_lm),
        # so the run ends at train_samples // gbs; Megatron's train_iters counts more iterations.
        return int(samples) // int(gbs)
    iters = getattr(args, "train_iters", None)
    if iters:
        return int(iters)
    if samples and gbs:
        return int(samples) // int(gbs)
    return None


def ordering_config_from_args(args: Any) -> OrderingConfig:
    """Builds the OrderingConfig from Megatron-LM args plus the "energon ordering" flags.

    Megatron's own args are used where they exist: ``--seq-length`` (warmup target),
    ``--seed`` (default ordering seed), ``--micro-batch-size``, ``--global-batch-size`` and the
    data-parallel size (micro-batches per step), ``--train-iters`` or ``--train-samples`` (total
    steps), ``--packing-buffer-size`` and ``--packing-seq-length`` (sequence packing). Settings come from the recipe given with ``--data-mixture-schedule`` first, explicit
    flags override them.

    Raises:
        OrderingConfigError: A bad value; the message names the flag.
    """
    base: dict[str, Any] = {}
    schedule_path = getattr(args, "data_mixture_schedule", None)
    if schedule_path:
        try:
            data = load_yaml(schedule_path, "--data-mixture-schedule")
        except OrderingError as e:
            raise OrderingConfigError(f"--data-mixture-schedule = {show(schedule_path)}: {e}") from e
        if not isinstance(data, dict):
            raise _err("--data-mixture-schedule", schedule_path, "must hold a YAML mapping.")
        if "sources" in data or "phases" in data:
            base["mixture_schedule"] = data  # a bare schedule file
        else:
            if isinstance(data.get("mixture_schedule"), str) and not Path(data["mixture_schedule"]).is_absolute():
                data = {**data, "mixture_schedule": str(Path(schedule_path).parent / data["mixture_schedule"])}
            base.update(data)

    def flag(name: str, key: str) -> None:
        value = getattr(args, name, None)
        if value is not None:
            base[key] = value

    flag("length_sort_pool_size", "length_sort_pool_size")
    flag("length_sort_mode", "length_sort_mode")
    if getattr(args, "length_sort_placement", None) is not None:
        base.pop("placement", None)  # the flag overrides the recipe's short spelling
    flag("length_sort_placement", "length_sort_placement")
    flag("length_sort_pool_holds", "length_sort_pool_holds")
    flag("plan_window_steps", "plan_window_steps")
    flag("planned_mix", "planned_mix")
    flag("allow_global_batch_change", "allow_global_batch_change")
    flag("data_blend_policy", "blend_policy")
    seed = getattr(args, "ordering_seed", None)
    if seed is None and "seed" not in base:
        seed = getattr(args, "seed", None)
    if seed is not None:
        base["seed"] = seed

    pool = base.get("length_sort_pool_size", 0)
    if not isinstance(pool, int) or pool < 0:
        raise _err("--length-sort-pool-size", pool, "must be an int >= 0 (0 = off).")
    mbs = getattr(args, "micro_batch_size", None)
    if pool and base.get("length_sort_mode") == "batch" and mbs and pool % mbs:
        raise _err("--length-sort-pool-size", pool,
                   f"must be a multiple of --micro-batch-size ({mbs}) with --length-sort-mode "
                   f"batch; use {max(1, pool // mbs) * mbs}.")
    # Megatron's own packing flags (examples/multimodal: --packing-buffer-size, default None =
    # off; --packing-seq-length, default 0 = unset); not duplicated here, only read.
    packing = getattr(args, "packing_buffer_size", None)
    if packing is not None and (not isinstance(packing, int) or packing < 1):
        raise _err("--packing-buffer-size", packing, "must be an int > 0 (or unset: no packing).")
    if packing:
        base["packing_buffer_size"] = packing
    pack_len = getattr(args, "packing_seq_length", None)
    if pack_len is not None and (not isinstance(pack_len, int) or pack_len < 0):
        raise _err("--packing-seq-length", pack_len, "must be an int > 0 (0 = unset).")
    if pack_len:
        base["pack_seq_length"] = pack_len
    base["micro_batches_per_step"] = micro_batches_per_step(args)
    total = _total_steps(args)
    if total is not None:
        sched = base.get("mixture_schedule")
        own_total = sched.get("total_steps") if isinstance(sched, dict) else None
        if base.get("total_steps") not in (None, total) or own_total not in (None, total):
            raise _err("--train-iters", total,
                       f"the recipe {show(schedule_path)} was written for total_steps = "
                       f"{base.get('total_steps') or own_total}; make them agree.")
        base["total_steps"] = total

    steps = getattr(args, "seq_length_warmup_steps", None)
    if steps is not None and steps < 0:
        raise _err("--seq-length-warmup-steps", steps, "must be >= 0 (0 = off).")
    if steps:
        start = getattr(args, "seq_length_warmup_start", None)
        if start is None:
            raise _err("--seq-length-warmup-start", None,
                       "is required with --seq-length-warmup-steps (the length at step 0).")
        full_flag, full = lm_seq_length(args)
        if not full:
            raise _err("--seq-length", full, "is the warmup's full length and must be set "
                       "(or --decoder-seq-length for a multimodal model).")
        multiple = getattr(args, "seq_length_warmup_multiple_of", None)
        multiple = 8 if multiple is None else multiple
        if multiple < 1:
            raise _err("--seq-length-warmup-multiple-of", multiple, "must be an int >= 1.")
        if start < 1 or start > full:
            raise _err("--seq-length-warmup-start", start,
                       f"must lie in [1, {full_flag} = {full}] (the warmup grows to the language "
                       f"model's length, {full_flag}).")
        if start < multiple:
            raise _err("--seq-length-warmup-start", start,
                       f"must be >= --seq-length-warmup-multiple-of = {multiple} (lengths are "
                       "rounded down to that multiple).")
        base["seq_length_warmup"] = SeqLenWarmup(start=start, full=full, warmup_steps=steps,
                                                 multiple_of=multiple)
    elif steps == 0:
        base.pop("seq_length_warmup", None)
    if steps is None:  # the warmup flags define a warmup together: none is read alone
        for flag_name in ("seq_length_warmup_start", "seq_length_warmup_multiple_of"):
            value = getattr(args, flag_name, None)
            if value is not None:
                raise _err("--" + flag_name.replace("_", "-"), value,
                           "is read only with --seq-length-warmup-steps N > 0 (the warmup "
                           "flags define a warmup together); add --seq-length-warmup-steps, or "
                           "drop it (a recipe's seq_length_warmup sets its own start and "
                           "multiple_of).")
    overflow = getattr(args, "seq_length_warmup_overflow", None)
    if overflow is not None:
        base["seq_length_overflow"] = overflow
        if isinstance(base.get("seq_length_warmup"), dict):
            base["seq_length_warmup"] = {k: v for k, v in base["seq_length_warmup"].items() if k != "overflow"}
    try:
        cfg = OrderingConfig.from_dict(base)
    except OrderingError as e:
        raise OrderingConfigError(f"--data-mixture-schedule / energon ordering flags: {e}") from e
    warmup = cfg.seq_length_warmup
    lm_flag, lm_len = lm_seq_length(args)
    if warmup is not None and lm_len and warmup.full > lm_len:
        raise _err("--data-mixture-schedule", schedule_path,
                   f"seq_length_warmup.full = {warmup.full} exceeds {lm_flag} = {lm_len}: the warmup "
                   f"would grow past what the language model takes. Set full <= {lm_len} in the "
                   "recipe, or use --seq-length-warmup-steps/--seq-length-warmup-start (full = "
                   f"{lm_flag}).")
    return cfg
