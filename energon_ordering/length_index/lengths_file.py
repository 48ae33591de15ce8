"""A split's lengths as one flat, memory-mapped array: the planned order's view of a length index.

The planned order (``length_sort_mode: planned``) looks up the length of any sample of a split
by its sample index. Reading them from the length index joined to Energon's ``index.sqlite``
takes seconds per 10^6 samples and 8 bytes per sample in every rank and loader worker (800 MB
at 10^8). :func:`split_lengths` does that join once and writes the result next to the length
index as a ``.npy`` file, then every process maps it read-only (``np.load(mmap_mode="r")``):
opening is O(1), and the pages a plan touches live in the page cache, shared by every process
of the node and reclaimable, not in any process's own memory.

The file is named after a digest of everything its content depends on: the length index's
content digest, the dataset's ``index.uuid`` and the split's shards with their sample counts.
Re-indexing, re-preparing or another split gives another name, so a file is never stale; it
is written to a temporary name and renamed, so ranks that build it at once never see half a
file. Its values are exactly the length index's: float32 when every length is a float32 value
(integers up to 2^24), else float64, so a plan from the file equals a plan from the join.
Where the folder is not writable, the join's array is used in memory (one log line).

What a file holds is named by :func:`lengths_content_digest` (the planned order keys the plans a
node's processes share by it): a sha256 of the values, written when the file is, to a sidecar
``<file>.digest.json`` beside it together with the file's identity (device, inode, size,
modification and change times in ns). A process reads the sidecar (O(1)) and recomputes the
digest only when the file's identity differs from the sidecar's: a file edited or replaced since
(a sidecar cannot go stale unnoticed). Hashing is what that spares: a file of 10^8 samples is
800 MB, 0.7 s of sha256 measured here, in each of a node's 16 loader workers at every start,
and a read of the whole file where it is not in the page cache. Without a writable folder the
digest is computed once per process and file identity (memoised). An edit within the file
system's timestamp granularity (a few ms) of the hashing that keeps the size and inode is the
one change that goes unseen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Callable

import numpy as np

from energon_ordering.errors import LengthIndexError, OrderingConfigError, show
from energon_ordering.length_index.index import dataset_uuid
from energon_ordering.length_index.lengths_check import check_lengths_file
from energon_ordering.pool.byte_range_reader import ByteRangeReader

__all__ = ["indexed_lengths", "lengths_content_digest", "lengths_file_path", "reopen", "reopened",
           "save_atomically", "split_lengths"]

logger = logging.getLogger(__name__)

#: Bumped when the file's layout changes (part of its name).
LENGTHS_FILE_VERSION = 1

#: Bumped when :func:`lengths_content_digest` hashes otherwise (part of each digest).
CONTENT_DIGEST_VERSION = 1

#: Bytes hashed at once (bounds the copy of a non-contiguous array's chunk).
_HASH_CHUNK = 1 << 24

#: Digests computed or read in this process, by file identity (:func:`_identity`).
_DIGESTS: dict[tuple[int, ...], str] = {}


def lengths_file_path(length_index: Path, *, digest: str | None, dataset_uuid: str,
                      shards: list[tuple[str, int]]) -> Path:
    """Where the flat lengths of a split live: beside ``length_index``, named after a digest of
    what its content depends on."""
    key = json.dumps([LENGTHS_FILE_VERSION, digest, dataset_uuid, shards], sort_keys=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:20]
    return Path(length_index).with_name(f"{Path(length_index).stem}.split-{name}.npy")


def _narrowest(lengths: np.ndarray) -> np.ndarray:
    """float32 if it holds every value exactly, else float64."""
    narrow = lengths.astype(np.float32)
    return narrow if np.array_equal(narrow.astype(np.float64), lengths) else lengths


def split_lengths(path: Path, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """The split's lengths from ``path``, mapped read-only; built with ``compute()`` (every
    sample's length in sample-index order, float64, complete) when the file does not exist.

    Returns:
        A read-only array (a memory map, or in memory when ``path``'s folder is not writable).
    """
    path = Path(path)
    if path.is_file():
        return np.load(path, mmap_mode="r")
    values = _narrowest(np.asarray(compute(), dtype=np.float64))
    error = save_atomically(path, values)
    if error is not None:
        logger.info("planned order: cannot write %s (%s); the lengths stay in this process's "
                    "memory (%d bytes)", path, error, values.nbytes)
        values.setflags(write=False)
        return values
    lengths_content_digest(path)  # its sidecar, while the pages are in the cache
    return np.load(path, mmap_mode="r")


def save_atomically(path: Path, values: np.ndarray, mode: int | None = None) -> OSError | None:
    """Writes ``values`` to ``path`` as ``.npy`` under a temporary name, then renames it (a
    reader never sees half a file). Returns the error that stopped it (nothing left behind),
    or None.

    Args:
        mode: The file's permission bits (e.g. ``0o600``); None: the default (``0o666`` less
            the umask).
    """
    return _replace_with(path, lambda f: np.save(f, values), mode)


def _replace_with(path: Path, write: Callable[[Any], None], mode: int | None) -> OSError | None:
    """Writes ``path`` by ``write(binary file)`` under a temporary name, then renames it."""
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     0o666 if mode is None else mode)
        with open(fd, "wb") as f:
            if mode is not None:
                os.fchmod(fd, mode)  # a left-over temporary file kept its own mode
            write(f)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return e
    return None


def lengths_content_digest(lengths: np.ndarray | str | os.PathLike) -> str:
    """A digest of a lengths array's content (dtype, shape and values), the same for a file and
    for the array it holds.

    Args:
        lengths: A lengths file (a path, or its memory map as :func:`split_lengths` returns it):
            its sidecar's digest if the file is unchanged since it was written, else hashed
            (and the sidecar written anew where the folder allows); any other array: hashed.

    Returns:
        32 hex digits.
    """
    if isinstance(lengths, (str, os.PathLike)):
        return _file_digest(Path(lengths))
    array = np.asarray(lengths)
    name = getattr(lengths, "filename", None)
    if isinstance(lengths, np.memmap) and name is not None:
        whole = np.load(name, mmap_mode="r")  # a slice of the map is not the file's content
        if whole.shape == array.shape and whole.dtype == array.dtype:
            return _file_digest(Path(name))
    return _array_digest(array)


def _array_digest(array: np.ndarray) -> str:
    h = hashlib.sha256(f"{CONTENT_DIGEST_VERSION}:{array.dtype.str}:{array.shape}".encode())
    flat = array.reshape(-1)
    step = max(1, _HASH_CHUNK // max(1, array.itemsize))
    for lo in range(0, flat.size, step):
        h.update(np.ascontiguousarray(flat[lo:lo + step]).data)
    return h.hexdigest()[:32]


def _identity(path: Path) -> tuple[int, ...]:
    """What changes when a file is edited or replaced: device, inode, size, modification and
    change times (ns; the change time cannot be set back by a user)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _file_digest(path: Path) -> str:
    """The digest of the lengths file ``path`` (see the module docstring)."""
    sidecar = path.with_name(f"{path.name}.digest.json")
    for _ in range(3):  # the file replaced while it was hashed: again
        identity = _identity(path)
        known = _DIGESTS.get(identity)
        if known is not None:
            return known
        try:
            record = json.loads(sidecar.read_text())
            if (record.get("version") == CONTENT_DIGEST_VERSION
                    and record.get("identity") == list(identity)):
                _DIGESTS[identity] = known = str(record["digest"])
                return known
        except (OSError, ValueError, AttributeError, KeyError):
            pass
        digest = _array_digest(np.load(path, mmap_mode="r"))
        if _identity(path) != identity:
            continue
        _DIGESTS[identity] = digest
        text = json.dumps({"version": CONTENT_DIGEST_VERSION, "identity": list(identity),
                           "digest": digest})
        error = _replace_with(sidecar, lambda f: f.write(text.encode()), None)
        if error is not None:
            logger.debug("lengths file: cannot write %s (%s)", sidecar, error)
        return digest
    return digest


