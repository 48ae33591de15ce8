"""Whether a saved state of the planned order's source can be its own (issue 31).

A planned source's state per loader worker (``PlannedSourceDataset._savable_fields``) is a few
numbers: the next micro-batch and how many of its samples went out, the finite epoch, the
step the loader started at, the plan cursor, and the data-parallel shapes before each elastic
restore. An edited or damaged state used to end in a hang (an offset beyond the micro-batch
yields nothing and never advances), an untyped ``KeyError``/``TypeError`` inside a worker, or
a silently wrong continuation (a negative draw count). :func:`check_planned_state` refuses each
with one :class:`~energon_ordering.errors.StateMismatchError` line naming the field, the value
and the fix, before the state is used; :func:`check_offset_in_micro_batch` is the same refusal
for a micro-batch whose sample count only the plan knows (with packing).

Pure functions of the saved values and the configured shape; the stamp itself is compared by
:func:`energon_ordering.state_stamp.check_stamp` (an exact restore) or by the elastic resume.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from energon_ordering.planned.window_mix import MAX_DEFERRED
from energon_ordering.saved_counters import (
    check_saved_float,
    check_saved_int,
    saved_value_error,
)

__all__ = [
    "PLANNED_FIELDS",
    "check_next_in_epoch",
    "check_offset_in_micro_batch",
    "check_planned_state",
]

#: The saved fields of ``PlannedSourceDataset`` (a subclass passes its own).
PLANNED_FIELDS = ("_stamp", "_epoch", "_next", "_offset", "_cursor", "_start_step", "_history",
                  "_epoch_offset")

#: The stamp fields an elastic resume reads as the shape the state was saved at.
_SHAPE_FIELDS = ("world_size", "micro_batches_per_step", "batch_size")


def check_planned_state(
    state: Any,
    *,
    sizes: Sequence[int],
    micro_batches_per_step: int,
    batch_size: int,
    window_steps: int,
    workers: int,
    end_step: int | None | Callable[[], int | None] = None,
    elastic: bool = False,
    finite: bool = False,
    packed: bool = False,
    owner: str = "PlannedSourceDataset",
    fields: Collection[str] = PLANNED_FIELDS,
) -> None:
    """Raises :class:`StateMismatchError` unless ``state`` can be a planned source's saved state.

    Checked: every field of ``fields`` is present; ``_stamp`` is a dict (on the elastic path
    also its world size, micro-batches per step and micro-batch size, ints >= 1, which the
    resume reads as the saved shape); ``_epoch``, ``_start_step`` are ints >= 0; ``_next`` is
    None (not started) or an int from the start step's first micro-batch on, and short of the
    finite epoch's end by less than one round of loader workers; ``_offset`` is 0 before the
    first micro-batch, else an int in ``[0, samples of a micro-batch)``; ``_cursor`` is a
    dict of an int ``window`` >= 0 no later than the window of ``_next`` (or of the start
    step), ``drawn`` with one int >= 0 per source (in a finite epoch at least the epoch's
    start) and ``carry`` with one finite number per source; ``_history`` is a list of dicts
    whose ``at_step`` is an int in ``[0, _start_step]`` and whose ``world_size``,
    ``micro_batches_per_step`` (and ``batch_size``, when present) are ints >= 1;
    ``_epoch_offset`` (the workers' rotation a next epoch starts under) is an int in
    ``[0, workers)``.

    Args:
        state: One loader worker's saved state of the stage (a mapping).
        sizes: Samples per source (the plan's sample ids).
        micro_batches_per_step: M of this loader (an exact restore: the state's too; on the
            elastic path the state's M is its stamp's).
        batch_size: B, samples (packs, with packing) per micro-batch of this loader (the same
            rule as ``micro_batches_per_step``).
        window_steps: K, ``plan_window_steps`` (the same in every state of the stream).
        workers: Loader workers per rank the state was saved with (``max(1, num_workers)``;
            on the elastic path the saved worker count).
        end_step: The finite epoch's end in optimizer steps for the state's history (None:
            repeating, or unknown), or a function returning it, called only after
            ``_history`` passed (e.g. the restoring dataset's ``end_step`` once the fields
            are set).
        elastic: The state is read by an elastic resume (its shape comes from its stamp).
        finite: One epoch per iteration (``repeat=False``): draws start at the epoch's start.
        packed: Micro-batches of packs, whose sample count only the plan knows: only
            ``_offset >= 0`` is checked here (see :func:`check_offset_in_micro_batch`); False:
            a micro-batch holds ``batch_size`` samples (the saved one on the elastic path).
        owner: The restoring stage's name, for the message.
        fields: The stage's saved fields (a subclass's own list).
    """
    if not isinstance(state, Mapping):
        raise saved_value_error(owner, "state", state, "a dict of the fields "
                                f"{sorted(fields)}")
    missing = [f for f in fields if f not in state]
    if missing:
        raise saved_value_error(owner, f"state (missing {', '.join(missing)})",
                                sorted(state), f"a dict of the fields {sorted(fields)}")
    stamp = state["_stamp"]
    if not isinstance(stamp, Mapping):
        raise saved_value_error(owner, "_stamp", stamp, "the dict the stage saved")
    M, B = int(micro_batches_per_step), int(batch_size)
    if elastic:
        _, M, B = (check_saved_int(owner, f"_stamp['{k}']", stamp.get(k), minimum=1)
                   for k in _SHAPE_FIELDS)
    epoch = check_saved_int(owner, "_epoch", state["_epoch"])
    start = check_saved_int(owner, "_start_step", state["_start_step"])
    _check_history(owner, state["_history"], start)
    first = start * M
    nxt = state["_next"]
    if nxt is not None:
        check_saved_int(owner, "_next", nxt, minimum=first)
    offset = state["_offset"]
    check_saved_int(owner, "_offset", offset,
                    maximum=0 if nxt is None else None if packed else B - 1)
    check_saved_int(owner, "_epoch_offset", state["_epoch_offset"], maximum=int(workers) - 1)
    _check_cursor(owner, state["_cursor"], sizes, window_steps,
                  last_step=start if nxt is None else int(nxt) // M,
                  epoch=epoch if finite else 0)
    check_next_in_epoch(owner, nxt, end_step() if callable(end_step) else end_step, M,
                        workers)


def check_next_in_epoch(owner: str, next_micro_batch: int | None, end_step: int | None,
                        micro_batches_per_step: int, workers: int) -> None:
    """Raises :class:`StateMismatchError` if a restored next micro-batch lies beyond a finite
    epoch of ``end_step`` optimizer steps by a round of loader workers or more (a worker's
    state after its last micro-batch of the epoch names at most the next of its turns).
    None for ``next_micro_batch`` (not started) or ``end_step`` (repeating) passes."""
    if end_step is None or next_micro_batch is None:
        return
    M, end, W = int(micro_batches_per_step), int(end_step), int(workers)
    if int(next_micro_batch) >= end * M + W:
        raise saved_value_error(
            owner, "_next", next_micro_batch,
            f"below {end * M + W}: the finite epoch ends after optimizer step {end - 1} "
            f"({M} micro-batches per step, {W} loader workers)")


def _check_history(owner: str, history: Any, start: int) -> None:
    should = ("a list of {'at_step', 'world_size', 'micro_batches_per_step', 'batch_size'} "
              "dicts (the data-parallel shapes before each elastic resume)")
    if not isinstance(history, list):
        raise saved_value_error(owner, "_history", history, should)
    for i, entry in enumerate(history):
        if not isinstance(entry, Mapping):
            raise saved_value_error(owner, f"_history[{i}]", entry, should)
        check_saved_int(owner, f"_history[{i}]['at_step']", entry.get("at_step"),
                        maximum=start)
        for key in _SHAPE_FIELDS:
            if key in entry or key != "batch_size":
                check_saved_int(owner, f"_history[{i}]['{key}']", entry.get(key), minimum=1)


def _check_cursor(owner: str, cursor: Any, sizes: Sequence[int], window_steps: int, *,
                  last_step: int, epoch: int) -> None:
    n = len(sizes)
    should = (f"a dict {{'window': int >= 0, 'drawn': {n} ints >= 0, 'carry': {n} finite "
              "numbers}} (the plan cursor)")
    if not isinstance(cursor, Mapping) or not {"window", "drawn", "carry"} <= set(cursor):
        raise saved_value_error(owner, "_cursor", cursor, should)
    last_window = int(last_step) // int(window_steps)
    check_saved_int(owner, "_cursor['window']", cursor["window"], maximum=last_window)
    for key in ("drawn", "carry"):
        if not isinstance(cursor[key], (list, tuple)) or len(cursor[key]) != n:
            raise saved_value_error(owner, f"_cursor['{key}']", cursor[key], should)
    for s, (drawn, size) in enumerate(zip(cursor["drawn"], sizes)):
        check_saved_int(owner, f"_cursor['drawn'][{s}]", drawn, minimum=epoch * int(size))
    for s, carry in enumerate(cursor["carry"]):
        check_saved_float(owner, f"_cursor['carry'][{s}]", carry)
    deferred = cursor.get("deferred", [])
    if not isinstance(deferred, (list, tuple)) or len(deferred) > MAX_DEFERRED:
        raise saved_value_error(owner, "_cursor['deferred']", deferred,
                                f"a list of at most {MAX_DEFERRED} sample ids (the window mix's "
                                "samples held for a later window)")
    for i, gid in enumerate(deferred):
        check_saved_int(owner, f"_cursor['deferred'][{i}]", gid, maximum=sum(sizes) - 1)


def check_offset_in_micro_batch(owner: str, offset: int, samples: int, micro_batch: int) -> None:
    """Raises :class:`StateMismatchError` if a restored ``offset`` (samples of micro-batch
    ``micro_batch`` already emitted) is not below the ``samples`` the plan puts in it: such an
    offset would emit nothing and never advance (a hang)."""
    if not 0 <= int(offset) < max(1, int(samples)):
        raise saved_value_error(
            owner, "_offset", offset,
            f"below the {int(samples)} samples of micro-batch {int(micro_batch)} of the plan")
