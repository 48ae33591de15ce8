"""The length index: {sample key -> length in tokens} stored next to a prepared dataset.

A pool placed before encoding (``length_sort_placement = "pre-encode"``) must know each sample's
length without decoding it. The index is built once per prepared dataset (``energon-ordering
index DATASET`` or ``tools/build_length_index.py``) by running the user's task encoder, or a
length function on the raw sample, over every sample; the pool then looks lengths up by key.

Storage: ``<dataset>/.nv-meta/energon_ordering_lengths.<name>.sqlite`` (sqlite, like Energon's
own ``index.sqlite``), one file per length function side by side, ``<name>`` saying what computed
the lengths (:func:`index_name`; a build without a name writes the unnamed
``energon_ordering_lengths.sqlite``). With ``index_dir`` (a read-only dataset) the files live in
``<index_dir>/<index.uuid>/`` instead. A ``meta`` table holds the index version, the dataset's
``index.uuid`` at build time, what computed the lengths and a digest of the content.
``energon prepare`` writes a new ``index.uuid`` whenever it re-indexes the data, so a stale
length index is detected and refused; a corrupt file is refused when opened (sqlite
``quick_check``), a file replaced while a job reads it is refused when a loader worker opens
it, and one damaged after that fails its next lookup with a :class:`LengthIndexError` naming it.
Lookups open the file read-only (from any folder name, see :mod:`energon_ordering.sqlite_file`),
lazily, once per process (loader workers fork).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import numbers
import os
import re
import socket
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from energon_ordering.errors import LengthIndexError, show
from energon_ordering.sqlite_file import connect_readonly

__all__ = [
    "INDEX_FILE",
    "INDEX_VERSION",
    "LengthIndex",
    "check_index_name",
    "dataset_uuid",
    "index_path",
    "index_name",
    "length_index_files",
    "local_dataset_path",
    "task_encoder_label",
    "write_length_index",
]

#: File name of the index, inside the dataset's ``.nv-meta`` folder.
INDEX_FILE = "energon_ordering_lengths.sqlite"
#: Version of the index layout; an index of another version is refused.
INDEX_VERSION = 1


def task_encoder_label(task_encoder: Any) -> str:
    """How an index records that a task encoder computed its lengths (``computed_by``)."""
    cls = type(task_encoder)
    return f"task encoder {cls.__module__}.{cls.__qualname__}"


def local_dataset_path(path: Any) -> Path:
    """A prepared dataset's folder as a local path (Energon ``EPath`` or path-like)."""
    if hasattr(path, "is_local"):
        if not path.is_local():
            raise LengthIndexError(
                f"length index: dataset {path} is not on a local file system; the length index "
                "is a local sqlite file. Use length_sort_placement = 'post-encode' for it."
            )
        return Path(path.local_path())
    return Path(path)


def index_name(computed_by: str) -> str:
    """The file-name part that says what computed an index: ``"task encoder pkg.mod.Enc"`` ->
    ``"pkg.mod.Enc"``, ``"raw_length_fn pkg.mod.fn"`` -> ``"pkg.mod.fn"``."""
    for prefix in ("task encoder ", "raw_length_fn "):
        if computed_by.startswith(prefix):
            computed_by = computed_by[len(prefix):]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", computed_by).strip("._") or "lengths"


def _index_folder(dataset: Any, index_dir: str | Path | None) -> Path:
    if index_dir is None:
        return local_dataset_path(dataset) / ".nv-meta"
    return Path(index_dir) / dataset_uuid(dataset)


#: A length index's name: a plain part of its file's name (no folder, no leading dot).
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def check_index_name(name: str | None, what: str = "build_length_index: name") -> None:
    """Raises :class:`LengthIndexError` unless ``name`` (None: the default name) is a plain
    name: it becomes part of the index's file name, and ``../x`` or ``a/b`` would write the
    index outside its folder. ``what`` names the argument (``--name`` on the command line)."""
    if name is not None and (not isinstance(name, str) or not _PLAIN_NAME.fullmatch(name)):
        raise LengthIndexError(
            f"{what} {show(name)} is not a plain name: it becomes part of the index's file name "
            "(energon_ordering_lengths.<name>.sqlite), so use only letters, digits, '.', '_' and "
            "'-', not starting with '.' (e.g. my_encoder)."
        )


