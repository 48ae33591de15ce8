"""Which stages a training pipeline gets, in which order, with which settings, and why.

:func:`plan_pipeline` is a pure function of an :class:`OrderingConfig` and Energon's build
arguments (:class:`BuildArgs`). It validates the combination once, then returns a
:class:`PipelinePlan`: the README's pipeline diagram as a frozen value, printable with
:meth:`PipelinePlan.describe` and testable without a dataset. The task encoder's hooks only
instantiate what the plan says (``energon_ordering.task_encoder``).

Checks that need the data (a pool larger than a loader worker's share of repeating data, a
length index that is missing or stale, schedule sources absent from the metadataset) run where
their stage is instantiated; everything else is refused here, before any dataset is opened.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from energon_ordering.config import MAX_PLAN_WINDOW_SAMPLES, OrderingConfig
from energon_ordering.errors import OrderingConfigError
from energon_ordering.pool.order import BATCHED_MODES
from energon_ordering.source_tag import SOURCE_KEY
from energon_ordering.errors import show
from energon_ordering.planned.window_size import (
    PACKED_PLAN_BYTES_PER_SAMPLE,
    packed_samples_per_pack,
    packed_step_over_budget,
    steps_within_an_epoch,
    window_epoch_draws,
)

__all__ = [
    "BATCH",
    "BLEND",
    "BuildArgs",
    "DEFER",
    "ENCODE",
    "INPUT_END",
    "EPOCHIZE",
    "KEY_POOL",
    "LENGTH_POOL",
    "LOAD",
    "MATERIALIZE",
    "PACKING",
    "PACK_CAP",
    "PACK_POOL",
    "PLANNED_PACK",
    "PLANNED_SOURCE",
    "PipelinePlan",
    "REPEAT",
    "SCHEDULED_BLEND",
    "SHUFFLE",
    "STAMP",
    "SEQ_WARMUP",
    "Source",
    "Stage",
    "lag_batches",
    "plan_pipeline",
]

# Stage names: the Energon or energon_ordering class (or Energon step) each stage instantiates.
LOAD = "load"  #: Energon's ``_load_dataset``: a source's shard reader and ``load_sample``.
DEFER = "Defer"
REPEAT = "RepeatDataset"
SHUFFLE = "FiniteShuffleBufferDataset"
BLEND = "BlendDataset"
SCHEDULED_BLEND = "ScheduledBlendDataset"
KEY_POOL = "KeyPoolSortDataset"
MATERIALIZE = "Materialize"
ENCODE = "encode_sample"  #: Energon's ``build_encode_sample``.
LENGTH_POOL = "LengthPoolSortDataset"
PACK_CAP = "PackCapDataset"
PACKING = "FinitePackingDataset"
PACK_POOL = "PackPoolSortDataset"
SEQ_WARMUP = "SeqLenWarmupDataset"
INPUT_END = "InputEndDataset"  #: reports the end of the batcher's input (a finite epoch's last batch).
BATCH = "BatchDataset"  #: Energon's ``build_batch``: ``batch`` then ``encode_batch``.
EPOCHIZE = "EpochizeDataset"
STAMP = "PipelineStampDataset"
PLANNED_SOURCE = "PlannedSourceDataset"  #: the planned global order's reader (replaces LOAD..BLEND).

#: Energon loading settings the planned order replaces: accepted, unused, logged once.
PLANNED_PACK = "PlannedPackDataset"  #: the planned order's packs (replaces Energon's packing).
PLANNED_UNUSED = ("shuffle_buffer_size", "max_samples_per_sequence", "parallel_shard_iters")

#: Energon's ``DatasetBlendMode`` values.
BlendMode = Literal["none", "dataset_weight", "sample_repetitions"]


@dataclasses.dataclass(frozen=True)
class Source:
    """One dataset of the (meta)dataset, as the plan and the state stamp need it.

    Args:
        name: Its source name (``subflavors.source`` or its folder name); only read with a
            mixture schedule. None: not named.
        weight: The metadataset's ``weight`` (``blend:``); None if it gives none.
        repetitions: The metadataset's ``repetitions`` (``blend_epochized:``); None if none.
        uuid: Energon's ``.nv-meta/index.uuid`` of the prepared dataset (a new one per prepare).
        split: A digest of its split: shard names and sample counts, excludes, subset.
        max_samples_per_sequence: Energon's shard-slice length, in samples.
        shuffle_over_epochs: Energon's shard shuffle setting.
        parallel_shard_iters: Energon's shard iterators per worker.
    """

    name: str | None = None
    weight: float | None = None
    repetitions: float | None = None
    uuid: str | None = None
    split: str | None = None
    max_samples_per_sequence: int | None = None
    shuffle_over_epochs: int | None = None
    parallel_shard_iters: int | None = None


@dataclasses.dataclass(frozen=True)
class BuildArgs:
    """Energon's ``build_train_datasets`` arguments, and what the task encoder defines itself.

    Args:
        batch_size: Micro-batch size in samples; None: no batching.
        packing_buffer_size: ``get_train_dataset(packing_buffer_size=...)``; None: not given.
        shuffle_buffer_size: Energon's per-rank shuffle buffer in samples; None or <= 1: off.
        repeat: Repeat the data (False: one finite epoch).
        blend_mode: Energon's ``DatasetBlendMode`` of the metadataset (its ``.value``).
        batch_drop_last: Energon's ``batch_drop_last``.
        virtual_epoch_length: Energon's virtual epoch in batches; 0: off.
        num_workers: Loader worker processes per rank (0: in-process).
        world_size: Data-parallel ranks (the ``WorkerConfig``'s); None: not known (the planned
            order's window is then bounded as if there were one).
        sources: The datasets of the (meta)dataset, in Energon's order.
        encoder: The task encoder's class name, for messages.
        own_select_samples_to_pack: The encoder defines ``select_samples_to_pack``.
        own_batch_group_criterion: The encoder defines ``batch_group_criterion``.
        packer: Qualified names of the ``select_samples_to_pack`` and ``pack_selected_samples``
            that packing uses (the encoder's own or the package's defaults).
        index_fill: The encoder's ``ordering_index_fill``.
    """

    batch_size: int | None
    packing_buffer_size: int | None = None
    shuffle_buffer_size: int | None = None
    repeat: bool = True
    blend_mode: BlendMode = "none"
    batch_drop_last: bool = False
    virtual_epoch_length: int = 0
    num_workers: int = 0
    world_size: int | None = None
    sources: tuple[Source, ...] = (Source(),)
    encoder: str = "TaskEncoder"
    own_select_samples_to_pack: bool = False
    own_batch_group_criterion: bool = False
    packer: tuple[str, str] = (
        "OrderingTaskEncoder.ordering_select_samples_to_pack",
        "OrderingTaskEncoder.ordering_pack_selected_samples",
    )
    index_fill: bool = True


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the training pipeline.

    Args:
        name: The class (or Energon step) it instantiates; one of this module's stage names.
        why: One line: why the configuration has it, and what it does to the order.
        settings: The constructor arguments the plan decides, as ``(name, value)`` pairs; the
            hook adds what comes from the task encoder (key functions, token layout, sources).
        per_source: Built once per source, before the sources are combined.
        energon: Energon's own stage, built by Energon's code.
    """

    name: str
    why: str
    settings: tuple[tuple[str, Any], ...] = ()
    per_source: bool = False
    energon: bool = False

    @property
    def kwargs(self) -> dict[str, Any]:
        """The settings as keyword arguments of the stage's constructor."""
        return dict(self.settings)

    def __str__(self) -> str:
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.settings)
        return f"{self.name}({args})" if args else self.name


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """The stages of one training pipeline, in order (see :func:`plan_pipeline`).

    Args:
        config: The ordering configuration it was planned from.
        args: Energon's build arguments it was planned for.
        stages: The stages from the sources to the top; ``per_source`` ones come first.
        packing_buffer_size: The packing buffer in effect (from the config or Energon's
            argument); None: no packing.
    """

    config: OrderingConfig
    args: BuildArgs
    stages: tuple[Stage, ...]
    packing_buffer_size: int | None

    def stage(self, name: str) -> Stage | None:
        """The stage called ``name``, or None if the pipeline has none."""
        return next((s for s in self.stages if s.name == name), None)

    def has(self, name: str) -> bool:
        """True if the pipeline has a stage called ``name``."""
        return self.stage(name) is not None

    def __iter__(self) -> Iterator[Stage]:
        return iter(self.stages)

    @property
    def default_packer(self) -> bool:
        """Packing with the package's first-fit-decreasing packer (the encoder has none)."""
        return self.packing_buffer_size is not None and not self.args.own_select_samples_to_pack

    def describe(self) -> str:
        """The pipeline diagram: each stage with its settings, then why it is there."""
        a = self.args
        names = [s.name for s in a.sources if s.name is not None]
        lines = [
            f"training pipeline (batch_size={a.batch_size}, packing_buffer_size="
            f"{self.packing_buffer_size}, shuffle_buffer_size={a.shuffle_buffer_size}, "
            f"repeat={a.repeat}, num_workers={a.num_workers}, {len(a.sources)} source(s)"
            f"{' ' + str(names) if names else ''}):"
        ]
        for i, s in enumerate(self.stages, 1):
            tags = [t for t, on in (("Energon", s.energon), ("per source", s.per_source)) if on]
            lines.append(f"  {i:2d}. {s}{'  [' + ', '.join(tags) + ']' if tags else ''}")
            lines.append(f"        {s.why}")
        return "\n".join(lines)

    __str__ = describe


