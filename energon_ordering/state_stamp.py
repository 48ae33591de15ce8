"""State stamps: what a saved data state belongs to, and the one check every restore runs.

Each ordering wrapper saves a small dict (``_stamp``) of what its continuation depends on: the
version of its logic and its settings. :class:`PipelineStampDataset`, which
:class:`~energon_ordering.task_encoder.OrderingTaskEncoder` puts on top of every training
pipeline it builds, stamps what the whole pipeline depends on: the data-parallel rank and world
size, ``num_workers``, each dataset's identity (Energon's ``index.uuid`` and split), the length
index it sorts by, the micro-batch size, micro-batches per step, lag compensation, the
metadataset's blend weights, the packing settings and packer, and the ordering settings (read off
the pipeline's plan: :mod:`energon_ordering.pipeline.stamp`).

A restore compares a saved stamp with the configured one field by field
(:func:`check_stamp`) and raises :class:`StateMismatchError` naming the field, both values and
the fix. :func:`check_loader_state` runs that check in the main process before Energon's
``restore_state_rank`` sees the state, so that the changes Energon itself would trip over (a
different ``num_workers``) get the same typed error instead of a bare ``AssertionError``;
:func:`restore_state_rank` is check-then-restore (then it corrects Energon's record of what
each restored loader worker has emitted, :func:`count_skipped_samples`); in between it marks
the worker checkpoints that begin a later finite epoch (:func:`start_begun_epochs`). Stamps
are plain ``dict``/``list``/``str``/``int``/``float``/``bool``/``None`` values, so they pass
restricted unpicklers (Megatron-Bridge).
"""

from __future__ import annotations

import copy
import importlib.metadata
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.savable_loader import (
    SavableDataLoaderState,
    SavableDatasetCheckpoint,
    SavableDatasetState,
)
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset

from energon_ordering import failed_epoch, worker_checkpoint
from energon_ordering.errors import StateMismatchError, show
from energon_ordering.saved_counters import check_saved_bool, check_saved_int

logger = logging.getLogger(__name__)

# Every pipeline OrderingTaskEncoder builds has a stamp (this module), so the fixes are in place
# in the main process before any of its loader workers fork.
worker_checkpoint.install()
failed_epoch.install()

__all__ = [
    "PIPELINE_STAMP_VERSION",
    "InputEndDataset",
    "PipelineStampDataset",
    "VERIFIED_ENERGON_VERSION",
    "check_loader_state",
    "check_stamp",
    "check_state_shape",
    "check_writer",
    "count_skipped_samples",
    "begun_epochs",
    "check_energon_version",
    "restore_state_rank",
    "stamp_differences",
    "start_begun_epochs",
    "worker_identity",
]

T_sample = TypeVar("T_sample")
T_stage = TypeVar("T_stage")

#: Version of the pipeline stamp's layout; bumped when a field is added or changes meaning.
#: 2: adds batch_size, blend, packing_buffer_size, pack_seq_length, pack_pool_placement and
#: packer, and stamps seq_length_overflow under any cap (the warmup or pack_seq_length).
#: Also: the batcher's input is an :class:`InputEndDataset` (one more level in the saved state).
PIPELINE_STAMP_VERSION = 2

_REDIST = (
    "energon_ordering does not support redistributing a data state to another data-parallel "
    "size or number of workers (`energon checkpoint redist`): the pool seeds, the schedule step "
    "and the warmup step of a loader worker depend on its worker slot and on the rank's batch "
    "index, so a redistributed state would continue with other data. Resume with the original "
    "data-parallel size and num_workers, or start the data stream fresh."
)