def index_path(dataset: Any, name: str | None = None, index_dir: str | Path | None = None) -> Path:
    """Where the length index ``name`` (None: the unnamed one) of a prepared dataset lives."""
    file = INDEX_FILE if name is None else INDEX_FILE.replace(".sqlite", f".{name}.sqlite")
    return _index_folder(dataset, index_dir) / file


def length_index_files(dataset: Any, index_dir: str | Path | None = None) -> dict[str | None, Path]:
    """Every length index of ``dataset``, by name (None: the unnamed one)."""
    folder = _index_folder(dataset, index_dir)
    stem = INDEX_FILE.removesuffix(".sqlite")
    found: dict[str | None, Path] = {}
    for p in sorted(folder.glob(f"{stem}*.sqlite")) if folder.is_dir() else []:
        middle = p.name[len(stem):-len(".sqlite")]
        if middle == "":
            found[None] = p
        elif middle.startswith("."):
            found[middle[1:]] = p
    return found


def _host() -> str:
    """This machine's name as it appears in temporary file names."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", socket.gethostname()) or "host"


def _tmp_path(target: Path) -> Path:
    """The temporary file of this process's build of ``target``: ``<target>.tmp-<host>-<pid>``
    (a PID alone names no process on another machine of a shared file system, nor in another
    PID namespace)."""
    return target.with_name(f"{target.name}.tmp-{_host()}-{os.getpid()}")


def _remove_stale_tmp(folder: Path) -> None:
    """Removes temporary files that killed builds left behind, and only those: written on
    this host (the name says), by a process that is gone, and not locked (every build holds
    an ``flock`` on its temporary file; a build in another PID namespace of this host has a
    PID that looks gone from here, but holds its lock). Files of other hosts are left alone."""
    for tmp in folder.glob(f"{INDEX_FILE.removesuffix('.sqlite')}*.tmp-*"):
        host, _, pid = tmp.name.rsplit(".tmp-", 1)[-1].rpartition("-")
        if host != _host() or not pid.isdigit() or int(pid) == os.getpid() or process_alive(int(pid)):
            continue
        try:
            fd = os.open(tmp, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live build holds it
        else:
            tmp.unlink(missing_ok=True)
            tmp.with_name(f"{tmp.name}-journal").unlink(missing_ok=True)  # sqlite's, if any
        finally:
            os.close(fd)


def _locked_new_file(path: Path) -> int:
    """Creates ``path`` (empty) and returns a descriptor holding an exclusive ``flock`` on it,
    which marks the file as a live build's until the descriptor is closed."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass  # a file system without flock: the host and PID in the name still protect it
    return fd


