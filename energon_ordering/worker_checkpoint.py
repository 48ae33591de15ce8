"""A loader worker asked for its state before it has begun iterating answers with its restore point.

Energon (7.4.1) answers ``SavableDataLoader.save_state_rank()`` from each loader worker's command
thread with ``SavableDatasetWrapper.get_checkpoint``: the newest checkpoint at or before the
worker's next sample, plus the samples to skip after it. The worker stores its first checkpoint
when its iteration begins, but the command thread starts a moment earlier, and a request that was
already waiting (a state saved after the first micro-batches, while a slow worker was still
starting) can be answered in between. The only checkpoint then is the placeholder the wrapper's
constructor puts there (no state, sample index -1), and the answer is "start afresh and skip one
sample": the resumed loader loses that worker's first micro-batch, or, for a worker restored from
an earlier state, restarts it from scratch. A forced interleaving loses a micro-batch in about
six restores of ten (``tests/test_worker_checkpoint.py``); the soak caught it under CPU load.

A worker that has not begun iterating has emitted nothing since it was created or restored, so
its exact state is what it would start from: the state it was restored from and the samples it
was told to skip (None and 0 for a fresh one). That is the answer Energon's own
``get_checkpoint`` gives when it finds no checkpoint at all ("immediate save after restore"); the
placeholder keeps that branch from running. :func:`install` makes ``get_checkpoint`` answer so
while the placeholder is the worker's only checkpoint, and leaves every other answer to Energon.
It patches the class once, in the main process, before loader workers fork (``OrderingTaskEncoder``
and :func:`~energon_ordering.state_stamp.restore_state_rank` install it).

The answer holds a deep copy of the restore state, taken under the worker's command lock, never
the restore state itself. The command thread only hands its answer to a ``multiprocessing.Queue``,
whose feeder thread pickles it later, and the moment the lock is released the worker begins: the
dataset's ``restore_state`` keeps the state's own objects as its fields (``SavableDataset`` sets
them without copying), and restoring and skipping mutate them in place. An answer pickled after
that held the worker's advanced buffers under the restore point's sample index and skip (entries
that look right): its resume skipped twice and differed at that worker's first micro-batch
(``tests/test_worker_checkpoint.py``; after the soak, or under load, the feeder was late often
enough). Energon's own answers are copies already (``_save_state`` snapshots).

The loader asked before its workers exist. ``iter(loader)`` only creates Energon's epoch
generator and marks the workers as running (``_has_workers``); the worker processes start at the
first ``next()``. A ``save_state_rank()`` in between sends its command to workers that do not exist
and waits for their answer forever (Energon 7.4.1; fresh or restored loader alike, e.g. a resumed
run saving before its first iteration). While torch's DataLoader has never started its workers
(``_iterator is None``: with ``persistent_workers`` it creates them once), nothing has been
emitted, and :func:`install` makes ``save_state_rank`` give Energon's own answer for workers that
have not started: the restored state, or None for a fresh loader.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from megatron.energon.savable_loader import (
    SavableDataLoader,
    SavableDatasetCheckpoint,
    SavableDatasetWrapper,
)

__all__ = ["install", "not_started", "workers_never_started"]

#: Set on the patched method, so that :func:`install` patches once.
_MARK = "_energon_ordering_not_started_answer"


def not_started(checkpoints: list[Any]) -> bool:
    """True if a worker's checkpoints are only the constructor's placeholder (no state, sample
    index below 0): the worker has not begun iterating."""
    return bool(checkpoints) and all(
        cp.state is None and cp.sample_index < 0 for cp in checkpoints
    )


def install() -> None:
    """Patches ``SavableDatasetWrapper.get_checkpoint`` and ``SavableDataLoader.save_state_rank``
    (idempotent; see the module docstring). Each is left alone on an Energon that lacks the
    attributes its answer reads."""
    _install_loader_answer()
    _install_worker_answer()


def workers_never_started(loader: Any) -> bool:
    """True if ``loader`` (a :class:`SavableDataLoader` with loader workers) is marked as
    iterating but torch has never started its worker processes: nothing was emitted yet."""
    return (getattr(loader, "num_workers", 0) > 0 and bool(getattr(loader, "_has_workers", False))
            and getattr(loader, "_iterator", False) is None)


def _install_loader_answer() -> None:
    original = SavableDataLoader.save_state_rank
    if getattr(original, _MARK, False) or "_has_workers" not in original.__code__.co_names:
        return

    @functools.wraps(original)
    def save_state_rank(self: SavableDataLoader) -> Any:
        if not workers_never_started(self):
            return original(self)
        # Energon's branch for workers that have not started: the restored state, if any
        self._has_workers = False
        try:
            return original(self)
        finally:
            self._has_workers = True

    setattr(save_state_rank, _MARK, True)
    SavableDataLoader.save_state_rank = save_state_rank


def _install_worker_answer() -> None:
    original = SavableDatasetWrapper.get_checkpoint
    if getattr(original, _MARK, False):
        return
    needed = ("_last_checkpoints", "_workers_restore_from", "_workers_skip_samples")
    probe = SavableDatasetWrapper.__init__.__code__.co_names
    if not all(name in probe for name in needed):
        return

    @functools.wraps(original)
    def get_checkpoint(self: SavableDatasetWrapper, last_sample_indexes: list[int]) -> Any:
        if not_started(self._last_checkpoints):
            worker = self._worker_id
            # a snapshot: the worker restores into (and mutates) the state's own objects once the
            # lock is released, possibly before the result queue's feeder thread pickles this
            return SavableDatasetCheckpoint(
                state=copy.deepcopy(self._workers_restore_from[worker]),
                offset=self._workers_skip_samples[worker],
            )
        return original(self, last_sample_indexes)

    setattr(get_checkpoint, _MARK, True)
    SavableDatasetWrapper.get_checkpoint = get_checkpoint