def lag_batches(config: OrderingConfig, batch_size: int | None, num_workers: int) -> float:
    """Rank-level batches the scheduled blend looks ahead (lag compensation); 0 if off."""
    if not (config.length_sort_enabled and config.schedule_lag_compensation):
        return 0.0
    per_batch = batch_size or 1
    lag = (config.length_sort_pool_size / per_batch - 1) / 2 * max(1, num_workers)
    return max(0.0, lag)


def plan_pipeline(config: OrderingConfig, args: BuildArgs) -> PipelinePlan:
    """Validates ``config`` against Energon's build arguments and plans the training pipeline.

    Raises:
        OrderingConfigError: A combination that cannot be built; the message names the
            setting, its value and the fix.
    """
    packing = _packing_buffer_size(config, args)
    _validate(config, args, packing)
    plan = PipelinePlan(
        config=config,
        args=args,
        stages=tuple(_stages(config, args, packing)),
        packing_buffer_size=packing,
    )
    _check_energon_weights(plan)
    return plan


def _check_energon_weights(plan: PipelinePlan) -> None:
    """Energon's blend by the metadataset's weights takes each weight > 0 (its bare
    ``AssertionError`` otherwise, at the first batch)."""
    blend = plan.stage(BLEND)
    weights = None if blend is None else blend.kwargs.get("weights")
    if weights is not None and not all(math.isfinite(w) and w > 0 for w in weights):
        named = {(s.name or f"entry {i}"): s.weight for i, s in enumerate(plan.args.sources)}
        raise OrderingConfigError(
            f"the metadataset's blend weights are {show(named)} (entries in the order of its "
            "`blend:` list), and Energon blends by them "
            "only where every weight is > 0: give every `blend:` entry a weight > 0 (remove an "
            "entry to leave it out), or use a mixture_schedule, whose weights may be 0.")