def process_alive(pid: int) -> bool:
    """True if process ``pid`` of this host runs (or is another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dataset_uuid(dataset: Any) -> str:
    """The ``.nv-meta/index.uuid`` that ``energon prepare`` wrote for the dataset."""
    uuid_file = local_dataset_path(dataset) / ".nv-meta" / "index.uuid"
    try:
        return uuid_file.read_text().strip()
    except FileNotFoundError:
        raise LengthIndexError(
            f"length index: {uuid_file} does not exist; {local_dataset_path(dataset)} is not a "
            "dataset prepared by Energon >= 7 (run `energon prepare` on it first)."
        ) from None


def _check_length(key: str, length: Any, computed_by: str) -> float:
    """``length`` as a float, refused unless a finite number >= 0 (NaN and negative lengths
    are refused here, when an index is built, not when it is read)."""
    kind = type(length)
    if (kind is float or kind is int) and 0 <= length < math.inf:  # the common case, fast
        return float(length)
    if isinstance(length, bool) or not isinstance(length, numbers.Real) or not (
        math.isfinite(length) and length >= 0
    ):
        raise LengthIndexError(
            f"length index: the length of sample {show(key)} is {show(length)}; it must be a "
            f"finite number >= 0 (tokens): fix {computed_by}, which computed it (nothing was "
            "written)."
        )
    return float(length)


@dataclass(frozen=True)
class IndexSummary:
    """What a build wrote: the file, the dataset uuid, the number of samples and their total."""

    path: Path
    uuid: str
    samples: int
    total_tokens: float


def write_length_index(
    dataset: Any,
    lengths: Iterable[tuple[str, float]],
    *,
    computed_by: str,
    name: str | None = None,
    index_dir: str | Path | None = None,
    shards: Iterable[tuple[str, str, int]] | None = None,
) -> IndexSummary:
    """Writes the length index of ``dataset`` from ``(sample key, length)`` pairs.

    The file is written under a temporary name (``<file>.tmp-<host>-<pid>``, ``flock``-ed while
    the build runs) and renamed, so a crash never leaves a partial index behind; temporary files
    of killed builds on this host are removed, a live build's never (see
    :func:`_remove_stale_tmp`). A key seen twice is an error (the pool could not tell the two
    apart).

    Args:
        dataset: The prepared dataset folder.
        lengths: ``(sample __key__, length in tokens)`` for every sample.
        computed_by: What computed the lengths (stored, shown in errors).
        name: The index's name (see :func:`index_name`); None writes the unnamed index.
        index_dir: Write to ``<index_dir>/<index.uuid>/`` instead of ``<dataset>/.nv-meta/``
            (for a read-only dataset).
        shards: ``(name, content digest, samples)`` of the split's shards, in order, read when
            ``lengths`` is consumed (table ``shards``: what an incremental build after ``energon
            prepare`` reuses, see :mod:`energon_ordering.length_index.reuse`).
    """
    uuid = dataset_uuid(dataset)
    target = index_path(dataset, name, index_dir)
    tmp = _tmp_path(target)
    lock: int | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(target.parent)
        lock = _locked_new_file(tmp)
        con = sqlite3.connect(tmp)
        con.execute("CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
    except (OSError, sqlite3.OperationalError) as e:
        if lock is not None:
            tmp.unlink(missing_ok=True)
            os.close(lock)
        where = (
            "pass a writable --index-dir"
            if index_dir is not None
            else "is the dataset read-only? Write the index elsewhere with `energon-ordering "
            "index --index-dir DIR`"
        )
        raise LengthIndexError(
            f"length index: cannot write {target} ({e}); {where} and set "
            "OrderingConfig.length_index_dir = DIR."
        ) from e
    try:
        con.execute(
            "CREATE TABLE lengths (sample_key TEXT PRIMARY KEY, length REAL NOT NULL) WITHOUT ROWID"
        )
        count, total = 0, 0.0
        batch: list[tuple[str, float]] = []
        for key, length in lengths:
            batch.append((key, _check_length(key, length, computed_by)))
            if len(batch) >= 10_000:
                count, total = _insert(con, batch, count, total)
                batch = []
        count, total = _insert(con, batch, count, total)
        if shards is not None:
            con.execute("CREATE TABLE shards (position INTEGER PRIMARY KEY, name TEXT NOT NULL, "
                        "digest TEXT NOT NULL, samples INTEGER NOT NULL)")
            con.executemany("INSERT INTO shards VALUES (?, ?, ?, ?)",
                            [(i, *shard) for i, shard in enumerate(shards)])
        digest = content_digest(con)
        con.commit()
        counter = change_counter(tmp)
        con.executemany(
            "INSERT INTO meta VALUES (?, ?)",
            [
                ("index_version", str(INDEX_VERSION)),
                ("dataset_uuid", uuid),
                ("computed_by", computed_by),
                ("samples", str(count)),
                ("content_digest", digest),
                # what the header says after this, the file's last write (see LengthIndex.open)
                *([("file_change_counter", str(counter + 1))] if counter is not None else []),
            ],
        )
        con.commit()
    except BaseException:
        con.close()
        tmp.unlink(missing_ok=True)
        os.close(lock)
        raise
    con.close()
    tmp.replace(target)
    os.close(lock)
    return IndexSummary(target, uuid, count, total)


def content_digest(con: sqlite3.Connection) -> str:
    """SHA-256 (first 16 hex digits) of every ``(sample key, length)`` pair, in key order: two
    indexes with the same digest give the pool the same lengths. About 0.8 s per 10^6 rows.

    Raises:
        ValueError: A length is not a number (a row edited by hand).
    """
    h = hashlib.sha256()
    rows = con.execute("SELECT sample_key, length FROM lengths ORDER BY sample_key")
    while chunk := rows.fetchmany(1 << 16):
        # repr(float) is what errors.show() gives a float (short: never cut)
        h.update("".join([f"{key}\t{repr(float(length))}\n" for key, length in chunk]).encode())
    return h.hexdigest()[:16]


def change_counter(path: Path) -> int | None:
    """SQLite's file change counter (bytes 24-27 of the header): SQLite increments it at every
    write transaction of a file in rollback-journal mode (the index's). None: no header."""
    with open(path, "rb") as f:
        head = f.read(28)
    return int.from_bytes(head[24:28], "big") if len(head) == 28 else None


def _insert(
    con: sqlite3.Connection, batch: list[tuple[str, float]], count: int, total: float
) -> tuple[int, float]:
    try:
        con.executemany("INSERT INTO lengths VALUES (?, ?)", batch)
    except sqlite3.IntegrityError:
        seen: set[str] = set()
        for key, _ in batch:
            if key in seen or con.execute(
                "SELECT 1 FROM lengths WHERE sample_key = ?", (key,)
            ).fetchone():
                raise LengthIndexError(
                    f"length index: sample key {show(key)} occurs twice in the dataset; keys must "
                    "be unique for the pool to look lengths up. Rename the samples (webdataset "
                    "__key__) or use length_sort_placement = 'post-encode'."
                ) from None
            seen.add(key)
        raise
    return count + len(batch), total + sum(length for _, length in batch)


class LengthIndex:
    """Read access to a dataset's length index, checked against the dataset when opened.

    Picklable: the sqlite connection is opened lazily in the process that looks lengths up.

    Raises:
        LengthIndexError: On :meth:`open`, if the index is missing, of another version, or was
            built for another ``index.uuid`` (stale); on :meth:`length`, for an unknown key.
    """

    def __init__(
        self,
        dataset: Any,
        path: Path,
        uuid: str,
        samples: int,
        computed_by: str,
        digest: str | None = None,
    ):
        self.dataset = str(dataset)
        self.path = path
        self.uuid = uuid
        self.samples = samples
        self.computed_by = computed_by
        self.digest = digest
        self._con: sqlite3.Connection | None = None
        self._pid: int | None = None

    @classmethod
    def open(
        cls,
        dataset: Any,
        name: str | None = None,
        *,
        prefer: str | None = None,
        index_dir: str | Path | None = None,
    ) -> LengthIndex:
        """Opens and checks a length index of the prepared dataset ``dataset``.

        Args:
            dataset: The prepared dataset folder.
            name: Which index (see :func:`index_name`); None chooses: the one named after
                ``prefer``, else the unnamed one, else the only one there is.
            prefer: What should have computed the lengths (e.g. :func:`task_encoder_label`).
            index_dir: Where the indexes live if not in ``<dataset>/.nv-meta/``.
        """
        rebuild = f"Build it with `energon-ordering index {local_dataset_path(dataset)}"
        rebuild += f" --index-dir {index_dir}`." if index_dir is not None else "`."
        files = length_index_files(dataset, index_dir)
        if name is not None:
            path = index_path(dataset, name, index_dir)
            if not path.exists():
                raise LengthIndexError(
                    f"length index: {path} does not exist (OrderingConfig.length_index = "
                    f"{show(name)}); the indexes of {dataset} are {_names(files)}. Choose one of "
                    f"them or build it with `energon-ordering index {local_dataset_path(dataset)} "
                    f"--name {name}`."
                )
        elif prefer is not None and index_name(prefer) in files:
            path = files[index_name(prefer)]
        elif None in files:
            path = files[None]
        elif len(files) == 1:
            path = next(iter(files.values()))
        elif files:
            raise LengthIndexError(
                f"length index: {dataset} has several length indexes {_names(files)} and none was "
                f"computed by {prefer}; choose one with OrderingConfig.length_index = NAME."
            )
        else:
            path = index_path(dataset, None, index_dir)
            raise LengthIndexError(
                f"length index: no length index for {dataset} ({path} does not exist), so its "
                f"lengths are not known before encoding. {rebuild} (add --task-encoder "
                "MODULE:CLASS for your encoder)."
            )
        try:
            con = connect_readonly(path)
            check = con.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"integrity check: {check}")
            meta = dict(con.execute("SELECT name, value FROM meta").fetchall())
            if "content_digest" not in meta:  # written before digests were stored
                meta["content_digest"] = content_digest(con)
            else:
                _check_rows(con, path, meta, rebuild)
            con.close()
        except LengthIndexError:
            raise
        except (sqlite3.Error, ValueError, TypeError) as e:  # ValueError: a length not a number
            raise LengthIndexError(
                f"length index: {path} is unreadable or corrupt ({e}). {rebuild}"
            ) from e
        version = meta.get("index_version")
        if version != str(INDEX_VERSION):
            raise LengthIndexError(
                f"length index: {path} has index_version = {show(version)}, this package reads "
                f"version {INDEX_VERSION}. {rebuild}"
            )
        uuid = dataset_uuid(dataset)
        if meta.get("dataset_uuid") != uuid:
            raise LengthIndexError(
                f"length index: {path} is stale: it was built for dataset index.uuid = "
                f"{show(meta.get('dataset_uuid'))}, but {dataset} now has index.uuid = "
                f"{show(uuid)} (the data was prepared again). {rebuild}"
            )
        return cls(
            dataset,
            path,
            uuid,
            int(meta.get("samples", 0)),
            meta.get("computed_by", "?"),
            meta["content_digest"],
        )

    def identity(self) -> dict[str, Any]:
        """What a pool's saved state records about the lengths it sorted by: the dataset's
        ``index.uuid``, what computed the lengths and a digest of their content."""
        return {"uuid": self.uuid, "computed_by": self.computed_by, "digest": self.digest}

    def _connection(self) -> sqlite3.Connection:
        if self._con is None or self._pid != os.getpid():
            try:
                con = connect_readonly(self.path, check_same_thread=False)
                row = con.execute(
                    "SELECT value FROM meta WHERE name = 'content_digest'"
                ).fetchone()
            except sqlite3.Error as e:
                raise LengthIndexError.corrupt(self.path, self.dataset, e) from e
            try:
                LengthIndexError.check_unchanged(self.path, row and row[0], self.digest)
            except LengthIndexError:
                con.close()
                raise
            self._con = con
            self._pid = os.getpid()
        return self._con

    def length(self, key: str) -> float:
        """The length of sample ``key``, in tokens."""
        con = self._connection()
        try:
            row = con.execute("SELECT length FROM lengths WHERE sample_key = ?", (key,)).fetchone()
        except sqlite3.Error as e:
            raise LengthIndexError.corrupt(self.path, self.dataset, e) from e
        if row is None:
            raise LengthIndexError(
                f"length index: sample {show(key)} of {self.dataset} is not in {self.path} "
                f"({self.samples} samples, computed by {self.computed_by}); was it built for "
                f"another split? Rebuild it with `energon-ordering index {self.dataset} "
                "--split-part <the training split>`."
            )
        return row[0]

    def lengths(self, max_rows: int = 1_000_000) -> list[float]:
        """The lengths of the index, in tokens: all of them, or an evenly strided subset of
        about ``max_rows`` (every k-th row) for a larger index."""
        con = self._connection()
        stride = max(1, -(-self.samples // max_rows)) if max_rows > 0 else 1
        query = "SELECT length FROM lengths" + (f" WHERE rowid % {stride} = 0" if stride > 1 else "")
        return [row[0] for row in con.execute(query)]

    def __len__(self) -> int:
        return self.samples

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_con": None, "_pid": None}

    def __repr__(self) -> str:
        return f"LengthIndex({self.path}, samples={self.samples}, uuid={show(self.uuid)})"


def _check_rows(con: sqlite3.Connection, path: Path, meta: dict[str, str], rebuild: str) -> None:
    """Refuses an index whose rows were edited after its build (the stored digest left as it
    was: a state saved with the old lengths would restore silently into another order).

    Hashing every row costs about 0.8 s per 10^6 rows, 10 times the rest of an open, at every
    rank's start; so the rows are hashed only when SQLite's file change counter differs from
    the one the build recorded (``file_change_counter``): when the file was written since. A
    write that left the rows as they were (``VACUUM``) is accepted. An index built before the
    counter was recorded is not checked.
    """
    recorded = meta.get("file_change_counter")
    if recorded is None or str(change_counter(path)) == recorded:
        return
    found = content_digest(con)
    if found != meta["content_digest"]:
        raise LengthIndexError(
            f"length index: {path} was edited after its build: its rows now have content "
            f"digest {show(found)}, its meta table says {show(meta['content_digest'])}, so a "
            "state saved with the old lengths would restore into another order. Edit nothing "
            f"in an index. {rebuild}"
        )


def _names(files: dict[str | None, Path]) -> list[str]:
    return [("(unnamed)" if n is None else n) for n in files] or ["none"]
