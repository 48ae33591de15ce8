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
:func:`restore_state_rank` is check-then-restore. Stamps are plain ``dict``/``list``/``str``/
``int``/``float``/``bool``/``None`` values, so they pass restricted unpicklers (Megatron-Bridge).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset

from energon_ordering.errors import StateMismatchError

__all__ = [
    "PIPELINE_STAMP_VERSION",
    "PipelineStampDataset",
    "check_loader_state",
    "check_stamp",
    "check_writer",
    "restore_state_rank",
    "stamp_differences",
    "worker_identity",
]

T_sample = TypeVar("T_sample")

#: Version of the pipeline stamp's layout; bumped when a field is added or changes meaning.
#: 2: adds batch_size, blend, packing_buffer_size, pack_seq_length, pack_pool_placement and
#: packer, and stamps seq_length_overflow under any cap (the warmup or pack_seq_length).
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
    "seq_length_overflow": (
        "OrderingConfig.seq_length_overflow decides what happens to a sample over the cap "
        "(keep, drop or error); resume with the policy the state was written with."
    ),
}

#: The field naming the version of a stamp's layout: a state of another version is refused as
#: a whole (its fields cannot be compared one by one).
_VERSION_FIELD = "stamp_version"


def stamp_differences(saved: Any, expected: dict[str, Any]) -> str | None:
    """Describes how ``saved`` differs from ``expected``, field by field (None if equal)."""
    if saved == expected:
        return None
    if not isinstance(saved, dict):
        return f"saved stamp {saved!r}"
    return "; ".join(
        f"{k}: saved {saved.get(k)!r} != configured {expected.get(k)!r}"
        for k in [*expected, *(k for k in saved if k not in expected)]
        if saved.get(k) != expected.get(k)
    )


def _fixes(saved: Any, expected: dict[str, Any]) -> str:
    if not isinstance(saved, dict):
        return ""
    fixes = []
    for k in [*expected, *(k for k in saved if k not in expected)]:
        fix = FIELD_FIXES.get(k)
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
        f"version of energon_ordering ({_VERSION_FIELD}: saved {saved!r} != configured "
        f"{current!r}). "
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


class PipelineStampDataset(BaseWrapperDataset[T_sample, T_sample], Generic[T_sample]):
    """Stamps a whole training pipeline: what its continuation depends on besides the stages'
    own settings (see the module docstring). Passes samples through unchanged.

    Placed on top of the pipeline, so that on restore its check runs before any stage below
    (Energon's included) interprets the state.

    It also saves whether the pipeline's epoch has ended (``_ended``). With loader workers,
    Energon (7.4.1) stores a last checkpoint when a worker's finite stream ends, and by then the
    webdataset reader has reset itself to the start of a new epoch: a state saved at or after
    the end of a finite epoch (``repeat=False``) restored as a replay of the whole epoch. A
    pipeline restored from an ended state yields nothing for that iteration, like the
    uninterrupted run; iterating again starts the next epoch.
    """

    stamp: dict[str, Any]
    _stamp: dict[str, Any]
    _ended: bool
    _restored: bool = False

    _savable_fields = ("_stamp", "_ended")

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

    def reset_state_own(self) -> None:
        self._stamp = dict(self.stamp)
        self._ended = False
        self._restored = False

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def __iter__(self) -> Iterator[T_sample]:
        ended, restored = self._ended, self._restored
        self._ended = self._restored = False
        if ended and restored:
            return  # restored at the end of a finite epoch: nothing remains of it
        yield from self.dataset
        self._ended = True

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
        super().restore_state(state)
        self._stamp = dict(self.stamp)
        self._restored = True

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "dataset": self.dataset.config(),
            "stamp": dict(self.stamp),
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        return f"PipelineStampDataset(stamp={self.stamp}, dataset={self.dataset})"


def _find_stamp_stage(dataset: Any) -> PipelineStampDataset | None:
    while dataset is not None:
        if isinstance(dataset, PipelineStampDataset):
            return dataset
        dataset = getattr(dataset, "dataset", None)
    return None


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


def check_loader_state(loader: Any, state: Any) -> None:
    """Checks a ``save_state_rank()`` state against ``loader`` before Energon restores it.

    Raises :class:`StateMismatchError` (field, both values, fix) if the state was written for
    another rank, data-parallel size, number of workers, dataset, length index or ordering
    configuration, or if exactly one of the two was written by a stamped pipeline. ``None``
    (no state: start fresh) passes.

    Args:
        loader: An Energon ``SavableDataLoader`` over a pipeline ``OrderingTaskEncoder`` built.
        state: What ``loader.save_state_rank()`` returned in the run being resumed.
    """
    if state is None:
        return
    worker_states = getattr(state, "worker_states", None)
    if not isinstance(worker_states, list) or not worker_states:
        raise StateMismatchError(
            f"restore_state_rank: {type(state).__name__} is not a state that "
            "loader.save_state_rank() wrote (a SavableDataLoaderState with one entry per "
            "loader worker); pass the per-rank state as it was saved."
        )
    stage = _find_stamp_stage(getattr(loader, "dataset", None))
    saved = [_find_saved_stamp(_saved_pipeline_state(ws)) for ws in worker_states]
    found = [s for s in saved if s is not None]
    if stage is None:
        if found:
            raise StateMismatchError(
                "restore_state_rank: the state was written by a pipeline that OrderingTaskEncoder "
                f"built (stamp {found[0].get('_stamp')!r}), but this loader's pipeline has no "
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
    expected_entries = max(1, stage.worker_config.num_workers)
    if len(worker_states) != expected_entries:
        raise StateMismatchError(
            f"restore_state_rank: the state holds {len(worker_states)} worker states but the "
            f"loader has num_workers = {stage.worker_config.num_workers}. {_REDIST}"
        )


def restore_state_rank(loader: Any, state: Any) -> None:
    """:func:`check_loader_state`, then Energon's ``loader.restore_state_rank(state)``."""
    check_loader_state(loader, state)
    loader.restore_state_rank(state)
