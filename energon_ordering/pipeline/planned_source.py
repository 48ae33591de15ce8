"""The planned global order's source: this rank's micro-batches of the plan, read by byte range.

With ``length_sort_mode = "planned"`` (issue 23) no rank walks its own slice of the shards.
Every rank and loader worker computes the same plan of the global order
(:func:`energon_ordering.planned.window.plan_window`, from the sources' length indexes, the
seed and the blend weights) and reads the samples of its own micro-batches from their byte
ranges in Energon's ``.nv-meta/index.sqlite``
(:class:`~energon_ordering.pool.byte_range_reader.ByteRangeReader`). Energon's own load
functions (the factory's ``load_sample``, any cooker) then decode each sample, exactly as the
pre-encode pool's :class:`~energon_ordering.pool.deferred_load.Materialize` does, and the
pipeline continues with ``encode_sample``, batching and ``encode_batch`` as in every mode::

    PlannedSourceDataset -> encode_sample -> [SeqLenWarmupDataset] -> BatchDataset -> stamp

Micro-batches of a rank are numbered ``b = step x M + m`` (M micro-batches per optimizer step).
Energon's loader takes batches from its workers in turn, so loader worker w yields the
micro-batches ``b = w, w + W, w + 2 W, ...`` (W = ``max(1, num_workers)``), B samples each,
in the plan's order; the batcher above groups them B at a time.

State (per loader worker): the next micro-batch ``b`` and how many of its samples went out,
the plan cursor of the window the worker is in (a few dozen bytes: window index, draws per
source, carry), and a stamp of the mode and :data:`~energon_ordering.planned.window.PLAN_VERSION`.
A restore recomputes that window's plan from the cursor: nothing else is needed to continue
exactly. The byte ranges of the current and the next micro-batch are read on a few prefetch
threads (:data:`PREFETCH_THREADS`), so storage latency overlaps decoding and encoding, and the
worker's next window is planned on a thread while it consumes this one
(:mod:`.plan_ahead`, :data:`PLAN_AHEAD`): no micro-batch waits for a plan at a window boundary
(``tools/bench_planned_boundary.py``), and the order is the same.

Mix granularity (``planned_mix``, :mod:`energon_ordering.planned.mix`): ``"step"`` plans each
step with each source's share; ``"window"`` plans each window with it (each step one band of
lengths, under the warmup's cap of the step), its next cursor carrying the samples it defers
(``PlanCursor.deferred``, saved in the cursor only when there are any). The stamp holds it:
a state of the other granularity is refused, naming both.

Elastic resume (:meth:`PlannedSourceDataset.restore_elastic`, through
:func:`energon_ordering.state_stamp.restore_state_rank`): every rank's state holds the same
global position, so a state restores at another data-parallel size, ``micro_batches_per_step``
or ``num_workers`` with the same global batch. Every window stays composed for the run's first
shape of that global batch, so every step holds the samples of the uninterrupted run; a step run
at the new shape deals them onto its ranks and micro-batches
(:func:`~energon_ordering.planned.balance.deal_step`; the shapes are recorded in the state as
``_history``, so later exact restores deal alike). Stages that depend on the step (the
sequence-length warmup) read the plan's step (:meth:`PlannedSourceDataset.emission_step`), never
Energon's batch index, which restarts at 0 in the resumed loader. Nothing is lost, drawn twice or
moved to another step.

Finite epochs (``repeat=False``, :meth:`PlannedSourceDataset.end_step`): the epoch ends before
the first step at which some source would run out, known from the sizes, weights and global
batch, so every rank stops after the same step; epoch e draws each source's epoch-e
permutation. Under the window mix the epoch ends with a window (its last one shorter), and
no window of a finite epoch defers a sample (:mod:`energon_ordering.planned.epoch_end`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.flavors.webdataset.sample_loader import RawSampleData
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig

from energon_ordering.errors import (
    OrderingConfigError,
    StateMismatchError,
    show,
)
from energon_ordering.length_index.lengths_file import (
    indexed_lengths,
    lengths_content_digest,
    reopen,
    reopened,
)
from energon_ordering.mixture.step_counts import step_source_counts
from energon_ordering.planned.balance import deal_step
from energon_ordering.planned.cursor import PlanCursor, advance
from energon_ordering.planned.epoch_end import step_mix_end_step, window_mix_end_step
from energon_ordering.planned.sample_ids import SampleIds
from energon_ordering.planned.saved_state import (
    check_next_in_epoch,
    check_offset_in_micro_batch,
    check_planned_state,
)
from energon_ordering.planned.mix import PlannedMix, check_planned_mix
from energon_ordering.planned.window import (
    PLAN_VERSION,
    WINDOW_MIX_PLAN_VERSION,
    plan_window,
    window_draws,
)
from energon_ordering.warmup.pack_cap import pack_target
from energon_ordering.warmup.schedule import SeqLenWarmup
from energon_ordering.pipeline.plan_ahead import PlanAhead, WindowAtHand
from energon_ordering.pipeline.shared_plans import SharedPlans, plan_dir, stream_digest
from energon_ordering.pipeline.window_mix_share import (
    decode_window_mix_plan,
    encode_window_mix_plan,
    window_mix_plan_buffer,
    window_mix_plan_problem,
)
from energon_ordering.pool.byte_range_reader import ByteRangeReader
from energon_ordering.state_stamp import check_stamp, check_writer

__all__ = ["PLANNED_STATE_VERSION", "PlannedSourceDataset", "indexed_lengths"]

logger = logging.getLogger(__name__)

#: Bumped when the saved state of :class:`PlannedSourceDataset` changes its layout or meaning.
#: 3: a worker that has run into a finite epoch's end also saves the rotation of the loader
#: workers its next epoch starts under (``_epoch_offset``: its first micro-batch is its
#: process's); a state of 2 continues as 2 did, under none (:meth:`_current_version`).
#: 2: after an elastic restore every step keeps the samples (packs) of the run's first shape,
#: dealt onto the new ranks; 1 re-balanced the restore window's tail across its steps (packs:
#: re-dealt them) and planned later windows for the new shape. A state of 1 without an elastic
#: restore in its history continues alike and is taken
#: (:meth:`PlannedSourceDataset._current_version`).
PLANNED_STATE_VERSION = 3

#: Why a planned state sits at another class's position: packing was turned on or off.
PACKING_CHANGED = (
    "The planned order was saved with packing and is configured without it, or the other way "
    "round: configure packing as the saved run did (OrderingConfig.pack_seq_length and "
    "get_train_dataset's packing_buffer_size; Megatron-LM: --packing-seq-length and "
    "--packing-buffer-size), or start the data stream fresh.")

#: Whether a loader worker plans its next window on a thread while it consumes the current one
#: (:mod:`energon_ordering.pipeline.plan_ahead`), so no micro-batch waits for a plan at a window
#: boundary (``tools/bench_planned_boundary.py``). The order is the same either way.
PLAN_AHEAD = True

#: First element of the restore key of a sample this source yields.
RESTORE_KIND = "PlannedSource"

#: Threads per loader worker that read the byte ranges of the current and the next micro-batch
#: ahead of decoding, so that storage latency overlaps the pipeline's compute (0: no prefetch).
PREFETCH_THREADS = 2


class PlannedSourceDataset(SavableDataset[Any]):
    """This rank's micro-batches of the planned global order (see the module docstring).

    Args:
        readers: Per source, byte-range access to its training split.
        loaders: Per source, Energon's load functions (innermost first) that turn a raw sample
            (``RawSampleData``) into the sample ``encode_sample`` receives.
        lengths: Per source, every sample's length (:func:`indexed_lengths`).
        weights: The blend weight of each source (normalised here).
        seed: The ordering seed (the same on every rank).
        window_steps: K, ``plan_window_steps``.
        micro_batches_per_step: M.
        batch_size: B, samples per micro-batch.
        finite: One epoch per iteration (``repeat=False``): see :meth:`end_step`. False: the
            sources repeat, each on its own, and the iteration never ends.
        schedule: A :class:`~energon_ordering.mixture.schedule.MixtureSchedule` whose weights
            at each optimizer step replace ``weights`` (each step's counts within one sample
            of them, cumulative counts tracking their integral); None: ``weights``.
        source_names: With ``schedule``: each source's name, in the order of ``readers``.
        allow_global_batch_change: Let :meth:`restore_elastic` continue a state saved with
            another global batch (or micro-batch size), from a plan window boundary on.
        planned_mix: ``"step"``: every optimizer step holds each source's share; ``"window"``:
            every plan window does, each step one band of lengths
            (:mod:`energon_ordering.planned.mix`). Stamped: a state of the other is refused.
            With ``finite``, the window mix's windows defer no sample, and its last window
            ends with the epoch (:mod:`energon_ordering.planned.epoch_end`).
        warmup: With ``planned_mix="window"``: the sequence-length warmup, whose cap at each
            step the window's samples are placed under (None: no caps). Unused by the step mix
            (the warmup stage cuts each step's samples).
        worker_config: Energon's worker configuration (rank, world size R, num_workers).
    """

    _savable_fields = ("_stamp", "_epoch", "_next", "_offset", "_cursor", "_start_step",
                       "_history", "_epoch_offset")


    def __init__(
        self,
        readers: Sequence[ByteRangeReader],
        loaders: Sequence[Sequence[Callable[[Any], Any]]],
        lengths: Sequence[np.ndarray],
        *,
        weights: Sequence[float],
        seed: int,
        window_steps: int,
        micro_batches_per_step: int,
        batch_size: int,
        finite: bool = False,
        schedule: Any = None,
        source_names: Sequence[str] | None = None,
        allow_global_batch_change: bool = False,
        planned_mix: str = "step",
        warmup: SeqLenWarmup | None = None,
        worker_config: WorkerConfig,
    ):
        super().__init__(worker_config=worker_config)
        self.planned_mix: PlannedMix = check_planned_mix(planned_mix)
        self.warmup = warmup
        self.readers = list(readers)
        self.loaders = [list(fns) for fns in loaders]
        # read-only, often memory-mapped (never copied: 8 bytes per sample in every worker)
        self.lengths = [x if isinstance(x, np.ndarray) else np.asarray(x, dtype=np.float64)
                        for x in lengths]
        self.ids = SampleIds.of([len(x) for x in self.lengths])
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        self.seed = int(seed)
        self.window_steps = int(window_steps)
        self.micro_batches_per_step = int(micro_batches_per_step)
        self.batch_size = int(batch_size)
        self.finite = bool(finite)
        self.allow_global_batch_change = bool(allow_global_batch_change)
        self.schedule = schedule
        self._columns = None
        if schedule is not None:
            names = list(source_names or ())
            if sorted(names) != sorted(schedule.sources):
                raise OrderingConfigError(
                    f"OrderingConfig.mixture_schedule names the sources "
                    f"{list(schedule.sources)}, the metadataset {names}; give the schedule "
                    "exactly one weight per metadataset entry.")
            self._columns = schedule.columns_of(names)
        self._end_step: int | None = None
        self._history: list[dict[str, Any]] = []  # set by reset_state_own / restore_state
        if self.finite and self.end_step() == 0:
            raise OrderingConfigError(
                f"planned order: a finite epoch (repeat=False) of sources of "
                f"{list(self.ids.sizes)} samples holds no full optimizer step of "
                f"{self._global_batch()} samples (weights {show(self.weights.tolist())}); use "
                "more data, a smaller global batch, or repeat=True.")
        # not saved, recomputed from the cursor: the window at hand, with this rank's [M, B]
        # ids of each of its steps (None before an elastic restore's step, when this rank was
        # not in the earlier shape); O(K M B), never the other ranks' rows
        self._hand: WindowAtHand | None = None
        #: Plans the worker's next window while this one is consumed (started in __iter__, in
        #: the process that iterates; None: every window is planned when it is reached).
        self._ahead: PlanAhead | None = None
        #: Bumped whenever the state is set anew: a window planned ahead before is dropped.
        self._generation = 0
        #: Set by :meth:`restore_elastic` (before iteration): where this loader starts.
        self.elastic_start: dict[str, Any] | None = None
        self.prefetch_threads = PREFETCH_THREADS
        #: Plan each window while the one before it is consumed (:mod:`.plan_ahead`).
        self.plan_ahead = PLAN_AHEAD
        #: The global optimizer step of the micro-batch of the sample yielded last (not saved:
        #: :meth:`emission_step`).
        self._emitting_step = 0
        self._executor: ThreadPoolExecutor | None = None  # per process, never pickled
        self._local: threading.local | None = None
        self._thread_readers: list[ByteRangeReader] = []  # the prefetch threads' copies
        #: The lengths' content digests, read once per process where it maps them (a file
        #: deleted or replaced later changes neither the data mapped nor its plans' name);
        #: [] where they could not be read: no sharing.
        self._digests: list[str] | None = None
        self.reset_state_own()

    # -- state -----------------------------------------------------------------------------

    def _expected_stamp(self) -> dict[str, Any]:
        return {
            "mode": "planned",
            "plan_version": PLAN_VERSION,
            "state_version": PLANNED_STATE_VERSION,
            "sizes": list(self.ids.sizes),
            "weights": [float(x) for x in self.weights],
            "seed": self.seed,
            "window_steps": self.window_steps,
            "micro_batches_per_step": self.micro_batches_per_step,
            "batch_size": self.batch_size,
            "world_size": int(self.worker_config.world_size),
            "finite": self.finite,
            "schedule": None if self.schedule is None else self.schedule.to_dict(),
            "planned_mix": self.planned_mix,
            **({"window_mix_plan_version": WINDOW_MIX_PLAN_VERSION,
                "caps": None if self.warmup is None else self.warmup.to_dict()}
               if self.planned_mix == "window" else {}),
        }

    def _step_weights(self, first: int, steps: int) -> np.ndarray:
        """``[steps, S]`` normalised weights of global optimizer steps ``first ..``: the
        schedule's (in the sources' order), else the blend weights."""
        if self.schedule is None:
            return np.tile(self.weights, (steps, 1))
        return self.schedule.weights_table(np.arange(first, first + steps))[:, self._columns]

    def _epoch_cursor(self, epoch: int) -> dict[str, Any]:
        """The plan cursor at the start of finite epoch ``epoch`` (every source at the start of
        its epoch-``epoch`` permutation); the start of training when repeating."""
        return _cursor_state(PlanCursor(0, tuple(epoch * n for n in self.ids.sizes),
                                        (0.0,) * len(self.ids.sizes)))

    def _global_batch(self) -> int:
        return int(self.worker_config.world_size) * self.micro_batches_per_step * self.batch_size

    def end_step(self) -> int | None:
        """The optimizer steps of a finite epoch (None: repeating).

        Epoch e draws each source's epoch-e permutation from its start. It ends before the
        first step at which some source would run out (:mod:`~energon_ordering.planned.
        epoch_end`; the window mix: whole windows while their totals fit, then the longest
        start of the next): every rank stops after the same step, every sample is drawn at
        most once per epoch, and what is left of the sources at the end is not drawn in that
        epoch. A pure function of the sizes, weights and the global batch of each step (an
        elastic resume with the same global batch keeps it; one with
        ``allow_global_batch_change`` moves it)."""
        if not self.finite:
            return None
        if self._end_step is None:
            if self.planned_mix == "window":
                self._end_step = window_mix_end_step(self.ids.sizes, self._step_weights,
                                                     self._global_batch_at, self.window_steps)
            else:
                self._end_step = step_mix_end_step(
                    self.ids.sizes, self._step_weights, self._global_batch_at,
                    [int(h["at_step"]) for h in self._history])
        return self._end_step

    def _workers(self) -> int:
        return max(1, self.worker_config.num_workers)

    def reset_state_own(self) -> None:
        self._cancel_ahead()
        self._stamp = self._expected_stamp()
        # the next micro-batch of this worker (rank-local count) and how many of its samples
        # went out; None: not started (a worker's first micro-batch is its worker index, known
        # only in the worker)
        self._next: int | None = None
        self._offset = 0
        # with _next None after a finite epoch's end: the rotation of the loader workers that
        # epoch starts under (Energon's WorkerConfig.worker_id_offset); a worker's first
        # micro-batch of it is its torch process's, (worker id - rotation) mod workers
        self._epoch_offset = 0
        start = self.elastic_start
        self._epoch = 0 if start is None else int(start.get("epoch", 0))
        # the global optimizer step this loader started at, and the data-parallel shapes in
        # effect before each elastic restore: [{"at_step", "world_size",
        # "micro_batches_per_step"}] (the window of a restore is re-planned from its step on)
        self._start_step = 0 if start is None else int(start["step"])
        self._history = [] if start is None else [dict(h) for h in start["history"]]
        self._cursor = (self._epoch_cursor(self._epoch) if start is None
                        else dict(start["cursor"]))
        self._forget_plans()

    def _forget_plans(self) -> None:
        """Drops what is recomputed from the state (the window at hand, a window planned
        ahead, the finite epoch's end, which depends on the history): whenever the state is set
        anew."""
        self._cancel_ahead()
        self._generation = getattr(self, "_generation", 0) + 1
        self._hand = None
        self._end_step = None

    def _cancel_ahead(self) -> None:
        """Joins and drops the window being planned ahead (before the state it reads changes)."""
        ahead = getattr(self, "_ahead", None)
        if ahead is not None and ahead.pid == os.getpid():
            ahead.cancel()

    def save_state(self) -> FlexState:
        return super().save_state()

    def _current_version(self, state: Any) -> Any:
        """``state`` as the current version reads it: a state of version 1 or 2 whose
        continuation the current logic keeps is taken (a copy with the fields added since at
        their earlier meaning, stamped with the current version); every other state is returned
        unchanged, for the stamp check to judge."""
        stamp = state.get("_stamp") if isinstance(state, dict) else None
        version = stamp.get("state_version") if isinstance(stamp, dict) else None
        if version not in (1, 2, PLANNED_STATE_VERSION):
            return state
        if "planned_mix" not in stamp:
            # written before planned_mix existed: the step mix, the only one then
            stamp = {**stamp, "planned_mix": "step"}
            state = type(state)({**state, "_stamp": stamp})
        if version == PLANNED_STATE_VERSION:
            return state
        # before version 3 no rotation was saved: the next epoch started as under none
        state = type(state)({"_epoch_offset": 0, **state,
                             "_stamp": {**stamp, "state_version": PLANNED_STATE_VERSION}})
        if version == 2:
            return state
        if state.get("_history"):
            raise StateMismatchError(
                f"{type(self).__name__}: the state was written by an earlier energon_ordering "
                f"(planned state version 1) after an elastic resume (_history = "
                f"{show(state.get('_history'))}), whose windows this version deals differently "
                f"(version {PLANNED_STATE_VERSION}); continue it with the version that wrote it, "
                "or start the data stream fresh.")
        return state

    #: Whether the plan's micro-batches are packs (their sample counts only the plan knows).
    _packed = False

    def _state_shape(self) -> dict[str, Any]:
        """What :func:`~energon_ordering.planned.saved_state.check_planned_state` checks a saved
        state against (besides the loader workers)."""
        return dict(sizes=list(self.ids.sizes), micro_batches_per_step=self.micro_batches_per_step,
                    batch_size=self.batch_size, window_steps=self.window_steps,
                    finite=self.finite, packed=self._packed, owner=type(self).__name__,
                    fields=self._savable_fields)

    def restore_state(self, state: FlexState) -> None:
        self._cancel_ahead()
        check_writer(type(self).__name__, state, PACKING_CHANGED)
        state = self._current_version(state)
        check_stamp(
            type(self).__name__, state, self._expected_stamp(),
            "Resume with the configuration, data and data-parallel size the state was written "
            "with, or start the data stream fresh.",
        )
        check_planned_state(state, **self._state_shape(), workers=self._workers())
        super().restore_state(state)
        self._forget_plans()
        check_next_in_epoch(type(self).__name__, self._next, self.end_step(),
                            self.micro_batches_per_step, self._workers())

    def restore_elastic(self, saved: Sequence[tuple[Any, int]]) -> None:
        """Continues a planned state saved at another data-parallel size, micro-batches per
        step or ``num_workers`` (elastic resume; call before iterating).

        Every rank's state holds the same global position, so any rank's state will do. Every
        step from the state's on holds the samples it holds in the uninterrupted run (windows
        are composed for the run's first shape of this global batch), dealt onto this loader's
        ranks and micro-batches; the step-dependent stages above read the plan's step
        (:meth:`emission_step`), so each sample is also cut as in the uninterrupted run. Nothing
        is lost, drawn twice or moved to another step.

        With ``allow_global_batch_change`` the global batch (and the micro-batch size) may
        change too, at a plan window boundary: every window from there on draws and balances
        the new global batch, per-step source counts continue their carry (cumulative counts
        keep tracking the integral of weight x global batch), and a finite epoch ends where the
        new batch runs a source out.

        Args:
            saved: Per loader worker of the saved rank, its saved state of this stage and the
                micro-batches it emitted after that checkpoint (Energon's ``offset``).

        Raises:
            StateMismatchError: The global batch or micro-batch size changed (without
                ``allow_global_batch_change``, or inside a plan window), or the state was saved
                inside an optimizer step.
        """
        wc = self.worker_config
        known = [self._current_version(state) for state, _ in saved if state is not None]
        for state in known:
            check_planned_state(state, **self._state_shape(), workers=max(1, len(saved)),
                                elastic=True)
        if not known:  # saved before any worker ran: nothing was read
            self.elastic_start = None
            self.reset_state_own()
            return
        first = known[0]
        old = first["_stamp"]
        if old.get("planned_mix") != self.planned_mix:
            raise StateMismatchError(
                f"PlannedSourceDataset: the state was written with planned_mix = "
                f"{show(old.get('planned_mix'))}, this loader has planned_mix = "
                f"{show(self.planned_mix)}; the two place samples in other steps: resume with "
                f"planned_mix = {show(old.get('planned_mix'))} set explicitly (the default "
                "'auto' plans per step only where mixture_schedule changes the weights, else "
                "per window), or start the data stream fresh.")
        R1, M1, B1 = int(old["world_size"]), int(old["micro_batches_per_step"]), int(
            old["batch_size"])
        R2, M2, B2 = int(wc.world_size), self.micro_batches_per_step, self.batch_size
        batch_change = R1 * M1 * B1 != R2 * M2 * B2
        if (B1 != B2 or batch_change) and not self.allow_global_batch_change:
            fits = R1 * M1 * B1 % (R2 * B2) == 0
            raise StateMismatchError(
                f"PlannedSourceDataset: the global batch changes from {R1} ranks x {M1} "
                f"micro-batches x {B1} samples to {R2} x {M2} x {B2}; an elastic resume keeps "
                "the global batch and the micro-batch size: set micro_batches_per_step = "
                f"{R1 * M1 * B1 // (R2 * B2) if fits else '(none fits)'} for {R2} ranks of "
                f"{B2}, or set allow_global_batch_change = True (OrderingConfig, a recipe or "
                "--allow-global-batch-change) to continue the global order with the new one.")
        workers = max(1, len(saved))
        # a worker that has run into a finite epoch's end while the others still hold its last
        # micro-batches is saved in the next epoch (its next micro-batch unknown until that
        # epoch begins): it holds nothing of the epoch the others continue, which is the
        # position, its start step, history and cursor
        epoch = min(int(state.get("_epoch", 0)) for state in known)
        first = next(state for state in known if int(state.get("_epoch", 0)) == epoch)
        nexts, cursors = [], []
        start = int(first.get("_start_step", 0))
        for w, (state, offset) in enumerate(saved):
            if state is not None and int(state.get("_epoch", 0)) > epoch:
                continue
            if state is None:
                n = start * M1 + w
            elif state["_next"] is None:  # its process's first micro-batch (see __iter__)
                n = start * M1 + (w - int(state.get("_epoch_offset", 0))) % workers
            else:
                n = int(state["_next"])
            nexts.append(n + int(offset) * workers)
            if state is not None:
                cursors.append(state["_cursor"])
        consumed = min(nexts)
        step, within = divmod(consumed, M1)
        if within:
            raise StateMismatchError(
                f"PlannedSourceDataset: the state was saved after micro-batch {within} of "
                f"optimizer step {step} ({M1} per step); an elastic resume starts at an "
                "optimizer step: save at a step boundary (Megatron-LM and Bridge do, except "
                "during a batch-size ramp-up, whose iterations draw less than the full global "
                "batch: resume such a checkpoint at the same data-parallel size).")
        K = self.window_steps
        if (B1 != B2 or batch_change) and step % K:
            window = step // K
            raise StateMismatchError(
                f"PlannedSourceDataset: the global batch changes from {R1 * M1 * B1} to "
                f"{R2 * M2 * B2} samples at optimizer step {step}, inside plan window {window} "
                f"(steps {window * K}-{window * K + K - 1}); a window's samples are drawn for one "
                f"global batch, so the change continues at a window boundary: resume from a "
                f"checkpoint at a multiple of plan_window_steps = {K} (e.g. a save interval "
                "that is a multiple of it), or keep the global batch.")
        history = [dict(h) for h in first.get("_history", [])]
        if (R1, M1, B1) != (R2, M2, B2):
            history.append({"at_step": step, "world_size": R1, "micro_batches_per_step": M1,
                            "batch_size": B1})
        cursor = min(cursors, key=lambda c: int(c["window"]))
        self.elastic_start = {"step": step, "history": history, "cursor": dict(cursor),
                              "epoch": epoch}
        self.reset_state_own()
        self._stamp = self._expected_stamp()

    # -- iteration -------------------------------------------------------------------------

    def _window_plan(self, window: int, world_size: int, micro_batches: int,
                     batch_size: int, start: dict[str, Any]
                     ) -> tuple[np.ndarray, PlanCursor, PlanCursor]:
        """``(ids [K, R, M, B], cursor, next cursor)``: the plan of ``window`` for
        ``world_size`` ranks, ``micro_batches`` per step and micro-batches of ``batch_size``,
        advancing the cursor ``start`` (saved form) window by window to it (the step mix: the
        earlier windows' counts with the global batch each had; the window mix: their plans,
        whose deferred samples the cursor carries). Reads the configuration only (it may run
        on the planning-ahead thread)."""
        cursor = _cursor_of(start)
        if window < cursor.window:
            raise OrderingConfigError(
                f"PlannedSourceDataset: window {window} lies before the cursor's window "
                f"{cursor.window}; the state is inconsistent, start fresh.")
        while cursor.window < window:  # earlier windows: their counts only, not their plans
            first = cursor.window * self.window_steps
            if self.planned_mix == "window":
                cursor = self._mix_plan(cursor, *self._plan_shape(first))[1]
                continue
            k = self._steps_in(cursor.window)
            counts, carry = step_source_counts(
                self._step_weights(first, k), self._global_batch_at(first), cursor.carry)
            cursor = advance(cursor, counts, carry)
        if self.planned_mix == "window":
            ids, nxt = self._mix_plan(cursor, world_size, micro_batches, batch_size)
            return ids, cursor, nxt
        k = self._steps_in(cursor.window)
        first = cursor.window * self.window_steps
        weights = self._step_weights(first, k)
        B = batch_size
        counts, carry = step_source_counts(weights, world_size * micro_batches * B, cursor.carry)
        ids = self._shared_plans(world_size, micro_batches, B).ids(
            cursor.window,
            stream_digest(_cursor_state(cursor), hashlib.sha256(weights.tobytes()).hexdigest(), k),
            (k, world_size, micro_batches, B),
            lambda: plan_window(self.lengths, seed=self.seed, cursor=cursor, weights=weights,
                                window_steps=k, world_size=world_size, micro_batch=B,
                                micro_batches_per_step=micro_batches).ids,
            expected=lambda: window_draws(self.ids.sizes, self.seed, cursor, counts),
        )
        return ids, cursor, advance(cursor, counts, carry)

    def _steps_in(self, window: int) -> int:
        """Steps of ``window``: ``plan_window_steps``, fewer in a finite epoch's last window
        (it ends with the epoch)."""
        k, end = self.window_steps, self.end_step()
        return k if end is None else min(k, end - window * k)

    def _caps(self, first: int, steps: int) -> list[int] | None:
        """Most tokens per sample of global optimizer steps ``first ..`` (the warmup's caps;
        None: no warmup): the window mix places each sample at a step it fits."""
        if self.warmup is None:
            return None
        return [int(pack_target(first + t, None, self.warmup)) for t in range(steps)]

    def _mix_plan(self, cursor: PlanCursor, world_size: int, micro_batches: int,
                  batch_size: int) -> tuple[np.ndarray, PlanCursor]:
        """``(ids [K, R, M, B], next cursor)`` of the cursor's window under
        ``planned_mix="window"``, shared with the node's other processes with its next cursor
        (:mod:`.window_mix_share`)."""
        R, M, B = world_size, micro_batches, batch_size
        first = cursor.window * self.window_steps
        K = self._steps_in(cursor.window)  # a finite epoch's last window: up to its end
        weights, caps = self._step_weights(first, K), self._caps(first, K)
        shape = (K, R, M, B)
        defer = not self.finite  # a sample deferred past a finite epoch's end would be lost

        def plan() -> np.ndarray:
            buffer = window_mix_plan_buffer(shape, len(cursor.drawn))  # planned in place
            planned = plan_window(self.lengths, seed=self.seed, cursor=cursor, weights=weights,
                                  window_steps=K, world_size=R, micro_batch=B,
                                  micro_batches_per_step=M, mix="window", caps=caps,
                                  defer=defer, out=buffer[:int(np.prod(shape))])
            return encode_window_mix_plan(planned.ids, planned.next_cursor, buffer)

        flat = self._shared_plans(R, M, B).ids(
            cursor.window,
            stream_digest("window", WINDOW_MIX_PLAN_VERSION, _cursor_state(cursor),
                          hashlib.sha256(weights.tobytes()).hexdigest(), caps, defer),
            (-1,), plan,
            check=lambda a: window_mix_plan_problem(a, seed=self.seed, sizes=self.ids.sizes,
                                                    cursor=cursor, weights=weights,
                                                    shape=shape, caps=caps,
                                                    lengths=self.lengths, deferrable=defer))
        return decode_window_mix_plan(flat, cursor, shape)

    def _shared_plans(self, world_size: int, micro_batches: int, batch_size: int) -> SharedPlans:
        """The node's shared plans of this stream at this shape (none when the lengths are not
        named by a file: nothing would tell two processes' lengths apart)."""
        files = [getattr(x, "filename", None) for x in self.lengths]
        folder = plan_dir() if all(files) else None
        digests = self._lengths_digests() if folder else None
        if not digests:
            folder = None
        stream = stream_digest(PLAN_VERSION, digests, [len(x) for x in self.lengths], self.seed,
                               self.window_steps, world_size, micro_batches, batch_size)
        return SharedPlans(folder, stream, total=self.ids.total)

    def _lengths_digests(self) -> list[str]:
        """The lengths' content digests, read at this process's first use ([] where a file
        cannot be read: its windows are then planned here, unshared; one log line)."""
        if self._digests is None:
            try:
                self._digests = [lengths_content_digest(x) for x in self.lengths]
            except OSError as e:
                logger.warning("planned order: the length index cannot be read again (%s); "
                               "this process plans its windows itself (unshared)", e)
                self._digests = []
        return self._digests

    def _forget_shared_plans(self) -> None:
        """Removes this stream's shared plans, of every shape it ran at (its loader is closed
        or its epoch ended; another process still planning a window of it plans it itself)."""
        shapes = {(int(h["world_size"]), int(h["micro_batches_per_step"]),
                   int(h.get("batch_size", self.batch_size))) for h in self._history}
        shapes.add((int(self.worker_config.world_size), self.micro_batches_per_step,
                    self.batch_size))
        for R, M, B in sorted(shapes):
            self._shared_plans(R, M, B).forget()

    def _shape_at(self, step: int) -> tuple[int, int, int]:
        """(world size, micro-batches per step, micro-batch size) in effect at global optimizer
        ``step``."""
        for h in sorted(self._history, key=lambda h: int(h["at_step"])):
            if int(h["at_step"]) > step:
                return (int(h["world_size"]), int(h["micro_batches_per_step"]),
                        int(h.get("batch_size", self.batch_size)))
        return int(self.worker_config.world_size), self.micro_batches_per_step, self.batch_size

    def _global_batch_at(self, step: int) -> int:
        """The global batch (samples per optimizer step) in effect at ``step``."""
        R, M, B = self._shape_at(step)
        return R * M * B

    def _plan_shape(self, step: int) -> tuple[int, int, int]:
        """The shape the samples of ``step`` were composed for: the first shape of the stretch
        of the run, up to ``step``, over which the global batch and micro-batch size stayed as
        at ``step`` (elastic restores in between changed only how each step is dealt)."""
        entries = sorted(self._history, key=lambda h: int(h["at_step"]))
        shapes = [(int(h["world_size"]), int(h["micro_batches_per_step"]),
                   int(h.get("batch_size", self.batch_size))) for h in entries]
        shapes.append((int(self.worker_config.world_size), self.micro_batches_per_step,
                       self.batch_size))
        j = sum(int(h["at_step"]) <= step for h in entries)  # the stretch holding ``step``

        def batch(shape: tuple[int, int, int]) -> tuple[int, int]:
            return shape[0] * shape[1] * shape[2], shape[2]

        while j > 0 and batch(shapes[j - 1]) == batch(shapes[j]):
            j -= 1
        return shapes[j]

    def _window_steps(self, window: int, b: int | None = None) -> list[np.ndarray | None]:
        """This rank's ``[M, B]`` global ids of each step of the window (``b``: the micro-batch
        asked for, which tells the worker's next window to plan ahead; see :meth:`_at_hand`)."""
        return self._at_hand(window, b).rows

    def _at_hand(self, window: int, b: int | None = None) -> WindowAtHand:
        """The window at hand (planned ahead if it was, else planned now); the saved cursor
        moves to it, and with ``b`` (this worker's micro-batch in it) the worker's next window
        starts planning ahead (:meth:`_plan_ahead_after`)."""
        hand = self._hand
        if hand is not None and (hand.window == window or (hand.last and window > hand.window)):
            return hand
        found, planned = (False, None)
        if self._ahead is not None:
            found, planned = self._ahead.take((self._generation, window))
            if not found:  # planning another window ahead: at most two windows at once
                self._ahead.cancel()
        if not found:
            start = (hand.next_cursor if hand is not None and hand.window < window
                     and not hand.last else self._cursor)
            planned = self._plan_rows(window, start)
        self._hand = hand = planned
        self._cursor = dict(hand.cursor)
        if b is not None:
            self._plan_ahead_after(hand, int(b))
        return hand

    def _next_window_after(self, hand: WindowAtHand, b: int) -> int | None:
        """The window of this worker's first micro-batch after ``hand``'s (``b``: one of its
        micro-batches), or None if the epoch ends first (packed: ``hand.last``; a packed
        epoch's end is known only from the plan)."""
        if hand.last:
            return None
        workers, per_window = self._workers(), self.micro_batches_per_step * self.window_steps
        end = (hand.window + 1) * per_window
        nb = end + (b - end) % workers
        return None if not self._packed and self._epoch_over(nb) else nb // per_window

    def _plan_ahead_after(self, hand: WindowAtHand, b: int) -> None:
        """Starts planning this worker's next window on the planning-ahead thread (a pure
        function of ``hand``'s next cursor and the configuration)."""
        if self._ahead is None:
            return
        window = self._next_window_after(hand, b)
        if window is None:
            return
        start = dict(hand.next_cursor)
        self._ahead.start((self._generation, window), lambda: self._plan_rows(window, start))

    def _plan_rows(self, window: int, start: dict[str, Any]) -> WindowAtHand:
        """Plans ``window`` from the cursor ``start`` (saved form, of that window or an earlier
        one) and keeps this rank's rows of it. Reads the configuration only: it may run on the
        planning-ahead thread.

        The window is planned for the shape its samples are composed for
        (:meth:`_plan_shape`: the run's shape before any elastic restore that kept the global
        batch), so every step holds the samples of the uninterrupted run; a step run at another
        shape deals its samples onto that shape's ranks and micro-batches
        (:func:`~energon_ordering.planned.balance.deal_step`). None: a step this rank has no
        share of (before an elastic restore's step, in an earlier shape with fewer ranks), or
        one before this loader's start, never emitted here."""
        first = window * self.window_steps
        R0, M0, B = self._plan_shape(first)
        ids_of_window, cursor, next_cursor = self._window_plan(window, R0, M0, B, start)
        rank = int(self.worker_config.rank)
        steps: list[np.ndarray | None] = []
        for t, ids in enumerate(ids_of_window):  # [R0, M0, B]
            R, M, _ = self._shape_at(first + t)
            if first + t < self._start_step or rank >= R:
                steps.append(None)
                continue
            if (R, M) != (R0, M0):
                flat = np.asarray(ids).ravel()
                pos = deal_step(self.lengths_of(flat), world_size=R, micro_batch=B,
                                micro_batches_per_step=M)  # [M, R, B]
                ids = flat[pos].transpose(1, 0, 2)
            # a copy: the plan may be a memory map of a shared file, released with it
            steps.append(np.array(ids[rank]))
        return WindowAtHand(window, _cursor_state(cursor), _cursor_state(next_cursor), steps)

    def lengths_of(self, gids: np.ndarray) -> np.ndarray:
        """The lengths (float64) of the samples of global ids ``gids``."""
        src, within = self.ids.split(gids)
        out = np.empty(len(gids))
        for s, lengths in enumerate(self.lengths):
            out[src == s] = lengths[within[src == s]]
        return out

    def micro_batch_ids(self, b: int) -> np.ndarray:
        """Global sample ids of this rank's micro-batch ``b`` (rank-local count)."""
        M, K = self.micro_batches_per_step, self.window_steps
        step, m = divmod(int(b), M)
        window, t = divmod(step, K)
        return self._window_steps(window, b)[t][m]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_executor": None, "_local": None, "_thread_readers": [],
                "_ahead": None, "_hand": None, "_digests": None,
                "lengths": [reopen(x) for x in self.lengths]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, lengths=[reopened(x) for x in state["lengths"]])

    def _read(self, gid: int) -> Any:
        """The raw sample of global id ``gid`` (runs on a prefetch thread: each thread reads
        through its own copy of the readers, which hold a connection and open files)."""
        source, index = (int(x[0]) for x in self.ids.split(np.array([gid])))
        local = self._local
        if local is None:
            return self.readers[source].read(index)
        readers = getattr(local, "readers", None)
        if readers is None:
            readers = local.readers = [r.thread_copy() for r in self.readers]
            self._thread_readers.extend(readers)  # for close()
        return readers[source].read(index)

    def close(self) -> None:
        """Stops the prefetch threads and closes their readers and this process's (a loader
        that is dropped; they reopen on the next read), and removes the stream's shared plans."""
        self._cancel_ahead()
        self._forget_shared_plans()
        executor, local = self._executor, self._local
        self._executor = self._local = None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        for reader in [*self.readers, *self._thread_readers]:
            reader.close()
        self._thread_readers = []
        del executor, local

    def _prefetch(self, gids: np.ndarray) -> list[Future]:
        """Starts reading ``gids`` on the prefetch threads (started on first use)."""
        if self._executor is None:
            self._local = threading.local()
            self._executor = ThreadPoolExecutor(self.prefetch_threads,
                                                thread_name_prefix="planned-prefetch")
        return [self._executor.submit(self._read, int(g)) for g in gids]

    def _load(self, gid: int, raw: Any = None, tag: tuple[int, ...] = ()) -> Any:
        """Sample ``gid`` decoded by Energon's load functions (``raw``: already read); ``tag``
        extends its restore key (:meth:`_sample_tag`)."""
        (source,), (index,) = self.ids.split(np.array([gid]))
        source, index = int(source), int(index)
        key = (RESTORE_KIND, source, index, *tag)
        if raw is None:
            raw = self.readers[source].read(index)
        sample: Any = RawSampleData(__restore_key__=key, data=(raw,))
        for fn in self.loaders[source]:
            sample = fn(sample)
        if isinstance(sample, dict):
            sample["__restore_key__"] = key
        else:
            sample.__restore_key__ = key
        return sample

    def __iter__(self) -> Iterator[Any]:
        workers = self._workers()
        if self._next is None:
            # the epoch's first micro-batch of this worker. After a finite epoch's end the
            # loader starts the next epoch at its first process, whatever logical worker a
            # restore made that process (Energon keeps WorkerConfig.worker_id_offset for the
            # loader's life): the micro-batch of this worker's process under the rotation the
            # epoch starts under (_epoch_offset: set where the end is met, or where a restored
            # worker learns it ended before the loader's iteration; saved; 0 for a fresh start)
            worker = (self.worker_config.rank_worker_id() - self._epoch_offset) % workers
            self._next = self._start_step * self.micro_batches_per_step + worker
        if self.plan_ahead:  # in the process that iterates (a forked worker starts its own)
            self.plan_windows_ahead()
        try:
            yield from self._iter_samples(workers)
        finally:
            self._cancel_ahead()

    def plan_windows_ahead(self) -> None:
        """From now on, in this process, each window this worker reaches starts planning the
        worker's next one on a thread (:mod:`.plan_ahead`); ``__iter__`` calls it when
        :attr:`plan_ahead` is on (exposed for plan-only measurements). Stopped by
        :meth:`close`, the end of an epoch and a restore (each joins the thread)."""
        self._ahead = PlanAhead.for_this_process(self._ahead)

    def _iter_samples(self, workers: int) -> Iterator[Any]:
        """The samples from micro-batch ``_next`` (sample ``_offset``) on (see __iter__)."""
        M, K = self.micro_batches_per_step, self.window_steps
        ahead: dict[int, list[Future]] = {}  # micro-batch -> its reads, started
        while True:
            b, j = self._next, self._offset
            if self._epoch_over(b):
                # the epoch's end: the next iteration is the next epoch, as Energon's reader
                # resets itself at the end of a finite epoch
                self._start_epoch(self._epoch + 1)
                return
            ids = self.micro_batch_ids(b)
            if j:
                check_offset_in_micro_batch(type(self).__name__, j, len(ids), b)
            reads: list[Any] = [None] * len(ids)
            if self.prefetch_threads > 0:
                reads = ahead.pop(b, None) or ([None] * j + self._prefetch(ids[j:]))
                nb = b + workers  # this worker's next micro-batch, if its plan is at hand
                if nb // M // K == b // M // K and not self._epoch_over(nb):
                    ahead[nb] = self._prefetch(self.micro_batch_ids(nb))
            for pos in range(j, len(ids)):
                read = reads[pos]
                sample = self._load(int(ids[pos]), None if read is None else read.result(),
                                    self._sample_tag(b, pos))
                # the state after this yield: the next sample of the plan
                if pos + 1 == len(ids):
                    self._next, self._offset = b + workers, 0
                else:
                    self._offset = pos + 1
                self._emitting_step = b // M
                yield sample

    def emission_step(self) -> int:
        """The global optimizer step of the micro-batch the sample yielded last belongs to: the
        plan's step, which the step-dependent stages above read
        (:class:`~energon_ordering.step_clock.StepClock`). Energon's batch index restarts at 0
        after an elastic resume; this one continues the plan."""
        return self._emitting_step

    def epoch_ended_before(self) -> None:
        """This worker's epoch ended before the loader's current iteration began (called by the
        pipeline stamp when a restored worker has nothing left of the epoch): its next epoch
        starts by loader process, as after an end run here (see :meth:`__iter__`)."""
        self._epoch_offset = int(WorkerConfig.worker_id_offset)

    def _epoch_over(self, b: int) -> bool:
        """True if micro-batch ``b`` lies beyond the end of a finite epoch."""
        end = self.end_step()
        return end is not None and b // self.micro_batches_per_step >= end

    def _sample_tag(self, b: int, pos: int) -> tuple[int, ...]:
        """What the restore key of micro-batch ``b``'s ``pos``-th sample carries besides
        (kind, source, index): nothing here (packing: its pack, see the subclass)."""
        return ()

    def _start_epoch(self, epoch: int) -> None:
        self._cancel_ahead()
        self._forget_shared_plans()
        self._epoch_offset = int(WorkerConfig.worker_id_offset)  # saved: see __iter__
        self._epoch = epoch
        self._next = None
        self._offset = 0
        self._start_step = 0
        self._history = []
        self._cursor = self._epoch_cursor(epoch)
        self._forget_plans()  # the next epoch's history is empty: its end is its own

    # -- Energon's SavableDataset interface ------------------------------------------------

    def len_worker(self, worker_idx: int | None = None) -> int:
        """Samples of one epoch (finite: :meth:`end_step` steps; repeating: one pass over all
        sources), this worker's share."""
        total = self.ids.total if not self.finite else self.end_step() * self._global_batch()
        return max(1, total // (int(self.worker_config.world_size) * self._workers()))

    def worker_has_samples(self) -> bool:
        return True

    def can_restore_sample(self) -> bool:
        return True

    def restore_sample(self, restore_key: tuple[Any, ...]) -> Any:
        if (len(restore_key) < 3 or restore_key[0] != RESTORE_KIND
                or not 0 <= int(restore_key[1]) < len(self.readers)):
            raise OrderingConfigError(
                f"PlannedSourceDataset: restore key {show(restore_key)} is not "
                f"({show(RESTORE_KIND)}, source, index, ...).")
        _, source, index, *tag = restore_key
        return self._load(int(self.ids.join(np.array([source]), np.array([index]))[0]),
                          tag=tuple(tag))

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "readers": [str(r) for r in self.readers],
            "loaders": [[self._function_config(fn) for fn in fns] for fns in self.loaders],
            **{k: v for k, v in self._expected_stamp().items() if k != "state_version"},
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        return (f"PlannedSourceDataset(sources={list(self.ids.sizes)}, seed={self.seed}, "
                f"window_steps={self.window_steps}, micro_batches_per_step="
                f"{self.micro_batches_per_step}, batch_size={self.batch_size})")


def _cursor_state(cursor: PlanCursor) -> dict[str, Any]:
    """A cursor as plain builtins (Megatron-Bridge's restricted unpickler); ``deferred`` (the
    window mix's samples held for a later window) only when it holds any, so a step-mix state
    keeps the shape it always had."""
    out = {"window": int(cursor.window), "drawn": [int(d) for d in cursor.drawn],
           "carry": [float(c) for c in cursor.carry]}
    if cursor.deferred:
        out["deferred"] = [int(g) for g in cursor.deferred]
    return out


def _cursor_of(state: dict[str, Any]) -> PlanCursor:
    return PlanCursor(int(state["window"]), tuple(int(d) for d in state["drawn"]),
                      tuple(float(c) for c in state["carry"]),
                      tuple(int(g) for g in state.get("deferred", ())))
