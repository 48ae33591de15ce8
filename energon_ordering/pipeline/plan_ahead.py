"""Planning the next window off the critical path: one window computed ahead on a thread.

A planned loader worker needs window w+1's plan at the first micro-batch of w+1; computed
there, the plan (0.2 s padded, 3-4 s packed at 1,024 ranks) is a gap in the worker's stream at
every window boundary. :class:`PlanAhead` computes it while window w is consumed: the worker
starts it when it enters w (:meth:`PlanAhead.start`) and takes it when it reaches w+1
(:meth:`PlanAhead.take`), waiting only for what is left of it.

Deterministic: what is computed is a pure function of its key's inputs (the plan of a window
from a cursor), so taking it or computing it on the spot give the same value; the thread only
moves the work in time. A result whose key is not the one asked for is dropped, never used;
an exception on the thread is not raised there: the caller computes the value itself and meets
the error where it always did.

One job at a time, so a worker holds at most two windows' rows (the one at hand and the next).
The thread is a daemon started inside the process that iterates (a forked loader worker
starts its own: :meth:`PlanAhead.for_this_process`), and :meth:`PlanAhead.cancel` joins it
(closing the loader, the end of an epoch, a restore).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["PlanAhead", "THREAD_NAME", "WindowAtHand"]

#: The name of the planning thread (tests look for leaked ones by it).
THREAD_NAME = "energon-ordering-plan-ahead"


@dataclass(frozen=True)
class WindowAtHand:
    """What a loader worker keeps of one planned window (never the other ranks' rows).

    Attributes:
        window: The window's index.
        cursor: Its plan cursor (as saved: plain builtins).
        next_cursor: The cursor of the window after it.
        rows: Per step of the window, this rank's share of it (None: a step this rank has no
            share of), as the source reads it.
        plan: What else the source keeps of the window (the packed plan without its packs), or
            None.
        last: True if no window follows in the epoch (a finite epoch ends in it).
    """

    window: int
    cursor: dict[str, Any]
    next_cursor: dict[str, Any]
    rows: list[Any]
    plan: Any = None
    last: bool = False


class _Job:
    """One computation on its thread: its key, and its value or error once done."""

    def __init__(self, key: Hashable, fn: Callable[[], Any]):
        self.key = key
        self.value: Any = None
        self.failed = False
        self.thread = threading.Thread(target=self._run, args=(fn,), name=THREAD_NAME,
                                       daemon=True)

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException:  # the caller computes it again and meets the error itself
            self.failed = True


class PlanAhead:
    """Computes one value ahead of need on a daemon thread (see the module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._job: _Job | None = None

    @classmethod
    def for_this_process(cls, current: PlanAhead | None) -> PlanAhead:
        """``current`` if it was made in this process, else a new one (a forked loader worker
        inherits no thread: a copy made before the fork is dropped, never joined)."""
        return current if current is not None and current.pid == os.getpid() else cls()

    def start(self, key: Hashable, fn: Callable[[], Any]) -> None:
        """Starts computing ``fn()`` for ``key``, unless that job is already under way; any
        other job is joined and dropped first."""
        if self._job is not None and self._job.key == key:
            return
        self.cancel()
        self._job = _Job(key, fn)
        self._job.thread.start()

    def take(self, key: Hashable) -> tuple[bool, Any]:
        """``(True, value)`` if the job under way (or done) is ``key``'s and succeeded, waiting
        for it; else ``(False, None)`` (the caller computes it). The job is gone after."""
        job = self._job
        if job is None or job.key != key:
            return False, None
        self._job = None
        job.thread.join()
        return (False, None) if job.failed else (True, job.value)

    def busy(self) -> bool:
        """True while a job's thread runs."""
        return self._job is not None and self._job.thread.is_alive()

    def cancel(self) -> None:
        """Joins the job's thread, if any, and drops its value (a thread cannot be interrupted:
        it finishes the window it plans)."""
        job, self._job = self._job, None
        # (a generator finalised by a collection on the planning thread itself cancels too)
        if job is not None and job.thread is not threading.current_thread():
            job.thread.join()