def reopen(array: Any) -> Any:
    """For pickling: a mapped array as ``("lengths_file", path)``, anything else unchanged."""
    if isinstance(array, np.memmap) and array.filename is not None:
        return ("lengths_file", array.filename)
    return array


def reopened(value: Any) -> Any:
    """The inverse of :func:`reopen`."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "lengths_file":
        return np.load(value[1], mmap_mode="r")
    return value


def indexed_lengths(reader: ByteRangeReader, dataset: Any) -> np.ndarray:
    """Every sample's length, in the reader's sample order (Energon's sample index): the
    length index joined to Energon's index once per split and data version, then mapped from
    its flat file (:mod:`energon_ordering.length_index.lengths_file`).

    Raises:
        LengthIndexError: The length index does not cover every sample of the split.
        OrderingConfigError: The split excludes samples (``sample_excludes``).
    """
    if reader.sample_filter is not None:
        for i in range(len(reader)):
            if not reader.keep(i):
                raise OrderingConfigError(
                    f"planned order: the split of {dataset} excludes samples (e.g. "
                    f"{show(reader.key(i))}); length_sort_mode = 'planned' does not support "
                    "sample_excludes yet: drop the excludes or use a pool mode."
                )

    def join() -> np.ndarray:
        lengths, missing = reader.lengths_array()
        if missing is not None:
            shard, key, _ = reader.visit(missing)
            raise LengthIndexError(
                f"planned order: sample {show(key)} of {dataset} (shard {shard}) is not in the "
                f"length index {reader.lengths}; the plan needs every sample's length. Rebuild "
                f"it with `energon-ordering index {dataset}`."
            )
        return lengths

    if reader.lengths_digest is None:  # nothing names the content: no file to trust
        return join()
    path = lengths_file_path(reader.lengths, digest=reader.lengths_digest,
                             dataset_uuid=dataset_uuid(reader.base_path), shards=reader.shards)
    check_lengths_file(path, samples=len(reader), dataset=dataset)
    return split_lengths(path, join)
