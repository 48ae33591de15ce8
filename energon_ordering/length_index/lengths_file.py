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
from energon_ordering.pool.byte_range_reader import ByteRangeReader

__all__ = ["indexed_lengths", "lengths_file_path", "reopen", "reopened", "save_atomically",
           "split_lengths"]

logger = logging.getLogger(__name__)

#: Bumped when the file's layout changes (part of its name).
LENGTHS_FILE_VERSION = 1


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
    return np.load(path, mmap_mode="r")


def save_atomically(path: Path, values: np.ndarray) -> OSError | None:
    """Writes ``values`` to ``path`` as ``.npy`` under a temporary name, then renames it (a
    reader never sees half a file). Returns the error that stopped it (nothing left behind),
    or None."""
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, values)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return e
    return None


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
    return split_lengths(path, join)
