"""Window plans shared by the processes of a node: one process plans a window, the others map it.

Every rank and loader worker of a planned run computes the same plan of each window (a pure
function of global inputs), and a rank's share of it is 1/R: at 1,024 ranks a window of 32
steps is about 10^6 samples and 0.2 s of CPU, the same in each of a node's 8 ranks x 2 loader
workers. :class:`SharedPlans` keeps each window's plan (its ``[K, R, M, B]`` global ids) in a
file of a node-local folder, named after a digest of every input of the plan; the first process
that needs it takes a lock file, plans and writes it (to a temporary name, then renamed), and
the others wait for the file and map it. Identical inputs give identical plans, so a file is
never wrong for its name, whichever job or process wrote it.

The folder is ``$ENERGON_ORDERING_PLAN_DIR`` if set (``off``: no sharing), else
``/dev/shm/energon_ordering_plans`` (memory, per node), else the temporary folder. A writer
removes the stream's plans of windows three or more behind the one it wrote, so a stream holds
at most three windows there (8 MiB each at 1,024 ranks, M = 8, B = 4). When the folder cannot
be written, or a lock's holder died or took longer than ``wait_s``, a process plans the window
itself (one log line): sharing saves time and never changes an order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from energon_ordering.length_index.index import process_alive
from energon_ordering.length_index.lengths_file import save_atomically

__all__ = ["SharedPlans", "plan_dir", "stream_digest"]

logger = logging.getLogger(__name__)

#: The environment variable that names the folder (``off``: no sharing).
PLAN_DIR_ENV = "ENERGON_ORDERING_PLAN_DIR"

#: Windows kept per stream (the newest written and the two before it).
KEEP_WINDOWS = 3

#: Folders whose failure to share was logged (once per process: a stream makes one
#: :class:`SharedPlans` per window).
_LOGGED: set[str] = set()


def plan_dir() -> Path | None:
    """The node-local folder of shared plans (see the module docstring); None: no sharing."""
    chosen = os.environ.get(PLAN_DIR_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "none") else Path(chosen)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "energon_ordering_plans"


def stream_digest(*parts: Any) -> str:
    """A digest of JSON-able ``parts`` (what a plan depends on)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


class SharedPlans:
    """Plans of one stream's windows, shared through files (see the module docstring).

    Args:
        folder: Where the files go; None: no sharing (every call plans).
        stream: :func:`stream_digest` of everything the plans depend on except the window's
            cursor (lengths, seed, shape, plan version).
        wait_s: How long to wait for another process's plan before planning here.
    """

    def __init__(self, folder: Path | None, stream: str, wait_s: float = 120.0):
        self.folder = None if folder is None else Path(folder)
        self.stream = stream
        self.wait_s = float(wait_s)

    def _off(self, why: str) -> None:
        if str(self.folder) not in _LOGGED:
            logger.info("planned order: plans are not shared through %s (%s); each process "
                        "plans its windows itself", self.folder, why)
            _LOGGED.add(str(self.folder))

    def ids(self, window: int, inputs: str, shape: tuple[int, ...],
            plan: Callable[[], np.ndarray]) -> np.ndarray:
        """The ids ``[K, R, M, B]`` (int64) of window ``window``: mapped from the shared file
        if another process planned it, else ``plan()`` (and written for the others).

        Args:
            window: The window's index (names the file, for clean-up).
            inputs: :func:`stream_digest` of the window's own inputs (its cursor and weights).
            shape: The plan's expected shape (a file of another shape is not used; -1: any
                length on that axis).
            plan: Computes the plan's ids.
        """
        if self.folder is None:
            return plan()
        path = self.folder / f"plan-{self.stream}-{int(window):09d}-{inputs}.npy"
        lock = path.with_name(path.name + ".lock")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._off(str(e))
            return plan()
        deadline = time.monotonic() + self.wait_s
        while True:
            found = self._load(path, shape)
            if found is not None:
                return found
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._stale(lock):  # its holder died: take it over
                    continue
                if time.monotonic() > deadline:
                    self._off(f"the lock {lock.name} was held over {self.wait_s:.0f} s")
                    return plan()
                time.sleep(0.005)
                continue
            except OSError as e:
                self._off(str(e))
                return plan()
            try:
                os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
                os.close(fd)
                ids = np.ascontiguousarray(plan(), dtype=np.int64)
                self._write(path, ids)
                self._clean(window)
                return ids
            finally:
                try:
                    lock.unlink()
                except OSError:
                    pass

    @staticmethod
    def _load(path: Path, shape: tuple[int, ...]) -> np.ndarray | None:
        try:
            ids = np.load(path, mmap_mode="r")
        except (OSError, ValueError):
            return None
        if (ids.dtype != np.int64 or ids.ndim != len(shape)
                or any(want not in (-1, got) for want, got in zip(shape, ids.shape))):
            return None
        return ids

    def _write(self, path: Path, ids: np.ndarray) -> None:
        error = save_atomically(path, ids)
        if error is not None:
            self._off(str(error))

    @staticmethod
    def _stale(lock: Path) -> bool:
        """True if ``lock`` was taken by a process of this host that no longer runs."""
        try:
            host, pid = lock.read_text().split()
        except (OSError, ValueError):
            return False  # gone, or being written: look again
        if host != socket.gethostname() or process_alive(int(pid)):
            return False
        try:
            lock.unlink()
        except OSError:
            pass
        return True

    def _clean(self, window: int) -> None:
        """Removes this stream's plans of windows ``KEEP_WINDOWS`` or more behind ``window``."""
        try:
            for old in self.folder.glob(f"plan-{self.stream}-*.npy"):
                w = int(old.name.split("-")[2])
                if w <= window - KEEP_WINDOWS:
                    old.unlink(missing_ok=True)
        except (OSError, ValueError, IndexError):
            pass
