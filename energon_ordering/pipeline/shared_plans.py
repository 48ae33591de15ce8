"""Window plans shared by the processes of a node: one process plans a window, the others map it.

Every rank and loader worker of a planned run computes the same plan of each window (a pure
function of global inputs), and a rank's share of it is 1/R: at 1,024 ranks a window of 32
steps is about 10^6 samples and 0.2 s of CPU, the same in each of a node's 8 ranks x 2 loader
workers. :class:`SharedPlans` keeps each window's plan (its ``[K, R, M, B]`` global ids) in a
file of a node-local folder, named after a digest of every input of the plan; the first process
that needs it takes a lock file, plans and writes it (to a temporary name, then renamed), and
the others wait for the file and map it. Identical inputs give identical plans, so a file is
never wrong for its name, whichever process of the user wrote it.

What is shared is the user's alone (DESIGN.md, contract 14). The folder is
``$ENERGON_ORDERING_PLAN_DIR`` if set (``off``: no sharing), else
``/dev/shm/energon_ordering_plans-<uid>`` (memory, per node and user), else the same name in
the temporary folder. It is created with mode 0700, and lock and plan files with 0600. A folder
that is a symbolic link, is owned by another user, or that the group or others may write is not
used (:func:`folder_refusal`; one log line per folder and process): another user could plant
plans there, and choose which samples a run trains on. A mapped plan is checked before use
(the caller's ``expected`` draws or ``check``, :mod:`energon_ordering.planned.plan_check`: every
id a sample, the window's draws exactly, each once as drawn): a file that fails is not used
(one log line naming it and why), removed, and the window planned here and written anew.

Clean-up: a writer removes the stream's plans of windows three or more behind the one it wrote,
so a stream holds at most three windows there (8 MiB each at 1,024 ranks, M = 8, B = 4), and
any plan, lock or temporary file in the folder older than a day (:data:`MAX_AGE_S`: runs that
ended or crashed); :func:`forget_stream` removes a stream's plans when its loader closes or its
epoch ends. When the folder cannot be used or written (its file system full, too), or a
lock's holder died (also between making the lock and writing itself into it:
:data:`UNWRITTEN_LOCK_S`) or took longer than ``wait_s``, a process plans the window itself (one
log line): sharing saves time and never changes an order. The planned source names its plans
after its lengths' content as it mapped them, read once per process, so a lengths file deleted
or replaced while a run goes on changes neither its order nor the plans it shares.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from energon_ordering.length_index.index import process_alive
from energon_ordering.length_index.lengths_file import save_atomically
from energon_ordering.planned.plan_check import ids_out_of_range, plan_matches_draws

__all__ = ["SharedPlans", "folder_refusal", "forget_stream", "plan_dir", "stream_digest"]

logger = logging.getLogger(__name__)

#: The environment variable that names the folder (``off``: no sharing).
PLAN_DIR_ENV = "ENERGON_ORDERING_PLAN_DIR"

#: Seconds after which a lock file that names no holder is taken as left by a process that
#: died between making it and writing its host and pid (a holder writes them at once).
UNWRITTEN_LOCK_S = 10.0
#: Windows kept per stream (the newest written and the two before it).
KEEP_WINDOWS = 3

#: Plans, locks and temporary files older than this (seconds) are removed by the next writer.
MAX_AGE_S = 24 * 3600

#: Permission bits of the folder this module creates, and of its lock and plan files.
FOLDER_MODE, FILE_MODE = 0o700, 0o600

#: The names this module gives files (a plan, its lock, a plan being written): the only files
#: of a folder it removes (a folder named by the user may hold others).
_OURS = re.compile(r"plan-[^/]+\.npy(\.lock|\.tmp-[^/]+)?")

#: Folders whose failure to share was logged (once per process: a stream makes one
#: :class:`SharedPlans` per window).
_LOGGED: set[str] = set()


def plan_dir() -> Path | None:
    """The node-local folder of this user's shared plans (see the module docstring); None: no
    sharing."""
    chosen = os.environ.get(PLAN_DIR_ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "none") else Path(chosen)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"energon_ordering_plans-{os.getuid()}"


def folder_refusal(folder: Path, create: bool = True) -> str | None:
    """Why ``folder`` must not hold this user's plans, or None: it is a folder of this user
    that only this user may write.

    Args:
        folder: The folder (:func:`plan_dir`).
        create: Create it (mode 0700, and any missing parent) if it does not exist.
    """
    folder = Path(folder)
    try:
        if create:
            folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        st = os.lstat(folder)
    except OSError as e:
        return str(e)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link; name the folder itself"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return (f"its mode {stat.S_IMODE(st.st_mode):04o} lets other users write it; "
                f"`chmod 700 {folder}`")
    return None


def forget_stream(folder: Path | None, stream: str) -> int:
    """Removes the plans of ``stream`` from ``folder`` (its loader closed, or its epoch ended);
    other processes of the stream that still need one plan it again. Returns how many files
    were removed (none from a folder :func:`folder_refusal` refuses; locks are left to their
    holders, and to the day-old sweep)."""
    if folder is None or folder_refusal(folder, create=False) is not None:
        return 0
    prefix = f"plan-{stream}-"
    removed = 0
    try:
        for entry in os.scandir(folder):
            if entry.name.startswith(prefix) and entry.name.endswith(".npy"):
                try:
                    os.unlink(entry.path)
                    removed += 1
                except OSError:
                    pass
    except OSError:
        pass
    return removed


def stream_digest(*parts: Any) -> str:
    """A digest of JSON-able ``parts`` (what a plan depends on)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


