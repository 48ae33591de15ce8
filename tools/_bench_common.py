"""Helpers shared by the benchmarks in ``tools/``: the command line, CPU time beside wall time,
and checks that may fail against checks that only report.

A benchmark on a shared machine measures two kinds of things:

- figures that do not depend on the machine's load (straggler idle, padding, exact counts):
  :func:`check` prints them and counts a failure, and :func:`finish` exits 1 after any;
- figures that do (samples/s, first-batch times, their ratios): :func:`load_dependent` prints
  ``load-dependent: ... (not a failure)`` and never fails. Their CPU-time form (this process
  and its reaped children: loader workers) is the steady one, printed beside the wall-clock one.

Usage in a benchmark's ``main``::

    start = begin()            # prints the exact command line, starts the clock
    with timed() as t:
        run()
    print(f"{t.cpu:.1f} s CPU, {t.wall:.1f} s wall")
    finish(start)              # prints total CPU and wall; exits 1 if a check failed
"""

from __future__ import annotations

import os
import resource
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = [
    "Clock",
    "begin",
    "check",
    "command_line",
    "cpu_seconds",
    "failures",
    "finish",
    "load_dependent",
    "machine_speed",
    "ratio",
    "timed",
]

_FAILURES: list[str] = []
#: Wall clock when this module was imported (a benchmark imports it first): the run's start.
_STARTED = time.perf_counter()


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have exited and been
    waited for (loader worker processes, once their loader is closed)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


@dataclass
class Clock:
    """Wall and CPU seconds since :attr:`wall0` / :attr:`cpu0` (set at construction);
    :meth:`stop` freezes :attr:`wall` and :attr:`cpu`."""

    wall0: float = field(default_factory=time.perf_counter)
    cpu0: float = field(default_factory=cpu_seconds)
    wall: float = 0.0
    cpu: float = 0.0

    def stop(self) -> Clock:
        """Freezes the elapsed wall and CPU seconds; returns ``self``."""
        self.wall = time.perf_counter() - self.wall0
        self.cpu = cpu_seconds() - self.cpu0
        return self

    def text(self) -> str:
        """``"CPU 12.3 s, wall 45.6 s"`` (frozen values, or elapsed so far if not stopped)."""
        wall = self.wall or time.perf_counter() - self.wall0
        cpu = self.cpu or cpu_seconds() - self.cpu0
        return f"CPU {cpu:.1f} s, wall {wall:.1f} s"