def _packing_buffer_size(cfg: OrderingConfig, args: BuildArgs) -> int | None:
    packing = args.packing_buffer_size
    if cfg.packing_buffer_size is None:
        return packing
    if packing is not None and packing != cfg.packing_buffer_size:
        raise OrderingConfigError(
            f"OrderingConfig.packing_buffer_size = {cfg.packing_buffer_size} contradicts "
            f"get_train_dataset(packing_buffer_size={packing}); give it once (Megatron: "
            "--packing-buffer-size)."
        )
    return cfg.packing_buffer_size


def _validate_planned(cfg: OrderingConfig, args: BuildArgs, packing: int | None) -> None:
    """What ``length_sort_mode = "planned"`` cannot be combined with (yet)."""
    mode = "OrderingConfig.length_sort_mode = 'planned'"
    if args.batch_size is None:
        raise OrderingConfigError(
            f"{mode} plans micro-batches; pass batch_size to get_train_dataset.")
    if packing is not None and cfg.pack_seq_length is None and cfg.seq_length_warmup is None:
        raise OrderingConfigError(
            f"{mode} with packing (packing_buffer_size = {packing}) plans every pack to its "
            "step's cap: set OrderingConfig.pack_seq_length (Megatron: --packing-seq-length).")
    schedule = cfg.mixture_schedule
    names = [s.name for s in args.sources]
    if schedule is not None and None not in names and set(schedule.sources) != set(names):
        raise OrderingConfigError(
            f"OrderingConfig.mixture_schedule names the sources {list(schedule.sources)}, but "
            f"the metadataset has {names}; {mode} plans exactly the metadataset's sources: give "
            "the schedule one weight per metadataset entry (by its `subflavors: {source: ...}`).")
    if args.own_batch_group_criterion:
        raise OrderingConfigError(
            f"{mode} cannot be combined with {args.encoder}.batch_group_criterion; remove the "
            "override.")
    if args.blend_mode == "sample_repetitions" or any(
        s.repetitions not in (None, 1) for s in args.sources
    ):
        raise OrderingConfigError(
            f"{mode}: the metadataset uses `blend_epochized` repetitions; the planned order "
            "draws by blend weights: use `blend:` with weights.")
    _check_planned_weights(args)
    _check_window_size(cfg, args, packing is not None)


