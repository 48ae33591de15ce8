"""OrderingConfig: the one validated configuration of the package (from Python, YAML or flags)."""

from __future__ import annotations

import dataclasses
import numbers
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from energon_ordering.mixture.policy import BLEND_POLICIES
from energon_ordering.errors import OrderingConfigError, OrderingTypeError, show
from energon_ordering.pool.order import POOL_ORDERS
from energon_ordering.pool.ramp import RAMP_MIN_POOL
from energon_ordering.mixture.schedule import MAX_STEPS, MixtureSchedule
from energon_ordering.planned.mix import (PLANNED_MIX_SETTINGS, PLANNED_MIXES, PlannedMix,
                                          resolve_planned_mix)
from energon_ordering.planned.window import DEFAULT_WINDOW_STEPS
from energon_ordering.planned.window_size import (MAX_WINDOW_MIX_STEPS, MAX_WINDOW_STEPS,
                                                  default_window_steps)
from energon_ordering.warmup.overflow import OVERFLOW_POLICIES
from energon_ordering.warmup.schedule import SeqLenWarmup
from energon_ordering.yaml_file import load_yaml

__all__ = ["DEFAULT_PLANNED_MIX", "MAX_PLAN_WINDOW_SAMPLES", "MAX_PLAN_WINDOW_STEPS",
           "PACK_POOL_PLACEMENTS", "PLACEMENTS", "PLANNED", "PLANNED_MIXES",
           "PLANNED_MIX_SETTINGS", "POOL_HOLDS", "OrderingConfig"]

#: The default ``planned_mix``, ``"auto"``
#: (:data:`~energon_ordering.planned.mix.PLANNED_MIX_SETTINGS` lists the default first).
DEFAULT_PLANNED_MIX = PLANNED_MIX_SETTINGS[0]

#: ``length_sort_mode`` of the planned global order (issue 23): no pool; every rank computes the
#: same plan of the global order from the length index (:mod:`energon_ordering.planned`).
PLANNED = "planned"

#: The largest ``plan_window_steps``. Balancing a window matches its K steps to K slots per
#: micro-batch band (K x K distances, sorted): at K = 1,024 that is 80 MiB and 8-80 s per window
#: on one core (tools/bench_planned.py's shapes), growing as K^2; 10^5 asked for 74.5 GiB.
MAX_PLAN_WINDOW_STEPS = MAX_WINDOW_STEPS
#: The largest plan of one window, in samples: K x R x M x B (steps x data-parallel ranks x
#: micro-batches per step x micro-batch) int64 ids, 128 MiB at 2^24; planning a window peaks at
#: about 86 bytes per sample (1.4 GiB here) in every loader worker that plans it. Checked when
#: the pipeline is planned (:func:`energon_ordering.pipeline.plan.plan_pipeline`), where R and
#: B are known; the config checks K x M.
MAX_PLAN_WINDOW_SAMPLES = 2**24

#: Where the length pool can sit: after ``encode_sample`` (pooling encoded samples) or before
#: decoding (pooling restore keys and lengths only).
PLACEMENTS = ("post-encode", "pre-encode")
#: What the pre-encode pool keeps per sample: its restore key and length, or its raw files.
POOL_HOLDS = ("keys", "raw")
#: Where the length pool sits when packing: sorting samples before packing, or a pool of packs
#: sorted by cost after packing.
PACK_POOL_PLACEMENTS = ("samples", "packs")