class SharedPlans:
    """Plans of one stream's windows, shared through files (see the module docstring).

    Args:
        folder: Where the files go; None: no sharing (every call plans).
        stream: :func:`stream_digest` of everything the plans depend on except the window's
            cursor (the lengths' content digests, seed, shape, plan version).
        wait_s: How long to wait for another process's plan before planning here.
        total: Samples of all sources: a mapped plan of ids (without ``check``) must hold ids
            in ``[0, total)`` only (None: not checked apart from ``expected``).
    """

    def __init__(self, folder: Path | None, stream: str, wait_s: float = 120.0,
                 total: int | None = None):
        self.folder = None if folder is None else Path(folder)
        self.stream = stream
        self.wait_s = float(wait_s)
        self.total = None if total is None else int(total)

    def _off(self, why: str, level: int = logging.INFO) -> None:
        if str(self.folder) not in _LOGGED:
            logger.log(level, "planned order: plans are not shared through %s (%s); each "
                       "process plans its windows itself", self.folder, why)
            _LOGGED.add(str(self.folder))

    def forget(self) -> int:
        """:func:`forget_stream` of this stream."""
        return forget_stream(self.folder, self.stream)

    def ids(self, window: int, inputs: str, shape: tuple[int, ...],
            plan: Callable[[], np.ndarray],
            expected: Callable[[], np.ndarray] | None = None,
            check: Callable[[np.ndarray], str | None] | None = None) -> np.ndarray:
        """The ids ``[K, R, M, B]`` (int64) of window ``window``: mapped from the shared file
        if another process planned it and it passes the checks, else ``plan()`` (and written
        for the others).

        Args:
            window: The window's index (names the file, for clean-up).
            inputs: :func:`stream_digest` of the window's own inputs (its cursor and weights).
            shape: The plan's expected shape (a file of another shape is not used; -1: any
                length on that axis).
            plan: Computes the plan's ids.
            expected: The window's draws (global ids, any order;
                :func:`~energon_ordering.planned.window.window_draws`): a mapped file must hold
                exactly these (:func:`~energon_ordering.planned.plan_check.plan_matches_draws`).
                Called only when a file is mapped. None: only the shape and range are checked.
            check: Why a mapped file is not the window's plan, or None, for a plan whose file
                holds more than ids (e.g. a packed plan:
                :func:`~energon_ordering.planned.plan_check.packed_plan_matches_inputs`); it
                replaces ``expected`` and ``total``.
        """
        if self.folder is None:
            return plan()
        refused = folder_refusal(self.folder)
        if refused is not None:
            self._off(refused, logging.WARNING)
            return plan()
        path = self.folder / f"plan-{self.stream}-{int(window):09d}-{inputs}.npy"
        lock = path.with_name(path.name + ".lock")
        deadline = time.monotonic() + self.wait_s
        while True:
            found = self._load(path, shape)
            if found is not None:
                why = self._problem(found, expected, check)
                if why is None:
                    return found
                self._reject(path, why)
                return self._plan_here(path, window, plan)
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW,
                             FILE_MODE)
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
                try:
                    os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
                finally:
                    os.close(fd)
            except OSError as e:  # e.g. the folder's file system is full (/dev/shm)
                _unlink(lock)
                self._off(str(e))
                return plan()
            try:
                return self._plan_here(path, window, plan)
            finally:
                _unlink(lock)

    def _plan_here(self, path: Path, window: int, plan: Callable[[], np.ndarray]) -> np.ndarray:
        """Plans the window, writes it for the others and cleans the folder up."""
        ids = np.ascontiguousarray(plan(), dtype=np.int64)
        self._write(path, ids)
        self._clean(window)
        return ids

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

    def _problem(self, ids: np.ndarray, expected: Callable[[], np.ndarray] | None,
                 check: Callable[[np.ndarray], str | None] | None) -> str | None:
        """Why the mapped ``ids`` must not be used, or None: ``check`` judges alone (a plan
        of its own layout), else the ids must be ``expected()`` and in range."""
        if check is not None:
            return check(ids)
        if expected is not None:
            return plan_matches_draws(ids, expected(), self.total)
        return None if self.total is None else ids_out_of_range(ids, self.total)

    @staticmethod
    def _reject(path: Path, why: str) -> None:
        """Logs that ``path`` is not used, and removes it if it is this user's."""
        logger.warning("planned order: the shared plan %s is not used (%s); this process plans "
                       "the window and writes it anew", path, why)
        try:
            if os.lstat(path).st_uid == os.getuid():
                path.unlink()
        except OSError:
            pass

    def _write(self, path: Path, ids: np.ndarray) -> None:
        error = save_atomically(path, ids, mode=FILE_MODE)
        if error is not None:
            self._off(str(error))

    @staticmethod
    def _stale(lock: Path) -> bool:
        """True if ``lock`` was taken by a process of this host that no longer runs, or holds
        no holder :data:`UNWRITTEN_LOCK_S` after it was made (its maker died between making
        and writing it)."""
        try:
            host, pid = lock.read_text().split()
        except (OSError, ValueError):
            try:  # gone, or being written: look again, unless it stayed unwritten
                unwritten = time.time() - os.lstat(lock).st_mtime > UNWRITTEN_LOCK_S
            except OSError:
                return False
            if unwritten:
                _unlink(lock)
            return unwritten
        if host != socket.gethostname() or process_alive(int(pid)):
            return False
        _unlink(lock)
        return True

    def _clean(self, window: int) -> None:
        """Removes this stream's plans of windows ``KEEP_WINDOWS`` or more behind ``window``,
        and any stream's plans, locks and temporary files older than :data:`MAX_AGE_S`."""
        prefix = f"plan-{self.stream}-"
        old = time.time() - MAX_AGE_S
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return
        for entry in entries:
            name = entry.name
            if not _OURS.fullmatch(name):
                continue
            try:
                behind = (name.startswith(prefix) and name.endswith(".npy")
                          and int(name[len(prefix):len(prefix) + 9]) <= window - KEEP_WINDOWS)
                if behind or entry.stat(follow_symlinks=False).st_mtime < old:
                    os.unlink(entry.path)
            except (OSError, ValueError):
                pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