def _check_planned_weights(args: BuildArgs) -> None:
    """Each metadataset weight finite and >= 0, one > 0: the plan draws about weight x G
    samples of each source per step (a negative weight was an untyped ``negative dimensions``
    error at the first batch)."""
    mode = "OrderingConfig.length_sort_mode = 'planned'"
    weights = [s.weight for s in args.sources]
    if any(w is not None and (isinstance(w, bool) or not isinstance(w, (int, float))
                              or not math.isfinite(w) or w < 0) for w in weights):
        named = {(s.name or f"entry {i}"): s.weight for i, s in enumerate(args.sources)}
        raise OrderingConfigError(
            f"{mode}: the metadataset's blend weights are {show(named)} (Energon divides each "
            "by their sum, so one negative weight can turn the others negative); the plan draws "
            "each source by its weight: give every `blend:` entry a finite weight >= 0.")
    if weights and all(w is not None and w == 0 for w in weights):
        raise OrderingConfigError(
            f"{mode}: every weight of the metadataset is 0; nothing would be drawn: give at "
            "least one `blend:` entry a weight > 0.")


def window_steps(cfg: OrderingConfig, args: BuildArgs, packed: bool,
                 samples_per_pack: float | None = None) -> int:
    """K of the planned order under ``cfg`` for Energon's build arguments (``plan_window_steps``,
    or its default for the global batch: :meth:`OrderingConfig.window_steps`; packed, with
    ``samples_per_pack`` once the length index is read: :func:`packed_window_steps`)."""
    return cfg.window_steps(args.world_size or 1, args.batch_size or 1, packed,
                            samples_per_pack=samples_per_pack)


def packed_window_steps(cfg: OrderingConfig, args: BuildArgs, lengths: Sequence[np.ndarray],
                        samples_per_pack: float | None = None) -> int:
    """K of a packed planned order, read off the length index: :func:`run_window_steps`."""
    return run_window_steps(cfg, args, lengths, True, samples_per_pack)


def run_window_steps(cfg: OrderingConfig, args: BuildArgs, lengths: Sequence[np.ndarray],
                     packed: bool, samples_per_pack: float | None = None) -> int:
    """K the planned order plans with, read off the length index: ``plan_window_steps`` if
    given; else the mix's default (:func:`window_steps`; packed, after the samples a pack holds,
    :func:`run_samples_per_pack`, ``samples_per_pack`` where already read), on repeating data
    at most the steps in which no source is drawn beyond its size
    (:func:`~energon_ordering.planned.window_size.steps_within_an_epoch`): a window sorts its
    draws by length, so the copies of a sample drawn twice in it (one length) would share an
    optimizer step. The same on every rank and at every resume (a pure function of the length
    index, the weights and the global batch)."""
    if cfg.plan_window_steps is not None:
        return int(cfg.plan_window_steps)
    if packed and samples_per_pack is None:
        samples_per_pack = run_samples_per_pack(cfg, args, lengths)
    k = window_steps(cfg, args, packed, samples_per_pack if packed else None)
    if args.repeat:
        k = min(k, steps_within_an_epoch([len(x) for x in lengths], run_weight_rows(cfg, args),
                                         _samples_per_step(cfg, args, samples_per_pack)))
    return k


def window_repeat_note(cfg: OrderingConfig, args: BuildArgs, lengths: Sequence[np.ndarray],
                       k: int, samples_per_pack: float | None = None,
                       names: Sequence[str] | None = None) -> str | None:
    """What to say where a window of ``k`` steps draws a source of repeating data beyond its
    size (its samples' copies then share optimizer steps), else None. ``names``: each source's
    name in the text (default: the sources' own, else their position)."""
    if not args.repeat:
        return None
    sizes = [len(x) for x in lengths]
    rows = run_weight_rows(cfg, args)
    per_step = _samples_per_step(cfg, args, samples_per_pack)
    share = window_epoch_draws(sizes, rows, per_step, k)
    over = [s for s in range(len(sizes)) if share[s] > 1]
    if not over:
        return None
    fit = steps_within_an_epoch(sizes, rows, per_step)
    if names is None:
        names = [s.name or f"source {i}" for i, s in enumerate(args.sources)]
    what = "; ".join(f"{show(names[s])}: {sizes[s]:,} samples, about "
                     f"{share[s] * sizes[s]:,.0f} drawn a window" for s in over)
    if fit >= k:  # a source smaller than its share of one step
        return (f"length_sort_mode = 'planned': a source of repeating data is smaller than "
                f"what one optimizer step draws of it ({what}): its samples repeat within "
                f"steps. Give it more samples or a lower weight.")
    # k > fit: a given plan_window_steps (the default is at most fit)
    return (f"length_sort_mode = 'planned': a plan window of {k:,} steps draws a source of "
            f"repeating data beyond its size ({what}); the window sorts its draws by length, "
            f"so the copies of a sample share an optimizer step. Set plan_window_steps <= "
            f"{fit:,} (or leave it unset: the default keeps every window within one epoch of "
            f"each source).")