#: What to do when a field differs, by field name (the generic fix is the caller's).
FIELD_FIXES: dict[str, str] = {
    "length_sort_mode": (
        "States of the length pools and of the planned global order (length_sort_mode = "
        "'planned') do not restore into each other: resume with the length_sort_mode the state "
        "was written with, or start the data stream fresh."
    ),
    "rank": (
        "The state is another data-parallel rank's: load the per-rank state file written by "
        "this rank (e.g. Megatron-LM's train_dataloader_dprankXXX.pt with XXX = this rank)."
    ),
    "world_size": _REDIST,
    "num_workers": _REDIST,
    "datasets": (
        "The data is not the data the state was written for (another dataset, or the same path "
        "prepared again: `energon prepare` writes a new .nv-meta/index.uuid). Restore onto the "
        "original prepared data, or start the data stream fresh."
    ),
    "length_index": (
        "The length index differs from the one the pool sorted by (rebuilt, or computed by "
        "another length function). Select the original one (OrderingConfig.length_index) or "
        "start the data stream fresh."
    ),
    "batch_size": (
        "The micro-batch size (get_train_dataset's batch_size, Megatron: --micro-batch-size) "
        "decides which samples meet in a micro-batch and the step every stage counts by; resume "
        "with the micro-batch size the state was written with."
    ),
    "blend": (
        "The metadataset's blend (its `weight`s or `repetitions`) changed, so Energon would draw "
        "the sources in other proportions from here on; resume with the original metadataset, "
        "or give a step schedule (OrderingConfig.mixture_schedule) from the start."
    ),
    "packing_buffer_size": (
        "Packs are built from buffers of OrderingConfig.packing_buffer_size samples (Megatron: "
        "--packing-buffer-size); resume with the buffer size the state was written with."
    ),
    "pack_seq_length": (
        "OrderingConfig.pack_seq_length (Megatron: --packing-seq-length) is the pack target and "
        "the length samples are cut to; resume with the target the state was written with."
    ),
    "pack_pool_placement": (
        "OrderingConfig.pack_pool_placement decides whether the pool sorts packs after packing "
        "('packs') or samples before it ('samples'): the pipeline holds other stages. Resume "
        "with the placement the state was written with."
    ),
    "packer": (
        "Packs are built by other functions (the task encoder's select_samples_to_pack / "
        "pack_selected_samples, or the default packer, by qualified name); resume with the task "
        "encoder the state was written with."
    ),
    "plan_window_steps": (
        "The planned order's windows hold another number of optimizer steps "
        "(OrderingConfig.plan_window_steps, Megatron: --plan-window-steps; left unset it "
        "follows the global batch, and with packing also how many samples a pack holds, read "
        "off the length index, and on repeating data the sources' sizes): set "
        "plan_window_steps to the saved value to resume (if planned_mix changed too, set it "
        "back first: each mix has its own default window and limit)."
    ),
    "planned_mix": (
        "The planned order holds its mix per optimizer step or per plan window "
        "(OrderingConfig.planned_mix, Megatron: --planned-mix), and the two place samples in "
        "other steps: resume with planned_mix set explicitly to the saved value (the default "
        "'auto' takes the step mix only where mixture_schedule changes the weights)."
    ),
    "packing": (
        "A planned order with packing stamps what its packs depend on: the packed plan's logic "
        "(packed_plan_version: this version of energon_ordering packs with other logic, "
        "PACKED_PLAN_VERSION), OrderingConfig.pack_seq_length and the sequence-length warmup. "
        "Resume with the settings and the energon_ordering version that wrote the state, or "
        "start the data stream fresh."
    ),
    "window_mix_plan_version": (
        "This version of energon_ordering plans planned_mix: window windows with other logic "
        "(its WINDOW_MIX_PLAN_VERSION), so the saved position names other samples: resume with "
        "the energon_ordering version that wrote the state, or start the data stream fresh."
    ),
    "seq_length_overflow": (
        "OrderingConfig.seq_length_overflow decides what happens to a sample over the cap "
        "(keep, drop or error); resume with the policy the state was written with."
    ),
}

#: Fields whose fix is not given where the field named beside them differs too (its change
#: is the cause: the window mix's plan version is stamped only under the window mix).
_CAUSED_BY = {"window_mix_plan_version": "planned_mix"}

#: The field naming the version of a stamp's layout: a state of another version is refused as
#: a whole (its fields cannot be compared one by one).
_VERSION_FIELD = "stamp_version"


def stamp_differences(saved: Any, expected: dict[str, Any]) -> str | None:
    """Describes how ``saved`` differs from ``expected``, field by field (None if equal)."""
    if saved == expected:
        return None
    if not isinstance(saved, dict):
        return f"saved stamp {show(saved)}"
    return "; ".join(
        f"{k}: saved {show(saved.get(k))} != configured {show(expected.get(k))}"
        for k in [*expected, *(k for k in saved if k not in expected)]
        if saved.get(k) != expected.get(k)
    )


def _fixes(saved: Any, expected: dict[str, Any]) -> str:
    if not isinstance(saved, dict):
        return ""
    fixes = []
    for k in [*expected, *(k for k in saved if k not in expected)]:
        fix = FIELD_FIXES.get(k)
        cause = _CAUSED_BY.get(k)
        if cause is not None and saved.get(cause) != expected.get(cause):
            continue
        if saved.get(k) != expected.get(k) and fix is not None and fix not in fixes:
            fixes.append(fix)
    return " ".join(fixes)


