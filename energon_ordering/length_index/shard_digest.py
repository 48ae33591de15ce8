"""A shard file's identity: a digest of its bytes, and the stat fields that change when it is written.

An incremental build keeps the lengths of a shard whose content is unchanged after ``energon
prepare`` ran again; content, not name: a shard renamed keeps its lengths, a shard rewritten
under its old name is measured again. The digest (BLAKE2b, 128 bits) reads the whole file, at
the disk's speed; measuring the shard reads it anyway. A shard written while the build measures
it is caught by :func:`check_unchanged` (size and modification time, taken before and after).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from energon_ordering.errors import LengthIndexError

__all__ = ["ShardStamp", "check_unchanged", "shard_stamp"]

#: Bytes read at a time.
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ShardStamp:
    """What a build records of a shard file: its content digest, size and modification time."""

    digest: str
    size: int
    mtime_ns: int


def _stat(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def shard_stamp(path: Path) -> ShardStamp:
    """Digest, size and modification time of the shard file ``path``.

    Raises:
        LengthIndexError: The file is unreadable, or changed while it was read.
    """
    try:
        before = _stat(path)
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError as e:
        raise LengthIndexError(
            f"length index: cannot read shard {path} ({e}); is the dataset complete? Run "
            "`energon prepare` on it again."
        ) from e
    stamp = ShardStamp(h.hexdigest(), *before)
    check_unchanged(path, stamp)
    return stamp


def check_unchanged(path: Path, stamp: ShardStamp) -> None:
    """Raises :class:`LengthIndexError` if ``path``'s size or modification time is not
    ``stamp``'s: the shard was written during the build."""
    try:
        now = _stat(path)
    except OSError as e:
        now = (str(e), None)
    if now != (stamp.size, stamp.mtime_ns):
        raise LengthIndexError(
            f"length index: shard {path} changed during the build (size, mtime "
            f"{stamp.size}, {stamp.mtime_ns} -> {now[0]}, {now[1]}); its lengths could be of "
            "neither version. Let the writer finish, run `energon prepare` again, then build "
            "the index again."
        )