def _samples_per_step(cfg: OrderingConfig, args: BuildArgs,
                      samples_per_pack: float | None) -> float:
    """Samples an optimizer step draws: ``R M B`` padded; packed, its packs times the most
    samples a pack holds (``samples_per_pack``)."""
    g = (args.world_size or 1) * cfg.micro_batches_per_step * (args.batch_size or 1)
    return g * (1.0 if samples_per_pack is None else float(samples_per_pack))


def run_samples_per_pack(cfg: OrderingConfig, args: BuildArgs,
                         lengths: Sequence[np.ndarray]) -> float:
    """The most samples a pack holds on average under any of the run's weights (the blend
    weights, or the mixture schedule's at the ends of its pieces) at the run's largest cap
    (``pack_seq_length``, else the warmup's ``full``): :func:`packed_samples_per_pack`."""
    return packed_samples_per_pack(lengths, run_weight_rows(cfg, args), _packed_cap(cfg))


def _packed_cap(cfg: OrderingConfig) -> int:
    """The largest cap a packed plan packs to: ``pack_seq_length``, else the warmup's
    ``full``."""
    return int(cfg.pack_seq_length if cfg.pack_seq_length is not None
               else cfg.seq_length_warmup.full)


def packed_step_note(cfg: OrderingConfig, args: BuildArgs, samples_per_pack: float) -> str | None:
    """What to say where one packed optimizer step alone is over the plan window's budget of
    samples (:func:`~energon_ordering.planned.window_size.packed_step_over_budget`), else None."""
    packs = (args.world_size or 1) * cfg.micro_batches_per_step * (args.batch_size or 1)
    samples = packed_step_over_budget(cfg.resolved_planned_mix, packs, samples_per_pack)
    if samples is None:
        return None
    cap = _packed_cap(cfg)
    mib = samples * PACKED_PLAN_BYTES_PER_SAMPLE / 2**20
    return (f"length_sort_mode = 'planned' with packing: one optimizer step of {packs:,} packs "
            f"holds about {samples:,.0f} samples ({samples_per_pack:,.1f} a pack of {cap:,} "
            f"tokens on the length index), and a step is planned at once: the loader worker "
            f"that plans it peaks near {mib:,.0f} MiB, above the plan window's budget (a window "
            f"is one step here, whatever plan_window_steps is). Fewer tokens a step lower it "
            f"(fewer micro_batches_per_step or data-parallel ranks, a smaller pack_seq_length).")


def run_weight_rows(cfg: OrderingConfig, args: BuildArgs) -> np.ndarray:
    """``[n, S]`` weights the planned order can draw by, in the metadataset's source order: the
    blend weights, or the mixture schedule's at the ends of its pieces (between them a
    weighted mean moves monotonically)."""
    schedule = cfg.mixture_schedule
    if schedule is None:
        return np.asarray([[1.0 if s.weight is None else float(s.weight)
                            for s in args.sources]])
    columns = schedule.columns_of([s.name for s in args.sources])
    return schedule.weights_table(schedule.piece_ends())[:, columns]


def _check_window_size(cfg: OrderingConfig, args: BuildArgs, packed: bool) -> None:
    """The plan of a window, K x R x M x B sample ids, within
    :data:`~energon_ordering.config.MAX_PLAN_WINDOW_SAMPLES` (every loader worker that plans
    a window holds it, and while planning it up to about 11 times as much with the step mix,
    1.2-5 times with the window mix, which builds it in place)."""
    K, M, B = window_steps(cfg, args, packed), cfg.micro_batches_per_step, args.batch_size or 1
    R = args.world_size or 1
    samples = K * R * M * B
    if samples > MAX_PLAN_WINDOW_SAMPLES:
        fit = MAX_PLAN_WINDOW_SAMPLES // (R * M * B)
        fix = (f"use plan_window_steps <= {fit:,}" if fit >= 1 else
               "a single step is over it: lower the micro-batch size or micro-batches per step")
        raise OrderingConfigError(
            f"OrderingConfig.plan_window_steps = {K:,}: a window plans K x R x M x B = {K:,} "
            f"steps x {R:,} ranks x {M:,} micro-batches x {B:,} samples = {samples:,} samples "
            f"({samples * 8 / 2**20:,.0f} MiB of int64 ids, up to about 11x that while "
            f"planning, in every loader worker), over the limit of "
            f"{MAX_PLAN_WINDOW_SAMPLES:,}; {fix}.")