def check_stamp(owner: str, state: Any, expected: dict[str, Any], fix: str) -> None:
    """Raises :class:`StateMismatchError` if ``state["_stamp"]`` differs from ``expected``.

    The one check every stage runs. The message names each differing field with both values,
    the fix for that field where one is known (:data:`FIELD_FIXES`), then ``fix``. A stamp of
    another layout version (``stamp_version``) is refused as a whole, naming both versions: its
    fields cannot be compared one by one.

    Args:
        owner: The wrapper's name, for the message.
        state: The wrapper's saved state (a mapping with ``_stamp``).
        expected: The stamp of the configured wrapper.
        fix: What the user can do, appended to the message.
    """
    saved = state.get("_stamp") if isinstance(state, dict) else None
    if isinstance(saved, dict) and _VERSION_FIELD in expected and (
        saved.get(_VERSION_FIELD) != expected[_VERSION_FIELD]
    ):
        raise StateMismatchError(_version_mismatch(owner, saved.get(_VERSION_FIELD),
                                                   expected[_VERSION_FIELD]))
    diff = stamp_differences(saved, expected)
    if diff is not None:
        specific = _fixes(saved, expected)
        raise StateMismatchError(
            f"{owner}: cannot restore a state written by a different configuration ({diff}). "
            f"{specific + ' ' if specific else ''}{fix}"
        )


def _version_mismatch(owner: str, saved: Any, current: Any) -> str:
    older = isinstance(saved, int) and isinstance(current, int) and saved < current
    return (
        f"{owner}: cannot restore a state written by {'an older' if older else 'another'} "
        f"version of energon_ordering ({_VERSION_FIELD}: saved {show(saved)} != configured "
        f"{show(current)}). "
        + ("This version stamps more of what the continuation depends on, so the state cannot "
           "be checked against this configuration. " if older else "")
        + "Resume with the energon_ordering version that wrote the state, or start the data "
        "stream fresh."
    )


def check_writer(owner: str, state: Any, hint: str) -> None:
    """Raises :class:`StateMismatchError` if ``state`` was saved by another wrapper class.

    Args:
        owner: The restoring wrapper's class name.
        state: The saved state at the wrapper's position in the pipeline.
        hint: Which setting makes the pipeline differ, and how to fix it.
    """
    writer = state.get("__class__") if isinstance(state, dict) else None
    if writer != owner:
        raise StateMismatchError(
            f"{owner}: the checkpoint holds a {writer} state at this position of the pipeline, "
            f"so it was written by a differently built pipeline. {hint}"
        )


def worker_identity(worker_config: WorkerConfig) -> dict[str, int]:
    """The data-parallel rank, world size and loader workers per rank of ``worker_config``."""
    return {
        "rank": int(worker_config.rank),
        "world_size": int(worker_config.world_size),
        "num_workers": int(worker_config.num_workers),
    }


class InputEndDataset(BaseWrapperDataset[T_sample, T_sample], Generic[T_sample]):
    """Placed directly below Energon's batcher: reports the end of the batcher's input stream to
    the :class:`PipelineStampDataset` on top (its ``_ended``). Passes samples through unchanged
    and saves nothing of its own.

    Energon's batcher emits the last, partial batch of a finite epoch (``repeat=False``,
    ``drop_last=False``) only after its input stream has ended, and by then every stage below has
    finished its epoch: the webdataset reader has reset itself to the start of the next epoch,
    and so have the stages that save an end flag of their own (``FinitePackingDataset``,
    ``LengthPoolSortDataset``, ``FiniteShuffleBufferDataset``), whose epoch is over too. A state
    saved after that batch, before the loader asks for more, was therefore the state of a fresh
    epoch everywhere but in the batcher, and restored to a replay of the whole epoch (Energon
    7.4.1; measured with packing and a pool of packs: 24 micro-batches instead of none). With
    this stage the stamp's end is already set when that batch goes out.

    Not handled: a generator batcher (Energon's ``@generator_batch``) that splits the last,
    partial batch into several; a state saved between those reads as the end of the epoch.
    """

    #: Called (in the loader worker) when the input stream has ended; set by the stamp on top.
    input_end: Callable[[], None] | None

    _savable_fields = ()

    def __init__(
        self,
        dataset: SavableDataset[T_sample],
        *,
        worker_config: WorkerConfig,
        input_end: Callable[[], None] | None = None,
    ):
        """Construct an InputEndDataset.

        Args:
            dataset: The batcher's input.
            worker_config: Energon's worker configuration.
            input_end: Called when the input stream ends (the :class:`PipelineStampDataset`
                built on top of the pipeline sets it to its
                :meth:`~PipelineStampDataset.input_ended`).
        """
        super().__init__(dataset, worker_config=worker_config)
        self.input_end = input_end

    def reset_state_own(self) -> None:
        return

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def __iter__(self) -> Iterator[T_sample]:
        yield from self.dataset
        if self.input_end is not None:
            self.input_end()

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "dataset": self.dataset.config(),
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        return f"InputEndDataset(dataset={self.dataset})"