@dataclasses.dataclass(frozen=True)
class OrderingConfig:
    """What decides the order of training samples.

    Args:
        length_sort_pool_size: Samples per length pool, per loader worker; 0 turns the pool off.
        length_sort_mode: ``"sample"`` (reference: permute sorted samples) or ``"batch"``
            (permute sorted micro-batch-sized chunks; near padding-free) or ``"stratified"``
            (one sample per length band in every micro-batch: sources mixed per step, padding
            like ``"sample"``). See :mod:`energon_ordering.pool.order`. ``"planned"``: no pool;
            every rank reads its micro-batches from one plan of the global order, computed alike
            on every rank from the length index (see ``plan_window_steps``); needs
            ``length_sort_placement = "pre-encode"`` and ``length_sort_pool_holds = "keys"``.
            With packing it plans the packs too, each built to its step's cap
            (``pack_seq_length``, else the warmup's ``full``; the warmup's cap during the
            warmup), the ranks balanced by attention cost
            (:mod:`energon_ordering.planned.packs`).
        length_sort_placement: Where the length pool sits. ``"post-encode"`` (default, the
            reference behaviour): after ``encode_sample``, pooling encoded samples. ``"pre-encode"``:
            before decoding, as the lean :class:`~energon_ordering.pool.key_pool_sort.KeyPoolSortDataset`
            (see ``length_sort_pool_holds``), with loading, decoding and encoding after the
            pool; lengths come from the dataset's length index (``energon-ordering index``) or
            the task encoder's ``ordering_raw_sample_length``. ``placement`` is accepted as the
            short spelling in :meth:`from_dict` and recipes.
        length_sort_pool_holds: What the pre-encode pool keeps per sample besides its restore
            key and length: ``"raw"`` (default; the still-compressed files packed into one
            ``bytes``, e.g. ~70 kB per 448x448 JPEG against ~2.4 MB decoded, read once) or
            ``"keys"`` (nothing more, ~140 B; each sample is read a second time, by random
            access, when emitted: fewer samples/s on a decode-bound pipeline; for video or pools
            of 100k+). Only with ``length_sort_placement = "pre-encode"``; the post-encode pool
            holds encoded samples. Checkpoints are the same for both, so it may change across a
            restart.
        length_sort_pool_ramp: A loader worker's first pools are smaller, 1,000 then 10,000
            samples and so on (x10 each, rounded up to the micro-batch) up to
            ``length_sort_pool_size``, so its first batch leaves after a 1,000-sample fill
            instead of a full pool's; every rank ramps by the same rule, so ranks stay aligned
            (see :mod:`energon_ordering.pool.ramp`). Costs straggler idle over the ramp's
            samples (11,000 per worker for a pool of 100,000). None (default): on for pools of
            at least 10,000 samples; ``true`` / ``false`` force it. The pool of packs
            (``pack_pool_placement = "packs"``) does not ramp.
        seed: Ordering seed, identical on every data-parallel rank.
        mixture_schedule: Per-source weights as a function of the step: a
            :class:`MixtureSchedule`, an inline definition (dict) or the path of a schedule
            YAML (relative paths in a recipe are relative to the recipe). None: the
            metadataset's own weights are used unchanged.
        total_steps: Optimizer steps of the run; resolves fractional phase ends.
        micro_batches_per_step: Micro-batches per optimizer step on one rank, i.e.
            ``global_batch_size / (micro_batch_size * data_parallel_size)``.
        blend_policy: ``"random"`` or ``"deterministic"`` (see
            :mod:`energon_ordering.mixture.policy`).
        schedule_lag_compensation: With the length pool on, evaluate the schedule at the
            expected emission step of a sample instead of its draw step (see
            :class:`~energon_ordering.mixture.scheduled_blend.ScheduledBlendDataset`).
        allow_schedule_change: Restore a data state saved under another schedule instead of
            raising (the blend's counters carry over).
        seq_length_warmup: Sequence-length warmup applied at batch time: a
            :class:`SeqLenWarmup` or a mapping ``{start, full, warmup_steps[, multiple_of, kind,
            overflow]}`` (``overflow`` sets ``seq_length_overflow``). None: off.
        seq_length_overflow: For a sample whose media tokens alone exceed the warmup cap:
            ``"keep"`` (emit uncut, counted), ``"drop"`` (skip, counted) or ``"error"``. None
            (default): ``seq_length_warmup.overflow`` if given, else ``"keep"``; giving both with
            different values is refused.
        packing_buffer_size: Samples per packing buffer (Energon's ``packing_buffer_size``,
            Megatron's ``--packing-buffer-size``); turns sequence packing on for
            ``get_train_dataset`` calls that do not pass it. None: as ``get_train_dataset`` says.
        pack_seq_length: Tokens per pack (Megatron's ``--packing-seq-length``): the target of
            the default first-fit-decreasing packer and the length samples are cut to before
            packing. With ``seq_length_warmup`` the target of a pack emitted at step s is
            ``min(pack_seq_length, max_seq_len(s))`` (in both placements the pack is built to
            the cap of the step it will be emitted in). None: the warmup's ``full``, else no cut.
        pack_pool_placement: With packing and the length pool: ``"packs"`` (default; a pool of
            ``length_sort_pool_size`` packs after packing, sorted by attention cost
            ``sum(L + L^2/4096)`` and permuted with the rank-independent seed) or ``"samples"``
            (the pool sorts samples before packing, as without packing). See docs/concepts.md, "Sequence packing".
        length_index: Which of a dataset's length indexes the pre-encode pool sorts by (the
            ``--name`` given to ``energon-ordering index``; by default named after what computed
            it). None: the one computed by this task encoder, else the unnamed one, else the
            only one. A mismatch with the task encoder warns; a state saved with other lengths
            is refused on restore.
        length_index_dir: Where the length indexes live if not in ``<dataset>/.nv-meta/``
            (``energon-ordering index --index-dir``; for read-only datasets).
        plan_window_steps: With ``length_sort_mode = "planned"``: optimizer steps per window of
            the plan; the ranks are balanced within each window (larger: less straggler idle
            and padding, more planning memory). None (default): sized in samples once the
            pipeline knows the global batch (:meth:`window_steps`,
            :mod:`energon_ordering.planned.window_size`, measured by
            ``tools/bench_planned.py``): with ``planned_mix = "step"`` about 2^19 samples in
            32-128 steps (packed: 32 steps); with ``"window"`` about 2^22 samples (2^20 with a
            ``seq_length_warmup``; packed 2^17 packs and at most 2^20 samples) in at most 4,096
            steps. Only in planned mode. At most
            :data:`MAX_PLAN_WINDOW_STEPS` (step mix) or 4,096 (window mix,
            :data:`~energon_ordering.planned.window_size.MAX_WINDOW_MIX_STEPS`), and the
            window's plan, K x R x M x B sample ids
            (data-parallel ranks R, micro-batch B), at most :data:`MAX_PLAN_WINDOW_SAMPLES`
            (checked when the pipeline is planned, where R and B are known). The settings of
            the pools and the blend (``length_sort_pool_size``, ``length_sort_pool_ramp``,
            ``blend_policy``, ``schedule_lag_compensation``) do nothing in planned mode and are
            refused there unless left at their defaults.
        allow_global_batch_change: With ``length_sort_mode = "planned"``: let a resume change
            the global batch (or the micro-batch size) at a plan window boundary; every window
            from there on draws and balances the new global batch. False: such a state is
            refused, naming this setting. Only in planned mode.
        planned_mix: With ``length_sort_mode = "planned"``: where the blend's mix holds.
            ``"step"``: every optimizer step within one sample per source of weight x global
            batch. ``"window"``: every plan window of ``plan_window_steps`` steps within one
            sample per source of its weights' sum over the window, the window's samples free to
            move between its steps (each step one band of lengths: less idle and padding at one
            or two micro-batches per step); the schedule and the warmup still hold per step.
            ``"auto"`` (default): ``"step"`` where ``mixture_schedule`` changes the weights over
            training, else ``"window"`` (:attr:`resolved_planned_mix`;
            :mod:`energon_ordering.planned.mix`). A state saved with one granularity is refused
            by the other. Only in planned mode.
    """

    length_sort_pool_size: int = 0
    length_sort_mode: str = "sample"
    length_sort_placement: str = "post-encode"
    length_sort_pool_holds: str = "raw"
    length_sort_pool_ramp: bool | None = None
    seed: int = 0
    mixture_schedule: MixtureSchedule | None = None
    total_steps: int | None = None
    micro_batches_per_step: int = 1
    blend_policy: str = "random"
    schedule_lag_compensation: bool = True
    allow_schedule_change: bool = False
    seq_length_warmup: SeqLenWarmup | None = None
    seq_length_overflow: str | None = None
    packing_buffer_size: int | None = None
    pack_seq_length: int | None = None
    pack_pool_placement: str = "packs"
    length_index: str | None = None
    length_index_dir: str | None = None
    plan_window_steps: int | None = None
    allow_global_batch_change: bool = False
    planned_mix: str = DEFAULT_PLANNED_MIX

    def __post_init__(self) -> None:
        for name in ("length_sort_pool_size", "seed", "micro_batches_per_step", "total_steps"):
            value = getattr(self, name)
            if value is None and name == "total_steps":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise OrderingTypeError(
                    f"OrderingConfig.{name} = {show(value)} ({type(value).__name__}) must be an "
                    "int."
                )
        for name in (
            "length_sort_mode", "length_sort_placement", "length_sort_pool_holds", "blend_policy",
            "planned_mix",
        ):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise OrderingTypeError(
                    f"OrderingConfig.{name} = {show(value)} ({type(value).__name__}) must be a "
                    "string, "
                    f"e.g. {name} = {show(value[0])}." if isinstance(value, (list, tuple)) and value
                    and isinstance(value[0], str) else
                    f"OrderingConfig.{name} = {show(value)} ({type(value).__name__}) must be a "
                    "string."
                )
        if self.seq_length_overflow is not None and not isinstance(self.seq_length_overflow, str):
            raise OrderingTypeError(
                f"OrderingConfig.seq_length_overflow = {show(self.seq_length_overflow)} must be a "
                "string (keep, drop or error)."
            )
        if self.length_sort_pool_ramp is not None and not isinstance(
            self.length_sort_pool_ramp, bool
        ):
            raise OrderingTypeError(
                f"OrderingConfig.length_sort_pool_ramp = {show(self.length_sort_pool_ramp)} "
                f"({type(self.length_sort_pool_ramp).__name__}) must be true, false or null "
                f"(null: on for pools of at least {RAMP_MIN_POOL:,} samples)."
            )
        if (
            self.length_sort_pool_ramp
            and self.packing_buffer_size is not None
            and self.pack_pool_placement == "packs"
            and self.length_sort_pool_size > 0
        ):
            raise OrderingConfigError(
                "OrderingConfig.length_sort_pool_ramp = true, but the pool of packs "
                "(pack_pool_placement = 'packs') does not ramp; set length_sort_pool_ramp to "
                "null or false, or pack_pool_placement = 'samples'."
            )
        for name in ("schedule_lag_compensation", "allow_schedule_change",
                     "allow_global_batch_change"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise OrderingTypeError(
                    f"OrderingConfig.{name} = {show(value)} must be true or false."
                )
        if self.micro_batches_per_step < 1:
            raise OrderingConfigError(
                f"OrderingConfig.micro_batches_per_step = {self.micro_batches_per_step} must be "
                ">= 1 (global batch / (micro batch * data-parallel size))."
            )
        if self.total_steps is not None and not 1 <= self.total_steps <= MAX_STEPS:
            raise OrderingConfigError(
                f"OrderingConfig.total_steps = {show(self.total_steps)} must be >= 1 and <= "
                f"{MAX_STEPS:,} (2^53, the last step a float64 holds exactly); give the run's "
                "optimizer steps."
            )
        if self.blend_policy not in BLEND_POLICIES:
            raise OrderingConfigError(
                f"OrderingConfig.blend_policy = {show(self.blend_policy)} is unknown; use one of "
                f"{list(BLEND_POLICIES)}."
            )
        object.__setattr__(self, "mixture_schedule", self._resolve_schedule(self.mixture_schedule))
        if (self.blend_policy != "random" and self.mixture_schedule is None
                and self.length_sort_mode != "planned"):
            raise OrderingConfigError(
                f"OrderingConfig.blend_policy = {show(self.blend_policy)} needs a "
                "mixture_schedule: without one Energon blends the metadataset's weights at "
                "random and the policy would do nothing; add a mixture_schedule with those "
                "weights (a one-phase schedule), or drop blend_policy.")
        warmup = self.seq_length_warmup
        if isinstance(warmup, Mapping):
            warmup = dict(warmup)
            if "overflow" in warmup:
                overflow = warmup.pop("overflow")
                if self.seq_length_overflow not in (None, overflow):
                    raise OrderingConfigError(
                        f"OrderingConfig: seq_length_warmup.overflow = {show(overflow)} "
                        f"contradicts seq_length_overflow = {show(self.seq_length_overflow)}; "
                        "give it once."
                    )
                object.__setattr__(self, "seq_length_overflow", overflow)
            warmup = SeqLenWarmup.from_dict(warmup)
        if warmup is not None and not isinstance(warmup, SeqLenWarmup):
            raise OrderingTypeError(
                f"OrderingConfig.seq_length_warmup = {show(warmup)} must be a SeqLenWarmup or a "
                "mapping {start, full, warmup_steps[, multiple_of, kind, overflow]}."
            )
        object.__setattr__(self, "seq_length_warmup", warmup)
        self._warn_beyond_the_run()
        if self.seq_length_overflow is None:
            object.__setattr__(self, "seq_length_overflow", "keep")
        if self.length_sort_pool_size < 0:
            raise OrderingConfigError(
                f"OrderingConfig.length_sort_pool_size = {self.length_sort_pool_size} must be "
                ">= 0 (0 turns the length pool off)."
            )
        if self.length_sort_placement not in PLACEMENTS:
            raise OrderingConfigError(
                f"OrderingConfig.length_sort_placement = {show(self.length_sort_placement)} is "
                f"unknown; use one of {list(PLACEMENTS)}."
            )
        if self.length_sort_pool_holds not in POOL_HOLDS:
            raise OrderingConfigError(
                f"OrderingConfig.length_sort_pool_holds = {show(self.length_sort_pool_holds)} is "
                f"unknown; use one of {list(POOL_HOLDS)}."
            )
        if self.length_sort_pool_holds == "keys" and self.length_sort_placement != "pre-encode":
            raise OrderingConfigError(
                f"OrderingConfig.length_sort_pool_holds = {show(self.length_sort_pool_holds)} "
                "applies to the pre-encode pool only (the post-encode pool holds encoded "
                "samples); set length_sort_placement = 'pre-encode' or drop "
                "length_sort_pool_holds."
            )
        for name in ("packing_buffer_size", "pack_seq_length"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise OrderingTypeError(
                    f"OrderingConfig.{name} = {show(value)} ({type(value).__name__}) must be an "
                    "int or null."
                )
            if value < 1:
                raise OrderingConfigError(
                    f"OrderingConfig.{name} = {value} must be >= 1 (or null for none)."
                )
        if self.pack_pool_placement not in PACK_POOL_PLACEMENTS:
            raise OrderingConfigError(
                f"OrderingConfig.pack_pool_placement = {show(self.pack_pool_placement)} is "
                f"unknown; use one of {list(PACK_POOL_PLACEMENTS)}."
            )
        if (
            self.pack_pool_placement == "packs"
            and self.length_sort_placement == "pre-encode"
            and self.packing_buffer_size is not None
            and self.length_sort_mode != PLANNED
        ):
            raise OrderingConfigError(
                "OrderingConfig.pack_pool_placement = 'packs' pools packs after packing, so it "
                "cannot also sit before encoding (length_sort_placement = 'pre-encode'); use "
                "pack_pool_placement = 'samples' with the pre-encode pool."
            )
        if isinstance(self.length_index_dir, os.PathLike):
            object.__setattr__(self, "length_index_dir", os.fspath(self.length_index_dir))
        for name in ("length_index", "length_index_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise OrderingTypeError(
                    f"OrderingConfig.{name} = {show(value)} ({type(value).__name__}) must be a "
                    "string or None."
                )
        if self.planned_mix not in PLANNED_MIX_SETTINGS:
            raise OrderingConfigError(
                f"OrderingConfig.planned_mix = {show(self.planned_mix)} is unknown; use one of "
                f"{list(PLANNED_MIX_SETTINGS)} (the blend's mix held per optimizer step, per plan "
                "window, or 'auto': per step where mixture_schedule changes the weights, else per "
                "window)."
            )
        if self.length_sort_mode == PLANNED:
            self._check_planned()
        elif self.length_sort_mode not in POOL_ORDERS:
            raise OrderingConfigError(
                f"OrderingConfig.length_sort_mode = {show(self.length_sort_mode)} is unknown; use "
                f"one of {sorted([*POOL_ORDERS, PLANNED])}."
            )
        elif self.allow_global_batch_change:
            raise OrderingConfigError(
                "OrderingConfig.allow_global_batch_change = true applies to length_sort_mode = "
                f"'planned' only (length_sort_mode is {show(self.length_sort_mode)}): a pool's "
                "state depends on the rank's shard and batch; drop it or set length_sort_mode = "
                "'planned'."
            )
        elif self.plan_window_steps is not None:
            raise OrderingConfigError(
                f"OrderingConfig.plan_window_steps = {show(self.plan_window_steps)} applies to "
                f"length_sort_mode = 'planned' only (length_sort_mode is "
                f"{show(self.length_sort_mode)}); drop plan_window_steps or set "
                "length_sort_mode = 'planned'."
            )
        elif self.planned_mix != DEFAULT_PLANNED_MIX:
            raise OrderingConfigError(
                f"OrderingConfig.planned_mix = {show(self.planned_mix)} applies to "
                f"length_sort_mode = 'planned' only (length_sort_mode is "
                f"{show(self.length_sort_mode)}); drop planned_mix or set "
                "length_sort_mode = 'planned'."
            )
        if self.seq_length_overflow not in OVERFLOW_POLICIES:
            raise OrderingConfigError(
                f"OrderingConfig.seq_length_overflow = {show(self.seq_length_overflow)} is "
                f"unknown; use one of {list(OVERFLOW_POLICIES)}."
            )

    def _check_planned(self) -> None:
        """The settings ``length_sort_mode = "planned"`` needs (``plan_window_steps`` None stays
        None: :meth:`window_steps` gives the mix's default for a global batch)."""
        if self.length_sort_pool_size != 0:
            raise OrderingConfigError(
                f"OrderingConfig.length_sort_pool_size = {self.length_sort_pool_size}: "
                "length_sort_mode = 'planned' has no pool; the plan balances ranks over windows "
                "of plan_window_steps optimizer steps instead. Drop length_sort_pool_size (set "
                f"plan_window_steps, default {DEFAULT_WINDOW_STEPS}, to change the window)."
            )
        if self.length_sort_placement != "pre-encode":
            raise OrderingConfigError(
                f"OrderingConfig.length_sort_placement = {show(self.length_sort_placement)}: "
                "length_sort_mode = 'planned' plans from the length index before anything is "
                "read; set length_sort_placement = 'pre-encode'."
            )
        if self.length_sort_pool_holds != "keys":
            raise OrderingConfigError(
                f"OrderingConfig.length_sort_pool_holds = {show(self.length_sort_pool_holds)}: "
                "length_sort_mode = 'planned' reads every sample by its byte range when its "
                "micro-batch is due; set length_sort_pool_holds = 'keys'."
            )
        for name, value, default in (
            ("length_sort_pool_ramp", self.length_sort_pool_ramp, None),
            ("blend_policy", self.blend_policy, "random"),
            ("schedule_lag_compensation", self.schedule_lag_compensation, True),
        ):
            if value != default:
                raise OrderingConfigError(
                    f"OrderingConfig.{name} = {show(value)} does nothing under "
                    "length_sort_mode = 'planned': the plan has no pool to ramp or lag behind, "
                    "and draws each step's exact source counts (no blend policy). Drop "
                    f"{name} (or use a pool mode)."
                )
        if self.plan_window_steps is None:
            return  # the mix's default, where the global batch is known: window_steps()
        k = self.plan_window_steps
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise OrderingConfigError(
                f"OrderingConfig.plan_window_steps = {show(k)}: the plan balances ranks over "
                "windows of this many optimizer steps; give an int >= 1 (default "
                f"{DEFAULT_WINDOW_STEPS})."
            )
        mix = self.resolved_planned_mix
        if mix == "window" and k > MAX_WINDOW_MIX_STEPS:
            raise OrderingConfigError(
                f"OrderingConfig.plan_window_steps = {show(k)} is over the window mix's limit of "
                f"{MAX_WINDOW_MIX_STEPS:,} steps (a window's mix holds over its steps); use "
                f"plan_window_steps <= {MAX_WINDOW_MIX_STEPS:,}, or leave it unset (sized for "
                "the global batch).")
        if mix != "window" and k > MAX_PLAN_WINDOW_STEPS:
            raise OrderingConfigError(
                f"OrderingConfig.plan_window_steps = {show(k)} is over the limit of "
                f"{MAX_PLAN_WINDOW_STEPS:,}: balancing a window costs memory and time that "
                "grow as its steps squared (a window of 10^5 steps asks for 75 GiB); use "
                f"plan_window_steps <= {MAX_PLAN_WINDOW_STEPS:,} (default {DEFAULT_WINDOW_STEPS})."
            )
        if k * self.micro_batches_per_step > MAX_PLAN_WINDOW_SAMPLES:
            raise OrderingConfigError(
                f"OrderingConfig.plan_window_steps = {k} x micro_batches_per_step = "
                f"{self.micro_batches_per_step} plans at least {k * self.micro_batches_per_step:,} "
                f"samples per window (one micro-batch of one sample per step), over the limit "
                f"of {MAX_PLAN_WINDOW_SAMPLES:,} a window's plan may hold in a loader worker; "
                f"use plan_window_steps <= "
                f"{max(1, MAX_PLAN_WINDOW_SAMPLES // self.micro_batches_per_step):,}."
            )
        object.__setattr__(self, "plan_window_steps", int(k))

    def window_steps(self, world_size: int, batch_size: int, packed: bool | None = None,
                     samples_per_pack: float | None = None) -> int:
        """K, the optimizer steps of a plan window, for ``world_size`` ranks of micro-batches of
        ``batch_size`` samples (packed: packs): ``plan_window_steps`` if given, else the
        default of ``planned_mix`` for that global batch
        (:func:`~energon_ordering.planned.window_size.default_window_steps`). ``packed``:
        None reads it off ``packing_buffer_size`` (the pipeline passes it: Energon's
        ``get_train_dataset`` may pack where the config does not say so).
        ``samples_per_pack``: packed, the most samples a pack holds on average under the run's
        weights (:func:`~energon_ordering.planned.window_size.packed_samples_per_pack`, from
        the length index): short samples make the default window hold fewer packs, so that
        its planning stays within a loader worker's memory. Planned mode only."""
        if not self.planned:
            raise OrderingConfigError(
                f"OrderingConfig.window_steps: length_sort_mode is {show(self.length_sort_mode)}; "
                "plan windows exist in length_sort_mode = 'planned' only.")
        if self.plan_window_steps is not None:
            return int(self.plan_window_steps)
        if packed is None:
            packed = self.packing_buffer_size is not None
        g = int(world_size) * self.micro_batches_per_step * int(batch_size)
        return default_window_steps(self.resolved_planned_mix, g, packed,
                                    capped=self.seq_length_warmup is not None,
                                    samples_per_pack=samples_per_pack if packed else None)

    @property
    def resolved_planned_mix(self) -> PlannedMix:
        """The granularity the plan holds the mix at: ``planned_mix``, with ``"auto"`` resolved
        (``"step"`` where ``mixture_schedule`` changes the weights over training, else
        ``"window"``; :func:`~energon_ordering.planned.mix.resolve_planned_mix`)."""
        return resolve_planned_mix(self.planned_mix, self.mixture_schedule)

    @property
    def planned(self) -> bool:
        """True for the planned global order (``length_sort_mode = "planned"``)."""
        return self.length_sort_mode == PLANNED

    def _warn_beyond_the_run(self) -> None:
        """Warns (once per message) where ``total_steps`` ends the run before the mixture
        schedule's last change or the warmup's full length: the run never reaches them."""
        total = self.total_steps
        if total is None:
            return
        schedule, warmup = self.mixture_schedule, self.seq_length_warmup
        if schedule is not None and (step := schedule.first_change_after(total)) is not None:
            warnings.warn(
                f"OrderingConfig.mixture_schedule changes its weights at step {step:,}, after "
                f"the run's last step (total_steps = {total:,}): the run never reaches that "
                "change. Give the phases' `until` as fractions of total_steps, or set "
                "total_steps to the run's length.", UserWarning, stacklevel=4)
        if warmup is not None and warmup.warmup_steps > total:
            warnings.warn(
                f"OrderingConfig.seq_length_warmup.warmup_steps = {warmup.warmup_steps:,} is "
                f"longer than the run (total_steps = {total:,}): its samples never reach the "
                f"full length ({warmup.full:,} tokens). Set warmup_steps <= {total:,}.",
                UserWarning, stacklevel=4)

    def _resolve_schedule(self, value: Any) -> MixtureSchedule | None:
        if value is None:
            return None
        if isinstance(value, MixtureSchedule):
            if self.total_steps is not None and value.total_steps not in (None, self.total_steps):
                raise OrderingConfigError(
                    f"OrderingConfig.total_steps = {self.total_steps} but mixture_schedule has "
                    f"total_steps = {value.total_steps}; make them agree."
                )
            return value
        if isinstance(value, Mapping):
            return MixtureSchedule.from_dict(value, total_steps=self.total_steps)
        if isinstance(value, (str, Path)):
            return MixtureSchedule.from_yaml(value, total_steps=self.total_steps)
        raise OrderingTypeError(
            f"OrderingConfig.mixture_schedule = {show(value)} must be a MixtureSchedule, a mapping "
            "(inline schedule) or the path of a schedule YAML."
        )

    @property
    def length_sort_enabled(self) -> bool:
        """True if the length pool is on."""
        return self.length_sort_pool_size > 0

    @property
    def length_sort_ramp_on(self) -> bool:
        """True if a sample pool ramps: ``length_sort_pool_ramp``, or by default (None) for
        pools of at least :data:`~energon_ordering.pool.ramp.RAMP_MIN_POOL` samples."""
        if self.length_sort_pool_ramp is None:
            return self.length_sort_pool_size >= RAMP_MIN_POOL
        return self.length_sort_pool_ramp and self.length_sort_enabled

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OrderingConfig:
        """Builds a config from a mapping of field names; unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise OrderingTypeError(
                f"OrderingConfig.from_dict: expected a mapping of settings, got "
                f"{type(d).__name__}."
            )
        if "placement" in d:
            d = dict(d)
            placement = d.pop("placement")
            if d.get("length_sort_placement", placement) != placement:
                raise OrderingConfigError(
                    f"OrderingConfig: placement = {show(placement)} contradicts "
                    f"length_sort_placement = {show(d['length_sort_placement'])}; give it once."
                )
            d["length_sort_placement"] = placement
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known, key=str)
        if unknown:
            import difflib

            guesses = {k: difflib.get_close_matches(str(k), known | {"placement"}, n=1)
                       for k in unknown}
            meant = "; ".join(f"{show(k)}: did you mean {show(g[0])}?"
                              for k, g in guesses.items() if g)
            raise OrderingConfigError(
                f"OrderingConfig: unknown setting(s) {show(unknown)}"
                + (f" ({meant})" if meant else "")
                + f"; known settings are {sorted(known)}."
            )
        return cls(**dict(d))

    @classmethod
    def from_yaml(cls, path: str | Path) -> OrderingConfig:
        """Loads a recipe file (a YAML mapping of settings, see ``recipes/``)."""
        path = Path(path)
        data = load_yaml(path, "OrderingConfig.from_yaml")
        if isinstance(data, Mapping) and {"__module__", "__class__"} <= set(data):
            raise OrderingConfigError(
                f"OrderingConfig.from_yaml: {path} is an Energon (meta)dataset description "
                f"(__module__ {show(data['__module__'])}, __class__ {show(data['__class__'])}), "
                "not a recipe; pass it as the dataset (METADATASET) and the recipe (a file of "
                "OrderingConfig settings, or a packaged recipe's name) as the recipe."
            )
        if isinstance(data, Mapping) and isinstance(data.get("mixture_schedule"), str):
            schedule_path = Path(data["mixture_schedule"])
            if not schedule_path.is_absolute():
                data = {**data, "mixture_schedule": str(path.parent / schedule_path)}
        try:
            return cls.from_dict(data)
        except (OrderingConfigError, OrderingTypeError) as e:
            raise type(e)(f"{path}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (round-trips through :meth:`from_dict`); the schedule is
        written inline, in its normalised form."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.mixture_schedule is not None:
            d["mixture_schedule"] = self.mixture_schedule.to_dict()
        if self.seq_length_warmup is not None:
            d["seq_length_warmup"] = self.seq_length_warmup.to_dict()
        return d