def _validate(cfg: OrderingConfig, args: BuildArgs, packing: int | None) -> None:
    if cfg.planned:
        _validate_planned(cfg, args, packing)
    if packing is not None:
        if cfg.length_sort_enabled and cfg.pack_pool_placement == "packs" and (
            cfg.length_sort_placement == "pre-encode"
        ):
            raise OrderingConfigError(
                "OrderingConfig.pack_pool_placement = 'packs' pools packs after packing, so "
                "it cannot also sit before encoding (length_sort_placement = 'pre-encode'); "
                "use pack_pool_placement = 'samples' with the pre-encode pool."
            )
        if (
            not args.own_select_samples_to_pack
            and cfg.pack_seq_length is None
            and cfg.seq_length_warmup is None
        ):
            raise OrderingConfigError(
                f"{args.encoder} has no select_samples_to_pack, so packing "
                f"(packing_buffer_size = {packing}) uses the default first-fit-decreasing "
                "packer, which needs OrderingConfig.pack_seq_length (Megatron: "
                "--packing-seq-length); set it or define select_samples_to_pack."
            )
    stages = []
    if cfg.length_sort_enabled:
        stages.append(f"length_sort_pool_size = {cfg.length_sort_pool_size}")
    if cfg.seq_length_warmup is not None:
        stages.append("seq_length_warmup")
    if stages and args.own_batch_group_criterion:
        raise OrderingConfigError(
            f"OrderingConfig.{' and '.join(stages)} cannot be combined with "
            f"{args.encoder}.batch_group_criterion yet; remove the override or turn the "
            "ordering stage off."
        )
    if cfg.length_sort_enabled and cfg.length_sort_mode in BATCHED_MODES and args.batch_size is None:
        raise OrderingConfigError(
            f"OrderingConfig.length_sort_mode = {show(cfg.length_sort_mode)} needs batching; pass "
            "batch_size to get_train_dataset or use length_sort_mode = 'sample'."
        )
    if cfg.mixture_schedule is not None:
        names = [s.name for s in args.sources]
        epochized = [s.name for s in args.sources if s.repetitions not in (None, 1)]
        if epochized:
            raise OrderingConfigError(
                f"OrderingConfig.mixture_schedule replaces the metadataset's blend, but the "
                f"entries {epochized} use `blend_epochized` repetitions, which a step schedule "
                "cannot honour; use `blend:` with weights (they are replaced by the schedule)."
            )
        if len(set(names)) != len(names):
            raise OrderingConfigError(
                f"OrderingConfig.mixture_schedule: metadataset entries share source names "
                f"{names}; give each blend entry its own `subflavors: {{{SOURCE_KEY}: NAME}}`."
            )