class PipelineStampDataset(BaseWrapperDataset[T_sample, T_sample], Generic[T_sample]):
    """Stamps a whole training pipeline: what its continuation depends on besides the stages'
    own settings (see the module docstring). Passes samples through unchanged.

    Placed on top of the pipeline, so that on restore its check runs before any stage below
    (Energon's included) interprets the state.

    It also saves whether this loader worker's finite epoch (``repeat=False``) has ended
    (``_ended``), because Energon (7.4.1) cannot tell the end of an epoch from the start of the
    next one. A worker's last samples reach the state in one of two ways, depending on whether
    the worker had run into its end when ``save_state_rank()`` asked it (a race under load):

    - it had: Energon saved the pipeline as it was after the end, and by then the webdataset
      reader had reset itself to the start of a new epoch;
    - it had not: Energon saved an older checkpoint plus the number of samples to skip; the
      restored worker skips them, meets the end of the stream while still skipping, and
      ``SavableDatasetWrapper.__iter__`` then iterates the pipeline again (its "restart after
      skip" loop).

    Either way the restored worker would replay its whole share of the epoch. So an iteration
    that starts with ``_ended`` set yields nothing until the end is *confirmed*: with workers,
    by Energon's end-of-iteration checkpoint of this worker (the ``save_state()`` that
    ``SavableDatasetWrapper.__iter__`` always makes when the worker's iteration finishes, which
    the skip restart never passes through); without workers (Energon restores the exact state
    and never skips), as soon as the end is reached. Iterating after that starts the next epoch,
    as in the uninterrupted run.

    It also counts the ends this worker's stream has run into (``_epochs``), for a loader
    iterated over several finite epochs (``for epoch ...: for batch in loader``). Inside epoch
    ``n + 1``, Energon's checkpoint of a worker is usually its end-of-iteration checkpoint of
    epoch ``n`` (``_ended`` set) plus the samples of epoch ``n + 1`` to skip, or that
    checkpoint with nothing to skip for a worker not yet asked again in the new epoch; both
    must start the next epoch, not yield nothing. Only the whole loader state tells the second
    case from a state saved at the end of epoch ``n``: :func:`start_begun_epochs` (run by
    :func:`restore_state_rank`) clears ``_ended`` in those checkpoints. Energon's own
    ``loader.restore_state_rank`` does not, so with loader workers a state saved inside a later
    epoch restores exactly only through :func:`restore_state_rank`.

    The end is set as soon as the batcher's input has ended (:class:`InputEndDataset` below the
    batcher calls :meth:`input_ended`; the stamp connects to it at construction), not only when
    the batcher has: a last, partial batch goes out after the stream below it has ended.
    """

    stamp: dict[str, Any]
    _stamp: dict[str, Any]
    _ended: bool
    _epochs: int
    #: Not saved: this process reached the end of the epoch (or restored it and yielded nothing).
    _end_reached: bool = False
    #: Not saved: the end is confirmed, so the next iteration is a new epoch (see the docstring).
    _end_confirmed: bool = False

    _savable_fields = ("_stamp", "_ended", "_epochs")

    def __init__(
        self,
        dataset: SavableDataset[T_sample],
        *,
        stamp: dict[str, Any],
        worker_config: WorkerConfig,
    ):
        """Construct a PipelineStampDataset.

        Args:
            dataset: The pipeline to stamp.
            stamp: What the pipeline's continuation depends on, as plain builtin values; the
                rank, world size and num_workers of ``worker_config`` and the stamp version are
                added.
            worker_config: Energon's worker configuration.
        """
        super().__init__(dataset, worker_config=worker_config)
        self.stamp = {
            "stamp_version": PIPELINE_STAMP_VERSION,
            **worker_identity(worker_config),
            **stamp,
        }
        self.reset_state_own()
        input_end = _find_stage(dataset, InputEndDataset)
        if input_end is not None:
            input_end.input_end = self.input_ended
        # a source whose next epoch must start by loader process (the planned order's)
        self._epoch_ended_before = getattr(
            _find_stage_with(dataset, "epoch_ended_before"), "epoch_ended_before", None)

    def input_ended(self) -> None:
        """The batcher's input of this worker's finite epoch has ended: what the batcher still
        emits is the epoch's last (partial) batch, after which nothing of the epoch remains.
        Counts the epoch once (also when the iteration then ends)."""
        if not self._ended:
            self._ended = True
            self._epochs += 1

    def reset_state_own(self) -> None:
        self._stamp = dict(self.stamp)
        self._ended = False
        self._epochs = 0
        self._end_reached = False
        self._end_confirmed = False

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def __iter__(self) -> Iterator[T_sample]:
        if self._ended and not self._end_confirmed:
            # Restored at the end of a finite epoch, or Energon iterating again after skipping
            # to it: nothing remains of the epoch.
            self._reach_end()
            if self._epoch_ended_before is not None:
                self._epoch_ended_before()
            return
        self._ended = self._end_reached = self._end_confirmed = False
        yield from self.dataset
        self.input_ended()
        self._reach_end()

    def _reach_end(self) -> None:
        self._end_reached = True
        if self.worker_config.num_workers == 0:
            self._end_confirmed = True  # no worker checkpoints, no replay by skipping

    def save_state(self) -> FlexState:
        state = super().save_state()
        if self._end_reached:
            # Energon's end-of-iteration checkpoint of this worker (see the class docstring).
            self._end_confirmed = True
        return state

    def restore_state(self, state: FlexState) -> None:
        check_writer(
            type(self).__name__,
            state,
            "It was not written by a pipeline that OrderingTaskEncoder built (or by an older "
            "version of energon_ordering); start the data stream fresh.",
        )
        check_stamp(
            type(self).__name__,
            state,
            self.stamp,
            "Restore with the configuration the state was written with, or start the data "
            "stream fresh.",
        )
        if "_epochs" not in state:  # written before the count was saved: no epoch ended before
            state = FlexState({**state, "_epochs": 0})
        super().restore_state(state)
        self._stamp = dict(self.stamp)
        self._end_reached = self._end_confirmed = False

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "dataset": self.dataset.config(),
            "stamp": dict(self.stamp),
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        return f"PipelineStampDataset(stamp={self.stamp}, dataset={self.dataset})"


