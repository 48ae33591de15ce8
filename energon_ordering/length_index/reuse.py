"""Lengths an incremental build keeps: the previous index's, for shards whose content is unchanged.

``energon prepare`` run again (more shards) writes a new ``index.uuid``, and the length index of
the old one is stale. Its ``shards`` table (written by
:func:`~energon_ordering.length_index.index.write_length_index`) holds the content digest and
sample count of every shard it measured; a shard of the new split with the same digest holds
the very same samples, whatever its name now, so their lengths are looked up in the old index
by key (the keys come from Energon's new ``index.sqlite``, no shard is read) instead of
measured. Only a previous index of another ``index.uuid`` (the data was prepared again) and of
the same length function is used: rebuilding the index of an unchanged dataset measures every
sample again (the length function's code may have changed; its name has not).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

from energon_ordering.sqlite_file import connect_readonly

__all__ = ["PreviousIndex", "previous_index"]


class PreviousIndex:
    """Read access to a stale length index's shards and lengths (read-only, this process)."""

    def __init__(self, path: Path, con: sqlite3.Connection, shards: dict[str, int]):
        self.path = path
        self._con = con
        self._shards = shards

    def lengths(self, digest: str, keys: Sequence[str]) -> list[float] | None:
        """The lengths of ``keys``, the samples of a shard with content ``digest``, if the
        previous index measured that shard (same digest, same sample count) and holds every key;
        else None."""
        if self._shards.get(digest) != len(keys):
            return None
        found: dict[str, float] = {}
        for lo in range(0, len(keys), 500):
            chunk = keys[lo:lo + 500]
            found.update(self._con.execute(
                f"SELECT sample_key, length FROM lengths WHERE sample_key IN "
                f"({','.join('?' * len(chunk))})", chunk).fetchall())
        if len(found) != len(keys):
            return None
        return [found[k] for k in keys]

    def close(self) -> None:
        self._con.close()


def previous_index(candidates: Sequence[Path], *, uuid: str,
                   computed_by: str) -> PreviousIndex | None:
    """The newest of ``candidates`` (length index files) built for another ``index.uuid`` than
    ``uuid`` by ``computed_by``, with a ``shards`` table; None if there is none (an unreadable
    file is passed over: it is only a cache)."""
    files = sorted((p for p in candidates if p.is_file()), key=lambda p: p.stat().st_mtime_ns,
                   reverse=True)
    for path in files:
        try:
            con = connect_readonly(path, check_same_thread=False)
            meta = dict(con.execute("SELECT name, value FROM meta").fetchall())
            if meta.get("dataset_uuid") == uuid or meta.get("computed_by") != computed_by:
                con.close()
                continue
            shards = dict(con.execute("SELECT digest, samples FROM shards").fetchall())
        except sqlite3.Error:
            continue
        return PreviousIndex(path, con, shards)
    return None