@contextmanager
def timed() -> Iterator[Clock]:
    """``with timed() as t:`` ... then ``t.wall`` and ``t.cpu`` hold the block's seconds."""
    clock = Clock()
    try:
        yield clock
    finally:
        clock.stop()


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed: ``python tools/bench_x.py --quick`` (the script path relative to
    the working directory when it lies below it), quoted for a POSIX shell."""
    args = list(sys.argv if argv is None else argv)
    script = args[0] if args else ""
    try:
        rel = os.path.relpath(script)
        if not rel.startswith(".."):
            script = rel
    except ValueError:  # another drive (Windows)
        pass
    return shlex.join(["python", script, *args[1:]])


def begin(argv: Sequence[str] | None = None) -> Clock:
    """Prints ``$ <the exact command line>`` first and returns the clock of the whole run: CPU
    since the process started (imports included), wall since this module was imported."""
    print(f"$ {command_line(argv)}", flush=True)
    return Clock(wall0=_STARTED, cpu0=0.0)


def machine_speed(n: int = 1 << 20, repeats: int = 5) -> str:
    """This machine's speed at a planner's two staple operations, as a line to print: CPU ms
    (the best of ``repeats``) of a stable sort of ``n`` random int64 keys, and of a gather of
    ``n`` lengths at random positions of a 10^7-sample length array. Planning CPU scales with
    both, so CPU figures of runs on different machines compare through them. Also which sort
    the planners take for keys in runs
    (:func:`~energon_ordering.planned.sort_order.runs_sort_kind`, timed once per process: here,
    outside the plans' CPU)."""
    import numpy as np  # the helpers above do not need it

    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**40, n)
    lengths = rng.integers(16, 8192, 10_000_000, dtype=np.int32)  # no int64 temporary
    at = rng.integers(0, len(lengths), n)
    sort_s = gather_s = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        np.sort(keys, kind="stable")
        t1 = time.process_time()
        np.take(lengths, at)
        t2 = time.process_time()
        sort_s, gather_s = min(sort_s, t1 - t0), min(gather_s, t2 - t1)
    # decided once per process (a few ms of timing): decided here, before any plan is timed
    from energon_ordering.planned.sort_order import runs_sort_kind

    runs = "stable" if runs_sort_kind() == "stable" else "vectorised default"
    return (f"this machine: a stable sort of {n:,} int64 keys takes {1e3 * sort_s:.1f} ms CPU, "
            f"a random gather of {n:,} lengths {1e3 * gather_s:.1f} ms (CPU figures of other "
            f"machines compare through these); the planners sort keys in runs by numpy's {runs} "
            "sort")


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``, ``nan`` for a zero denominator."""
    return numerator / denominator if denominator else float("nan")


def load_dependent(what: str, ok: bool, detail: str) -> None:
    """Reports a figure that depends on the machine's load against its expectation; never fails.

    Prints ``load-dependent: <what>: <detail> (as expected | outside the expectation) (not a
    failure)``.
    """
    verdict = "as expected" if ok else "outside the expectation"
    print(f"load-dependent: {what}: {detail}, {verdict} (not a failure)", flush=True)


def check(what: str, ok: bool, detail: str) -> bool:
    """A check that does not depend on load (idle, padding, exactness): prints ``check: ...
    ok`` or ``check FAILED: ...`` and remembers a failure for :func:`finish`. Returns ``ok``."""
    if ok:
        print(f"check: {what}: {detail}: ok", flush=True)
    else:
        _FAILURES.append(f"{what}: {detail}")
        print(f"check FAILED: {what}: {detail}", flush=True)
    return ok


def failures() -> list[str]:
    """The failed checks so far, in order."""
    return list(_FAILURES)


def finish(clock: Clock) -> None:
    """Prints the run's total CPU (this process and its reaped children) and wall time; exits 1
    if any :func:`check` failed."""
    clock.stop()
    print(f"\n(total: {clock.text()}; CPU = this process and its loader workers)", flush=True)
    if _FAILURES:
        print(f"{len(_FAILURES)} check(s) failed: " + "; ".join(_FAILURES), flush=True)
        sys.exit(1)


#: What the idle and padding figures printed by :func:`lost_compute_figures` mean.
LOST_COMPUTE_DEFINITION = (
    "idle per micro-batch = mean over micro-batches of 1 - mean/max of the ranks' costs "
    "sum(L + L^2/4096) (ranks wait at every micro-batch); idle per optimizer step = the same of "
    "each rank's cost summed over M consecutive micro-batches (what the gradient all-reduce of "
    "pure data parallelism waits on); padding by tokens = sum(B max L - sum L) / sum(B max L) "
    "over the micro-batches (energon_ordering.inspect.lost_compute)")


def lost_compute_figures(step_lengths: Sequence[Sequence[Sequence[float]]],
                         micro_batches_per_step: int) -> dict[str, float]:
    """Idle per micro-batch, idle per optimizer step and padding by tokens of a run.

    Args:
        step_lengths: ``[micro-batch index][rank]`` -> that rank's sample lengths (as
            ``rank_simulation.lengths_by_step`` gives them; a packed micro-batch: its documents'
            lengths). Ragged micro-batches are padded with empty slots (length 0).
        micro_batches_per_step: M; the micro-batches are cut into optimizer steps of M
            consecutive ones per rank (a trailing partial step is left out of the per-step idle).

    Returns:
        ``{"idle_micro_batch", "idle_step", "padding_tokens"}`` as fractions, and ``"steps"``,
        the optimizer steps the per-step idle averages over.
    """
    import numpy as np

    from energon_ordering.inspect.lost_compute import (
        idle_per_micro_batch,
        idle_per_step,
        micro_batch_costs,
        padding_by_tokens,
    )

    n, ranks = len(step_lengths), len(step_lengths[0])
    width = max(len(b) for step in step_lengths for b in step)
    lengths = np.zeros((n, ranks, width))
    for s, step in enumerate(step_lengths):
        for r, batch in enumerate(step):
            lengths[s, r, :len(batch)] = batch
    costs = micro_batch_costs(lengths)  # [n, R]
    m = micro_batches_per_step
    steps = n // m
    per_step = (idle_per_step(costs[:steps * m].reshape(steps, m, ranks).transpose(0, 2, 1))
                if steps else float("nan"))
    return {"idle_micro_batch": idle_per_micro_batch(costs[:, :, None]), "idle_step": per_step,
            "padding_tokens": padding_by_tokens(lengths), "optimizer_steps": steps}


#: Loader keywords of every benchmark loader: Energon's watchdog stays on (its per-batch cost is
#: part of a training loader's), with a timeout no loaded machine reaches; at its default 60 s
#: a slow fill on a shared machine dumps every thread's stack into the benchmark's output.
WATCHDOG: dict[str, float] = {"watchdog_timeout_seconds": 3600.0}


@contextmanager
def one_time(what: str) -> Iterator[Clock]:
    """Times a step a later run with the same ``--out`` skips (writing the dataset, building its
    length index) and prints ``(one-time: <what>: CPU .. s, wall .. s; reused by later runs)``,
    so that the run's total can be read with and without it."""
    with timed() as clock:
        yield clock
    print(f"(one-time: {what}: {clock.text()}; reused by later runs)", flush=True)