def _find_stage(dataset: Any, cls: type[T_stage]) -> T_stage | None:
    """The first stage of type ``cls`` down the ``.dataset`` chain from ``dataset``."""
    while dataset is not None:
        if isinstance(dataset, cls):
            return dataset
        dataset = getattr(dataset, "dataset", None)
    return None


def _find_stamp_stage(dataset: Any) -> PipelineStampDataset | None:
    return _find_stage(dataset, PipelineStampDataset)


def _saved_pipeline_state(worker_state: Any) -> Any:
    """The pipeline's saved state inside one entry of ``SavableDataLoaderState.worker_states``:
    the entry itself without workers, ``entry.state.dataset_state`` with workers."""
    if isinstance(worker_state, FlexState):
        return worker_state
    inner = getattr(worker_state, "state", None)
    return getattr(inner, "dataset_state", None)


def _find_saved_stamp(state: Any) -> Any:
    while isinstance(state, dict):
        if state.get("__class__") == PipelineStampDataset.__name__:
            return state
        inner = state.get("datasets")
        state = inner[0] if isinstance(inner, list) and len(inner) == 1 else state.get("dataset")
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_state_shape(state: Any) -> None:
    """Raises :class:`StateMismatchError` naming the first part of ``state`` that does not have
    the shape Energon's ``save_state_rank()`` writes: a ``SavableDataLoaderState`` whose
    ``worker_states`` are one ``FlexState`` (no loader workers) or one
    ``SavableDatasetCheckpoint`` per worker (an int ``offset`` >= 0 and a ``state`` that is None
    or a ``SavableDatasetState``), an int ``next_worker_id`` indexing them and a
    ``micro_batch_size`` that is None or an int >= 1. A state edited by hand or damaged fails
    here instead of with a bare ``TypeError``/``AttributeError`` inside Energon's restore."""
    def wrong(where: str, value: Any, should: str) -> StateMismatchError:
        return StateMismatchError(
            f"restore_state_rank: {where} is {show(value)} ({type(value).__name__}); {should}. "
            "The state was edited or damaged: pass the per-rank state exactly as "
            "loader.save_state_rank() returned it, or start the data stream fresh."
        )

    if not isinstance(state, SavableDataLoaderState):
        raise wrong("the state", state, "it must be the SavableDataLoaderState that "
                    "loader.save_state_rank() returns")
    entries = state.worker_states
    if not isinstance(entries, list) or not entries:
        raise wrong("worker_states", entries, "it must be a non-empty list with one entry per "
                    "loader worker (one FlexState without workers)")
    kind = FlexState if isinstance(entries[0], FlexState) else SavableDatasetCheckpoint
    for i, entry in enumerate(entries):
        if not isinstance(entry, kind) or (kind is FlexState and len(entries) != 1):
            raise wrong(f"worker_states[{i}]", entry, "it must be a FlexState (the only entry, "
                        "no loader workers) or a SavableDatasetCheckpoint (one per worker)")
        if kind is SavableDatasetCheckpoint:
            if not _is_int(entry.offset) or entry.offset < 0:
                raise wrong(f"worker_states[{i}].offset", entry.offset, "it must be an int >= 0")
            inner = entry.state
            if inner is not None and not (
                isinstance(inner, SavableDatasetState)
                and isinstance(inner.dataset_state, FlexState)
                and _is_int(inner.sample_index)
            ):
                raise wrong(f"worker_states[{i}].state", inner, "it must be None or a "
                            "SavableDatasetState (a FlexState dataset_state, an int sample_index)")
    if not _is_int(state.next_worker_id) or not 0 <= state.next_worker_id < len(entries):
        raise wrong("next_worker_id", state.next_worker_id,
                    f"it must be an int in [0, {len(entries)}) (an index into worker_states)")
    batch = state.micro_batch_size
    if batch is not None and (not _is_int(batch) or batch < 1):
        raise wrong("micro_batch_size", batch, "it must be None or an int >= 1")