def _stages(cfg: OrderingConfig, args: BuildArgs, packing: int | None) -> Iterator[Stage]:
    """The stages, in pipeline order (the validation has run)."""
    if cfg.planned:
        yield from _planned_stages(cfg, args, packing)
        return
    pool = cfg.length_sort_enabled
    warmup = cfg.seq_length_warmup
    pool_of_packs = packing is not None and pool and cfg.pack_pool_placement == "packs"
    pre_encode = pool and cfg.length_sort_placement == "pre-encode"
    shuffle = args.shuffle_buffer_size is not None and args.shuffle_buffer_size > 1
    bs = args.batch_size

    yield Stage(LOAD, "reads the source's shard slices (Energon shuffles their order)",
                per_source=True, energon=True)
    if pre_encode:
        yield Stage(
            DEFER,
            "loading split off: the pool holds undecoded samples, decoding runs after it",
            (("index_fill", args.index_fill and cfg.length_sort_pool_holds == "keys"),),
            per_source=True,
        )
    if cfg.mixture_schedule is not None:
        if args.repeat:
            yield Stage(REPEAT, "each source repeats on its own: the schedule may draw any "
                        "source at any step", per_source=True, energon=True)
        if shuffle:
            yield Stage(SHUFFLE, "per source, before the blend: a buffer behind the blend "
                        "would delay a phase switch by its size", (("size", args.shuffle_buffer_size),),
                        per_source=True)
        yield Stage(
            SCHEDULED_BLEND,
            "draws each sample's source by the schedule's weights at its step (the "
            "metadataset's weights are replaced)",
            (
                ("schedule", cfg.mixture_schedule),
                ("micro_batches_per_step", cfg.micro_batches_per_step),
                ("batch_size", bs),
                ("policy", cfg.blend_policy),
                ("lag_batches", lag_batches(cfg, bs, args.num_workers)),
                ("allow_schedule_change", cfg.allow_schedule_change),
            ),
        )
    else:
        yield from _energon_blend(args, shuffle)
    if pre_encode:
        yield Stage(
            KEY_POOL,
            "lean length pool before decoding, lengths from the length index: the "
            "same order on every rank (rank-independent seed)",
            (*_sample_pool_settings(cfg, bs), ("keep_samples", cfg.length_sort_pool_holds == "raw")),
        )
        yield Stage(MATERIALIZE, "loads (and decodes) what the pool emitted")
    yield Stage(ENCODE, "the task encoder's encode_sample (stateless)", energon=True)
    if pool and not pre_encode and not pool_of_packs:
        yield Stage(
            LENGTH_POOL,
            "cross-rank length sync: sorts a pool by length and permutes it with a "
            "rank-independent seed",
            _sample_pool_settings(cfg, bs),
        )
    if packing is not None:
        yield from _packing_stages(cfg, args, packing, pool_of_packs)
    elif warmup is not None:
        yield _warmup_stage(cfg)
    yield from _batch_tail(args, bs)


def _warmup_stage(cfg: OrderingConfig) -> Stage:
    return Stage(
        SEQ_WARMUP,
        "cuts each sample to max_seq_len of the step it is emitted in (at batch time: "
        "the emission step, so a resume cuts alike)",
        (
            ("warmup", cfg.seq_length_warmup),
            ("micro_batches_per_step", cfg.micro_batches_per_step),
            ("overflow", cfg.seq_length_overflow),
        ),
    )


def _batch_tail(args: BuildArgs, batch_size: int | None) -> Iterator[Stage]:
    """Every training pipeline's end: the input-end report, Energon's batching and virtual
    epoch, the stamp."""
    yield Stage(INPUT_END, "reports the end of the batcher's input to the stamp: a finite epoch's "
                "last, partial batch goes out after every stage below has ended")
    yield Stage(BATCH, "batch -> encode_batch",
                (("batch_size", batch_size), ("drop_last", args.batch_drop_last)), energon=True)
    if args.virtual_epoch_length > 0:
        yield Stage(EPOCHIZE, "Energon's virtual epoch", (("length", args.virtual_epoch_length),),
                    energon=True)
    yield Stage(STAMP, "stamps what the continuation depends on; a restore is checked "
                "against it before any stage below reads the state")


def _planned_stages(cfg: OrderingConfig, args: BuildArgs,
                    packing: int | None) -> Iterator[Stage]:
    """The planned global order: one source stage replaces Energon's loading, blend, repeat
    and shuffle; Energon's decoding, encode_sample and batching follow as in every mode. With
    packing the plan's packs replace Energon's packer (the encoder's pack_selected_samples
    packs each)."""
    weights = tuple(1.0 if s.weight is None else float(s.weight) for s in args.sources)
    packed = packing is not None
    mix = cfg.resolved_planned_mix
    yield Stage(
        PLANNED_SOURCE,
        "reads this rank's micro-batches of the plan of the global order (the same plan on "
        "every rank, from the length index) by byte range, then Energon's decoding; "
        "micro-batch b from loader worker b % num_workers"
        + ("; with packing, B packs per micro-batch, each built to its step's cap and the "
           "ranks balanced by attention cost" if packed else ""),
        (
            *((("pack_seq_length", cfg.pack_seq_length),
               ("warmup", cfg.seq_length_warmup)) if packed else ()),
            ("seed", cfg.seed),
            ("window_steps", window_steps(cfg, args, packed)),
            ("micro_batches_per_step", cfg.micro_batches_per_step),
            ("batch_size", args.batch_size),
            ("weights", weights),
            ("finite", not args.repeat),
            ("schedule", cfg.mixture_schedule),
            ("source_names", tuple(s.name for s in args.sources)
             if cfg.mixture_schedule is not None else None),
            ("allow_global_batch_change", cfg.allow_global_batch_change),
            ("planned_mix", mix),
            # the window mix places each sample at a step whose warmup cap it fits
            *((("warmup", cfg.seq_length_warmup),)
              if mix == "window" and not packed else ()),
        ),
    )
    yield Stage(ENCODE, "the task encoder's encode_sample (stateless)", energon=True)
    if packed:
        yield Stage(
            PLANNED_PACK,
            "groups the encoded samples into the plan's packs, cuts a sample to its pack's cap, "
            f"and packs each with {args.packer[1]} (the plan replaces {args.packer[0]} and "
            "Energon's packing buffer)",
            (("overflow", cfg.seq_length_overflow),
             ("micro_batches_per_step", cfg.micro_batches_per_step)),
        )
    elif cfg.seq_length_warmup is not None:
        yield _warmup_stage(cfg)
    yield from _batch_tail(args, args.batch_size)


