"""The processes of a distributed length index build: rendezvous, progress and the merge's barrier.

A build runs on ``torch.distributed`` with the gloo backend (no GPU): the command line joins the
rendezvous its launcher names (:mod:`.launcher`, :func:`join`), a training script's already
initialised process group is used as it is (:meth:`Coordinator.current`). The processes share
a key-value store (torch's ``TCPStore``) for what a collective would make wait: each process
adds the samples it measured to a shared counter (rank 0 draws the combined progress bar from
it) and says when its part is written or that it failed; rank 0 merges once every part is
written, then tells the others the outcome. A process waits by polling the store, so a build
of hours never meets a collective's timeout; a build where no process made progress for
``stall_timeout`` seconds (a process lost without its launcher ending the others) fails in one
line, and its finished parts are reused by the rerun.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from energon_ordering.errors import LengthIndexError, show
from energon_ordering.length_index.launcher import Launch

__all__ = ["Coordinator", "join", "joined"]

#: Seconds between polls of the store while a process waits.
POLL = 0.2
#: Seconds between two progress updates a process sends to the store.
PUBLISH = 0.5
#: Seconds the process serving the store waits, at its end, for the others to leave it.
LEAVE_TIMEOUT = 60.0


@dataclass
class Coordinator:
    """This process's view of a build: its rank, the world size and the shared store.

    A one-process build has no store (``store`` None) and never waits. ``serves_store``: this
    process hosts the store (rank 0 of a build srun started: no torchrun agent holds it), so
    the store ends with it (:meth:`leave`).
    """

    rank: int = 0
    world_size: int = 1
    store: Any = None
    stall_timeout: float = 1800.0
    serves_store: bool = False
    _pending: int = field(default=0, repr=False)
    _published: float = field(default=0.0, repr=False)
    _store_lost: BaseException | None = field(default=None, repr=False)

    @classmethod
    def current(cls, stall_timeout: float = 1800.0) -> Coordinator:
        """The build's processes as ``torch.distributed`` has them: all ranks of its default
        group when it is initialised with more than one (every rank must call this), else
        this process alone."""
        import sys

        if "torch" not in sys.modules:
            return cls()
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        group = dist.new_group(backend="gloo")  # the default group may be NCCL's
        run = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(run, src=0, group=group)
        dist.destroy_process_group(group)
        store = dist.PrefixStore(f"energon_ordering_index/{run[0]}/",
                                 dist.distributed_c10d._get_default_store())
        return cls(dist.get_rank(), dist.get_world_size(), store, stall_timeout)

    @property
    def distributed(self) -> bool:
        return self.store is not None

    # -- progress ------------------------------------------------------------------------------

    def progress(self, tag: str, n: int, *, force: bool = False) -> None:
        """Adds ``n`` measured samples to the shared counter of ``tag`` (sent every
        :data:`PUBLISH` seconds, or now with ``force``)."""
        if self.store is None:
            return
        self._pending += n
        now = time.monotonic()
        if self._store_lost is None and (force or now - self._published >= PUBLISH):
            try:
                self.store.add(f"{tag}/progress", self._pending)
                self.store.add("beat", 1)
            except Exception as e:  # noqa: BLE001 - rank 0 (serving the store) failed: the
                self._store_lost = e  # part is finished all the same, for the rerun to reuse
            self._pending, self._published = 0, now

    def measured(self, tag: str) -> int:
        """Samples of ``tag`` every process measured so far (as sent)."""
        return int(self.store.add(f"{tag}/progress", 0)) if self.store is not None else 0

    # -- the merge's barrier -------------------------------------------------------------------

    def part_done(self, tag: str) -> None:
        """Says that this process's part of ``tag`` is written."""
        if self.store is not None:
            self.progress(tag, 0, force=True)
            if self._store_lost is not None:
                raise self._lost()
            self.store.add(f"{tag}/done", 1)

    def failed(self, message: str) -> None:
        """Tells every process that this one failed (they stop waiting and fail too)."""
        if self.store is not None:
            with contextlib.suppress(Exception):  # the store may be gone with rank 0
                if not self.store.check(["failed"]):  # the first failure is the cause
                    self.store.set("failed", f"rank {self.rank}: {message}")

    def wait_parts(self, tag: str, tick: Callable[[], None] | None = None) -> None:
        """Rank 0: waits until every process wrote its part of ``tag``."""
        self._wait(lambda: int(self.store.add(f"{tag}/done", 0)) >= self.world_size, tick)

    def merged(self, tag: str, error: str | None) -> None:
        """Rank 0: tells the others the merge of ``tag`` is done (``error``: it failed)."""
        if self.store is not None:
            self.store.set(f"{tag}/result", "ok" if error is None else f"error {error}")

    def wait_merged(self, tag: str) -> None:
        """Ranks > 0: waits for rank 0's merge of ``tag``; raises its error if it failed."""
        self._wait(lambda: self.store.check([f"{tag}/result"]), None)
        result = self.store.get(f"{tag}/result").decode()
        if result != "ok":
            raise LengthIndexError(
                f"length index: rank 0 failed to merge the parts: {result.removeprefix('error ')}"
            )

    def heartbeat(self) -> None:
        """Says this process is alive (rank 0 while it merges)."""
        if self.store is not None:
            self.store.add("beat", 1)

    def leave(self) -> None:
        """Ends this process's use of the store: the others say so, and the process serving it
        waits until they all did (at most :data:`LEAVE_TIMEOUT` seconds), since a process still
        reading the store (rank 0's merge result) would fail once it is gone."""
        if self.store is None:
            return
        if not self.serves_store:
            with contextlib.suppress(Exception):  # the store may be gone with rank 0
                self.store.add("left", 1)
            return
        deadline = time.monotonic() + LEAVE_TIMEOUT
        while (int(self.store.add("left", 0)) < self.world_size - 1
               and time.monotonic() < deadline):
            time.sleep(POLL / 4)

    def _lost(self) -> LengthIndexError:
        """The one-line error of a process whose store (served by rank 0) is gone."""
        return LengthIndexError(
            f"length index: rank 0, which serves the build's store, is gone "
            f"({type(self._store_lost).__name__}: {_first_line(self._store_lost)}); its own "
            "error says why: fix that and run the build again: this process's finished part "
            "is reused."
        )

    def _wait(self, ready: Callable[[], bool], tick: Callable[[], None] | None) -> None:
        if self.store is None:
            return
        last, since = -1, time.monotonic()
        while not self._store_answers(ready):
            if self.store.check(["failed"]):
                raise LengthIndexError(
                    f"length index: another process failed ({self.store.get('failed').decode()}); "
                    "fix that and run the build again: finished parts are reused."
                )
            beat = int(self.store.add("beat", 0))
            if beat != last:
                last, since = beat, time.monotonic()
            elif time.monotonic() - since > self.stall_timeout:
                raise LengthIndexError(
                    f"length index: no process of the build made progress for "
                    f"{self.stall_timeout:g} s (a process was lost?); run the build again: "
                    "finished parts are reused (or raise --stall-timeout)."
                )
            if tick is not None:
                tick()
            time.sleep(POLL)

    def _store_answers(self, ready: Callable[[], bool]) -> bool:
        try:
            return ready()
        except Exception as e:  # noqa: BLE001 - the store is gone: one line, not a C++ stack
            self._store_lost = e
            raise self._lost() from None