def check_loader_state(loader: Any, state: Any) -> None:
    """Checks a ``save_state_rank()`` state against ``loader`` before Energon restores it.

    Raises :class:`StateMismatchError` (field, both values, fix) if the state was written for
    another rank, data-parallel size, number of workers, dataset, length index or ordering
    configuration, if exactly one of the two was written by a stamped pipeline, or if the state
    does not have the shape ``save_state_rank()`` writes (:func:`check_state_shape`). ``None``
    (no state: start fresh) passes.

    Args:
        loader: An Energon ``SavableDataLoader`` over a pipeline ``OrderingTaskEncoder`` built.
        state: What ``loader.save_state_rank()`` returned in the run being resumed.
    """
    if state is None:
        return
    check_state_shape(state)
    worker_states = state.worker_states
    stage = _find_stamp_stage(getattr(loader, "dataset", None))
    saved = [_find_saved_stamp(_saved_pipeline_state(ws)) for ws in worker_states]
    found = [s for s in saved if s is not None]
    if stage is None:
        if found:
            raise StateMismatchError(
                "restore_state_rank: the state was written by a pipeline that OrderingTaskEncoder "
                f"built (stamp {show(found[0].get('_stamp'))}), but this loader's pipeline has no "
                "energon_ordering stamp; build the loader with the same task encoder and "
                "OrderingConfig."
            )
        return
    if not found:
        raise StateMismatchError(
            "restore_state_rank: the state carries no energon_ordering stamp, so it was written "
            "by a pipeline OrderingTaskEncoder did not build, or by an older version of "
            "energon_ordering; its continuation cannot be checked. Start the data stream fresh."
        )
    for pipeline_state in found:
        check_stamp(
            "restore_state_rank",
            pipeline_state,
            stage.stamp,
            "Restore with the configuration the state was written with, or start the data "
            "stream fresh.",
        )
    _check_end_records(found)
    expected_entries = max(1, stage.worker_config.num_workers)
    if len(worker_states) != expected_entries:
        raise StateMismatchError(
            f"restore_state_rank: the state holds {len(worker_states)} worker states but the "
            f"loader has num_workers = {stage.worker_config.num_workers}. {_REDIST}"
        )


def restore_state_rank(loader: Any, state: Any) -> None:
    """:func:`check_loader_state`, then :func:`start_begun_epochs`, then Energon's
    ``loader.restore_state_rank`` on the result, then :func:`count_skipped_samples`.

    ``state`` itself is never modified (:func:`start_begun_epochs` works on a copy). ``None``
    starts the loader afresh (Energon's meaning); for the planned order, whose missing state is
    more often a lost file than a new run, it says so in one log line."""
    if state is None:
        stage = _find_stamp_stage(getattr(loader, "dataset", None))
        if stage is not None and stage.stamp.get("length_sort_mode") == "planned":
            logger.warning(
                "restore_state_rank: no state (None) for the planned order: this loader starts "
                "afresh, at optimizer step 0 of epoch 0 (rank %s of %s); pass the state "
                "save_state_rank() returned to continue a run.",
                stage.worker_config.rank, stage.worker_config.world_size)
    if _restore_elastic(loader, state):
        return
    check_loader_state(loader, state)
    state = start_begun_epochs(state)
    loader.restore_state_rank(state)
    count_skipped_samples(loader, state)


#: Stamp fields in which a planned state may differ from the loader (an elastic resume).
ELASTIC_FIELDS = frozenset({"rank", "world_size", "num_workers", "micro_batches_per_step",
                            "batch_size"})


def _restore_elastic(loader: Any, state: Any) -> bool:
    """The elastic resume of the planned global order (``length_sort_mode = 'planned'``): a
    state saved at another data-parallel size, rank, micro-batches per step or ``num_workers``
    continues the same global order (see ``PlannedSourceDataset.restore_elastic``). Returns
    False (nothing done) for every other state, which the exact checks then take; other modes
    keep refusing such states there."""
    if state is None:
        return False
    check_state_shape(state)
    stage = _find_stamp_stage(getattr(loader, "dataset", None))
    if stage is None or stage.stamp.get("length_sort_mode") != "planned":
        return False
    pipelines = [_saved_pipeline_state(ws) for ws in state.worker_states]
    stamps = [_find_saved_stamp(p) for p in pipelines]
    found = [s.get("_stamp") for s in stamps if s is not None]
    if not found or not isinstance(found[0], dict):
        return False
    saved = found[0]
    differ = {k for k in {*saved, *stage.stamp} if saved.get(k) != stage.stamp.get(k)}
    if not differ or not differ <= ELASTIC_FIELDS:
        return False
    planned = _find_stage_with(loader.dataset, "restore_elastic")
    if planned is None:
        return False
    entries = []
    for ws, pipeline in zip(state.worker_states, pipelines):
        offset = 0 if isinstance(ws, FlexState) else int(getattr(ws, "offset", 0) or 0)
        entries.append((_find_saved_class(pipeline, type(planned).__name__), offset))
    if getattr(loader, "_iterator", None) is not None:
        raise StateMismatchError(
            "restore_state_rank: an elastic resume of the planned order must restore before the "
            "loader is iterated; restore into a fresh loader.")
    planned.restore_elastic(entries)
    # the pipeline's own end-of-epoch record carries over: a state saved after the last step
    # of a finite epoch resumes to nothing, as an exact restore does
    _check_end_records([s for s in stamps if s is not None])
    ended = [bool(s.get("_ended")) for s in stamps if s is not None]
    stage._ended = bool(ended) and all(ended)
    stage._epochs = min(int(s.get("_epochs", 0)) for s in stamps if s is not None)
    _restore_elastic_start(loader)
    return True