def _energon_blend(args: BuildArgs, shuffle: bool) -> Iterator[Stage]:
    """Energon's own blend, repeat and shuffle (its ``build_train_datasets``), as it builds them."""
    mode = args.blend_mode
    many = len(args.sources) > 1
    if mode == "dataset_weight" or (mode == "none" and args.repeat):
        yield Stage(REPEAT, "Energon repeats each source before blending", per_source=True,
                    energon=True)
        if many:
            weights = tuple(1.0 if s.weight is None else float(s.weight) for s in args.sources)
            yield Stage(BLEND, "Energon draws sources by the metadataset's weights",
                        (("mode", mode), ("weights", weights)), energon=True)
    else:
        repetitions = tuple(s.repetitions for s in args.sources)
        if any(r not in (None, 1) for r in repetitions):
            yield Stage(REPEAT, "Energon repeats each source its `repetitions` times",
                        (("repetitions", repetitions),), per_source=True, energon=True)
        if many:
            yield Stage(BLEND, "Energon draws sources by samples x repetitions",
                        (("mode", mode), ("repetitions", repetitions)), energon=True)
        if args.repeat:
            yield Stage(REPEAT, "Energon repeats the blend", energon=True)
    if shuffle:
        yield Stage(
            SHUFFLE,
            "Energon's shuffle buffer, replaced: the same order, and a finite epoch resumes "
            "exactly",
            (("size", args.shuffle_buffer_size),),
        )


def _sample_pool_settings(cfg: OrderingConfig, bs: int | None) -> tuple[tuple[str, Any], ...]:
    """The settings a pool of samples takes, before or after encoding."""
    return (
        ("pool_size", cfg.length_sort_pool_size),
        ("mode", cfg.length_sort_mode),
        ("batch_size", bs),
        ("seed", cfg.seed),
        ("ramp", cfg.length_sort_ramp_on),
    )


def _packing_stages(
    cfg: OrderingConfig, args: BuildArgs, packing: int, pool_of_packs: bool
) -> Iterator[Stage]:
    packers = (("pre_packer", args.packer[0]), ("final_packer", args.packer[1]))
    # Always, also for packing alone: the cap stage carries the end of a finite epoch to the
    # packer, and holds a user's packs to the target (a no-op without a target or warmup).
    default_packer = not args.own_select_samples_to_pack
    yield Stage(
        PACK_CAP,
        "cuts each sample to the pack target (pack_seq_length, capped by the warmup at the "
        "step its pack is emitted in)",
        (
            ("pack_seq_length", cfg.pack_seq_length),
            ("warmup", cfg.seq_length_warmup),
            ("micro_batches_per_step", cfg.micro_batches_per_step),
            ("overflow", cfg.seq_length_overflow),
            ("batch_size", args.batch_size or 1),
            # packs go straight to the batcher in creation order: each gets its own step's cap
            ("per_pack_targets", default_packer and not pool_of_packs),
        ),
    )
    yield Stage(PACKING, "packs the buffer with the encoder's packer (or first-fit decreasing "
                "to the pack target); Energon's PackingDataset that also saves the end of a "
                "finite epoch (FinitePackingDataset)", (("buffer_size", packing), *packers),
                energon=True)
    if pool_of_packs:
        capped = cfg.seq_length_warmup is not None
        yield Stage(
            PACK_POOL,
            "pool of packs sorted by attention cost, permuted with a rank-independent seed"
            + ("; sorts only among positions with one warmup cap" if capped else ""),
            (
                ("pool_size", cfg.length_sort_pool_size),
                ("mode", cfg.length_sort_mode),
                ("batch_size", (args.batch_size or 1) if capped else args.batch_size),
                ("seed", cfg.seed),
            ),
        )


def _short(value: Any) -> str:
    """A setting as it reads in the description."""
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value)