def join(launch: Launch, timeout: float, stall_timeout: float = 1800.0) -> Coordinator:
    """Joins the rendezvous of ``launch`` and initialises ``torch.distributed`` (gloo).

    Every process says its world size; processes that disagree fail in one line.

    Args:
        timeout: Seconds to wait for every process to join (``--rendezvous-timeout``).

    Raises:
        LengthIndexError: The rendezvous cannot form within ``timeout`` or the processes
            disagree on the world size.
    """
    import torch.distributed as dist

    where = f"{launch.host}:{launch.port}"
    fix = (f"start all {launch.world_size} processes with the same launcher arguments, check "
           f"that rank 0's host {launch.host} is reachable on port {launch.port} (and the port "
           "free), or raise --rendezvous-timeout")
    try:
        with _native_stderr_silenced():  # torch logs each failed try with a C++ stack trace
            base = dist.TCPStore(launch.host, launch.port,
                                 is_master=launch.rank == 0 and not launch.agent_store,
                                 timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, OSError, TimeoutError) as e:
        raise LengthIndexError(
            f"length index: the rendezvous at {where} could not form within {timeout:g} s "
            f"({type(e).__name__}: {_first_line(e)}); {fix}."
        ) from None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"energon_ordering_index/{restart}/", base)
    _agree(store, launch, timeout, where, fix)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=launch.rank,
                            world_size=launch.world_size,
                            timeout=timedelta(seconds=max(timeout, stall_timeout)))
    return Coordinator(launch.rank, launch.world_size, dist.PrefixStore("build/", store),
                       stall_timeout, serves_store=launch.rank == 0 and not launch.agent_store)


def _agree(store: Any, launch: Launch, timeout: float, where: str, fix: str) -> None:
    """Waits until ``launch.world_size`` processes joined, each saying the same world size."""
    store.set(f"world/{launch.rank}", str(launch.world_size))
    store.add("joined", 1)
    deadline = time.monotonic() + timeout
    while True:
        joined = int(store.add("joined", 0))
        for rank in range(launch.world_size):
            if store.check([f"world/{rank}"]):
                theirs = int(store.get(f"world/{rank}").decode())
                if theirs != launch.world_size:
                    _disagree(launch, rank, theirs)
        if joined > launch.world_size:
            _disagree(launch, None, joined)
        if joined == launch.world_size and all(
                store.check([f"world/{r}"]) for r in range(launch.world_size)):
            return
        if time.monotonic() > deadline:
            raise LengthIndexError(
                f"length index: the rendezvous at {where} could not form within "
                f"{timeout:g} s: {joined} of {launch.world_size} processes joined; {fix}."
            )
        time.sleep(POLL)


def _disagree(launch: Launch, rank: int | None, theirs: int) -> None:
    said = (f"rank {rank} says {theirs}" if rank is not None
            else f"{theirs} processes joined")
    raise LengthIndexError(
        f"length index: the processes disagree on the world size: this one (rank {launch.rank}) "
        f"says {launch.world_size} ({launch.launcher}), {said}; start every process with the "
        "same launcher arguments (torchrun --nnodes/--nproc-per-node, srun --ntasks)."
    )


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null (what native code writes there: the error that ends the
    attempt is reported in one line instead)."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _first_line(e: BaseException) -> str:
    return show(str(e).strip().splitlines()[0] if str(e).strip() else "", 160)


@contextlib.contextmanager
def joined(launch: Launch | None, timeout: float,
           stall_timeout: float = 1800.0) -> Iterator[Coordinator]:
    """:func:`join` (or this process alone for None), ending ``torch.distributed`` after."""
    if launch is None:
        yield Coordinator.current(stall_timeout)
        return
    coord = join(launch, timeout, stall_timeout)
    try:
        yield coord
    finally:
        coord.leave()
        import gc

        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        gc.collect()