def _restore_elastic_start(loader: Any) -> None:
    """Gives an elastically restored loader with workers the restore point Energon keeps for an
    exact restore: each worker's state is the pipeline's state at the elastic start (taken here,
    in the main process, before any worker runs), with nothing to skip. Without it Energon's
    workers look fresh (no restore point), and a ``save_state_rank()`` before a worker's first
    micro-batch answered ``None`` for it: a state that restarts the epoch. With it, every state
    the loader saves is an exact state of its own shape. Without workers the in-process dataset
    is the state already."""
    workers = int(getattr(loader, "num_workers", 0) or 0)
    wrapper = getattr(loader, "dataset", None)
    if workers == 0 or not hasattr(wrapper, "restore_checkpoint"):
        return
    snapshot = wrapper.dataset.save_state()
    wrapper.restore_checkpoint(
        [SavableDatasetCheckpoint(
            state=SavableDatasetState(rng=None, dataset_state=copy.deepcopy(snapshot),
                                      sample_index=0),
            offset=0) for _ in range(workers)],
        worker_offset=0)


def _check_end_records(pipeline_states: list[Any]) -> None:
    """Refuses an edited end-of-epoch record in a saved pipeline stamp (``_ended`` a bool,
    ``_epochs`` an int >= 0; a state from before ``_epochs`` was saved has none), read before
    any worker restores it (:func:`start_begun_epochs`)."""
    for saved in pipeline_states:
        check_saved_bool("PipelineStampDataset", "_ended", saved.get("_ended", False))
        if "_epochs" in saved:
            check_saved_int("PipelineStampDataset", "_epochs", saved["_epochs"])


def loader_stamp(loader: Any) -> dict[str, Any] | None:
    """The pipeline stamp of ``loader``'s pipeline (None: not built by OrderingTaskEncoder)."""
    stage = _find_stamp_stage(getattr(loader, "dataset", None))
    return None if stage is None else dict(stage.stamp)


def saved_stamp(state: Any) -> dict[str, Any] | None:
    """The pipeline stamp a ``save_state_rank()`` state was written under (None: none)."""
    for ws in getattr(state, "worker_states", None) or []:
        found = _find_saved_stamp(_saved_pipeline_state(ws))
        if found is not None and isinstance(found.get("_stamp"), dict):
            return dict(found["_stamp"])
    return None


def _find_stage_with(dataset: Any, attribute: str) -> Any:
    """The first stage of ``dataset``'s pipeline (top down) that has ``attribute``."""
    stack = [dataset]
    while stack:
        ds = stack.pop()
        if hasattr(ds, attribute):
            return ds
        inner = getattr(ds, "datasets", None)
        if inner:  # Energon's wrappers (a blend's `dataset` property asserts a single one)
            stack.extend(inner)
        elif getattr(ds, "dataset", None) is not None:
            stack.append(ds.dataset)
    return None


def _find_saved_class(state: Any, name: str) -> Any:
    """The saved state of the stage of class ``name`` inside a saved pipeline state."""
    stack = [state]
    while stack:
        s = stack.pop()
        if not isinstance(s, dict):
            continue
        if s.get("__class__") == name:
            return s
        inner = s.get("datasets")
        if isinstance(inner, list):
            stack.extend(inner)
        stack.append(s.get("dataset"))
    return None


#: The Energon version whose worker checkpoints :func:`start_begun_epochs` and
#: :func:`count_skipped_samples` were verified against (see :func:`check_energon_version`).
VERIFIED_ENERGON_VERSION = "7.4.1"


def check_energon_version() -> None:
    """Warns once if the installed Energon is not :data:`VERIFIED_ENERGON_VERSION`.

    :func:`start_begun_epochs` and :func:`count_skipped_samples` compensate for how Energon's
    ``SavableDatasetWrapper`` checkpoints a loader worker (a checkpoint stored at the start of
    each iteration, on time, and always at its end, plus a count of samples to skip) and how
    ``SavableDataLoader.restore_state_rank`` sets ``_worker_sample_counters``; both are private
    behaviour of that version. Other versions are not refused (the compensation is still
    likely right), but the finite-epoch tests should be run against them.
    """
    global _energon_version_checked
    if _energon_version_checked:
        return
    _energon_version_checked = True
    try:
        installed = importlib.metadata.version("megatron-energon")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed != VERIFIED_ENERGON_VERSION:
        warnings.warn(
            f"energon_ordering.restore_state_rank: megatron-energon {installed} is installed, but "
            f"its compensation for Energon's worker checkpoints at finite epoch ends was verified "
            f"against {VERIFIED_ENERGON_VERSION}; run tests/test_finite_epoch_end.py and "
            "tests/test_multi_epoch_resume.py against this version.",
            stacklevel=3,
        )


_energon_version_checked = False


def begun_epochs(workers: list[tuple[int, bool, int]]) -> list[bool]:
    """Which loader workers' checkpoints must start their next epoch on restore.

    Pure function of one rank's saved loader state, one ``(epochs, ended, offset)`` per worker:
    the ends the worker's stream had run into at its checkpoint (``_epochs``), whether the
    checkpoint was taken after such an end (``_ended``), and the samples Energon skips after it
    (``SavableDatasetCheckpoint.offset``).

    Each worker's position in epochs (1-based): a checkpoint inside an epoch (not ended) is in
    epoch ``epochs + 1``, also when its skip reaches that epoch's end; an ended checkpoint with
    samples to skip is in the next epoch, ``epochs + 1``; an ended one with nothing to skip is
    at the end of epoch ``epochs``. The loader is in the latest of these, ``L``. An ended
    checkpoint must start the next epoch if it has samples to skip, or if it ended epoch
    ``L - 1``: the loader had begun epoch ``L`` before the worker was asked for it again. Every
    other ended checkpoint is at the end of epoch ``L`` (the remainder is nothing). A loader
    saved before its first micro-batch of a new epoch cannot be told from one saved at the end
    of the previous epoch (Energon's state is the same): it resumes as at the end.

    Returns:
        Per worker, True if its ``_ended`` must be cleared before Energon restores it.
    """
    if not workers:
        return []
    latest = max(
        epochs + 1 if (not ended or offset > 0) else epochs for epochs, ended, offset in workers
    )
    return [ended and (offset > 0 or epochs < latest) for epochs, ended, offset in workers]


def start_begun_epochs(state: Any) -> Any:
    """``state`` with ``_ended`` cleared in the loader workers' checkpoints that start their
    next finite epoch (:func:`begun_epochs`), as a copy; ``state`` itself if there are none.

    Without that, a worker restored from such a checkpoint yields nothing where the loader was
    inside a later epoch (see :class:`PipelineStampDataset`). It reads and writes only the saved
    state (``SavableDatasetCheckpoint.offset`` and the pipeline stamp's saved fields), no
    attribute of a loader. No-op without workers (the saved state is the pipeline's exact
    state) or without a stamp.
    """
    entries = getattr(state, "worker_states", None)
    if not isinstance(entries, list) or not all(
        isinstance(e, SavableDatasetCheckpoint) for e in entries
    ):
        return state
    stamps = [_find_saved_stamp(_saved_pipeline_state(e)) for e in entries]
    if any(s is None for s in stamps):
        return state
    check_energon_version()
    begun = begun_epochs(
        [(int(s.get("_epochs", 0)), bool(s.get("_ended")), int(e.offset))
         for s, e in zip(stamps, entries)]
    )
    if not any(begun):
        return state
    state = copy.deepcopy(state)
    for entry, start in zip(state.worker_states, begun):
        if start:
            _find_saved_stamp(_saved_pipeline_state(entry))["_ended"] = False
    return state


def count_skipped_samples(loader: Any, state: Any) -> None:
    """Counts the samples each restored loader worker skips as already emitted.

    A worker's entry in a saved state is a checkpoint plus ``offset`` samples to skip after it.
    Energon (7.4.1) restores the loader's record of each worker's last emitted sample as the
    checkpoint's index alone, so a ``save_state_rank()`` taken before that worker yields again
    (e.g. right after restoring a state saved at the end of a finite epoch, or after fewer
    micro-batches than loader workers) returns the checkpoint without the skip, and restoring
    it replays those samples. Setting the record to checkpoint + offset makes Energon return
    the checkpoint with the same offset. No-op without workers or without a state.
    """
    counters = getattr(loader, "_worker_sample_counters", None)
    worker_states = getattr(state, "worker_states", None)
    if not getattr(loader, "num_workers", 0) or not isinstance(counters, list) or not worker_states:
        return
    for worker, checkpoint in enumerate(worker_states[: len(counters)]):
        snapshot = getattr(checkpoint, "state", None)
        if snapshot is not None:
            counters[worker] = int(snapshot.sample_index) + int(checkpoint.offset) - 1
