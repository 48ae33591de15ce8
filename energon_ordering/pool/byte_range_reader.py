"""ByteRangeReader: a prepared dataset's samples read from the byte ranges in Energon's index.

Energon's ``energon prepare`` writes ``.nv-meta/index.sqlite`` with, for every sample, its key and
byte range in its shard (table ``samples``) and, for every file of a sample, the byte range of its
content (table ``sample_parts``). Energon's own random access
(:class:`~megatron.energon.flavors.webdataset.itar_reader.ShardInfosITarReader`) instead looks the
sample's offset up in the shard's ``.tar.idx`` file, then walks the tar headers of the sample
member by member through Python's ``tarfile``: about 0.9 ms per sample on the development
machine, of which ~0.25 ms is the ``.tar.idx`` lookup (a fresh reader per miss) and the rest the
header walk and the per-member reads.

This reader answers the same question with one ``os.pread`` of the sample's byte range and slices
the parts out of it at the offsets the index holds. Sample keys are fetched from the index in
blocks of neighbouring samples and cached per process, a bounded number at a time; given a
length index (``lengths=``), each block also carries the samples' lengths, joined in the same
query, so a pool's fill needs no lookup per sample.
The samples it returns are equal to Energon's (same ``__key__``, ``__shard__``,
``__restore_key__``, ``__sources__`` and part bytes; ``part_filter`` and ``sample_filter``
applied the same way), which a test checks sample by sample.

Global sample index: Energon's reader numbers the samples of its ``shard_infos`` consecutively;
sample ``i`` of shard ``s`` has the index ``sum(count of shards before s) + i``.
"""

from __future__ import annotations

import os
import sqlite3
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from energon_ordering.errors import LengthIndexError, OrderingConfigError
from energon_ordering.sqlite_file import connect_readonly, readonly_uri

__all__ = ["KEY_BLOCK", "ByteRangeReader", "energon_index_path"]

#: Sample keys fetched from the index at a time (loader slices read neighbouring samples).
KEY_BLOCK = 64

#: Energon's index of a prepared dataset, relative to the dataset folder.
ENERGON_INDEX = Path(".nv-meta") / "index.sqlite"


def energon_index_path(dataset: Path) -> Path:
    """Energon's ``index.sqlite`` of the prepared dataset folder ``dataset``."""
    return Path(dataset) / ENERGON_INDEX


class ByteRangeReader:
    """Random access to the samples of an Energon shard list by global sample index.

    Picklable; sqlite connection and open files are per process (loader workers fork).

    Args:
        base_path: The prepared dataset folder (local).
        shards: ``(shard name, sample count)`` in the order of Energon's reader.
        part_filter: Energon's part filter (file extension -> keep), or None.
        sample_filter: Energon's sample filter (``"<shard>/<key>"`` -> keep), or None.
        cache_shards: Open shard files kept per process.
        cache_keys: Sample keys kept per process (in blocks of :data:`KEY_BLOCK`).
        lengths: A length index file of the dataset (table ``lengths``, see
            :mod:`energon_ordering.length_index.index`) whose lengths :meth:`visit` returns.
        lengths_digest: The content digest that index had when the job opened it; a process
            that finds another one refuses to read (the index was replaced under the job).

    Raises:
        OrderingConfigError: The dataset has no ``index.sqlite`` with per-part byte ranges
            (prepared by an Energon older than 7), or a shard is not in it.
    """

    def __init__(
        self,
        base_path: Path,
        shards: Sequence[tuple[str, int]],
        *,
        part_filter: Callable[[str], bool] | None = None,
        sample_filter: Callable[[str], bool] | None = None,
        cache_shards: int = 32,
        cache_keys: int = 65_536,
        lengths: Path | None = None,
        lengths_digest: str | None = None,
    ):
        self.base_path = Path(base_path)
        self.lengths = None if lengths is None else Path(lengths)
        self.lengths_digest = lengths_digest
        self.shards = [(str(name), int(count)) for name, count in shards]
        self.part_filter = part_filter
        self.sample_filter = sample_filter
        self.cache_shards = max(1, int(cache_shards))
        self.cache_blocks = max(1, int(cache_keys) // KEY_BLOCK)
        self.index_path = energon_index_path(self.base_path)
        self._cumsum = [0]
        for _, count in self.shards:
            self._cumsum.append(self._cumsum[-1] + count)
        con = self._open_index()
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            con.close()
        if not {"samples", "sample_parts"} <= tables:
            raise OrderingConfigError(
                f"ByteRangeReader: {self.index_path} has no tables samples and sample_parts "
                f"(has {sorted(tables)}); prepare {self.base_path} again with Energon >= 7.4 "
                "(`energon prepare`)."
            )
        self._tar_ids = self._shard_ids()
        self._epath = _epath(self.base_path)
        self._reset_process_state()

    # -- per-process state ---------------------------------------------------------------------

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._con: sqlite3.Connection | None = None
        self._blocks: dict[tuple[int, int], tuple[tuple[str, ...], tuple[float | None, ...]]] = {}
        self._files: OrderedDict[int, int] = OrderedDict()

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            self._reset_process_state()

    def _open_index(self) -> sqlite3.Connection:
        if not self.index_path.is_file():
            raise OrderingConfigError(
                f"ByteRangeReader: {self.index_path} does not exist; run `energon prepare "
                f"{self.base_path}` (Energon >= 7.4) first."
            )
        return connect_readonly(self.index_path, check_same_thread=False)

    def _connection(self) -> sqlite3.Connection:
        self._check_process()
        if self._con is None:
            con = self._open_index()
            if self.lengths is not None:
                con.execute("ATTACH DATABASE ? AS lengths_index", (readonly_uri(self.lengths),))
                row = con.execute(
                    "SELECT value FROM lengths_index.meta WHERE name = 'content_digest'"
                ).fetchone()
                try:
                    LengthIndexError.check_unchanged(self.lengths, row and row[0], self.lengths_digest)
                except LengthIndexError:
                    con.close()
                    raise
            self._con = con
        return self._con

    def _shard_ids(self) -> dict[str, int]:
        """Shard name -> ``tar_file_id`` of index.sqlite (the order of ``.info.json``)."""
        from megatron.energon.epathlib import EPath
        from megatron.energon.flavors.webdataset.metadata import get_info_shard_files

        ids = {name: i for i, name in enumerate(get_info_shard_files(EPath(self.base_path)))}
        missing = [name for name, _ in self.shards if name not in ids]
        if missing:
            raise OrderingConfigError(
                f"ByteRangeReader: shards {missing[:3]} are not in {self.base_path}/.nv-meta/"
                ".info.json; prepare the dataset again (`energon prepare`)."
            )
        return ids

    # -- lookups -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._cumsum[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (position in ``shards``, sample index within the shard)."""
        shard = bisect_right(self._cumsum, index) - 1
        if index < 0 or shard >= len(self.shards):
            raise IndexError(f"ByteRangeReader: sample index {index} outside [0, {len(self)}).")
        return shard, index - self._cumsum[shard]

    def _key_block(
        self, shard: int, block: int
    ) -> tuple[tuple[str, ...], tuple[float | None, ...]]:
        """Keys (and lengths, None without a length index) of block ``block`` of ``shard``."""
        found = self._blocks.get((shard, block))
        if found is None:
            self._check_process()
            name = self.shards[shard][0]
            if self.lengths is None:
                query = ("SELECT sample_key, NULL FROM samples WHERE tar_file_id = ? AND "
                         "sample_index >= ? AND sample_index < ? ORDER BY sample_index")
            else:
                query = ("SELECT s.sample_key, l.length FROM samples s LEFT JOIN "
                         "lengths_index.lengths l ON l.sample_key = s.sample_key WHERE "
                         "s.tar_file_id = ? AND s.sample_index >= ? AND s.sample_index < ? "
                         "ORDER BY s.sample_index")
            rows = self._connection().execute(
                query, (self._tar_ids[name], block * KEY_BLOCK, (block + 1) * KEY_BLOCK)
            ).fetchall()
            found = (tuple(r[0] for r in rows), tuple(r[1] for r in rows))
            self._blocks[(shard, block)] = found
            if len(self._blocks) > self.cache_blocks:
                del self._blocks[next(iter(self._blocks))]  # oldest first
        return found

    def _block_entry(
        self, index: int
    ) -> tuple[int, tuple[tuple[str, ...], tuple[float | None, ...]], int]:
        shard, local = self.locate(index)
        found = self._key_block(shard, local // KEY_BLOCK)
        if local % KEY_BLOCK >= len(found[0]):
            raise OrderingConfigError(
                f"ByteRangeReader: sample {local} of shard {self.shards[shard][0]} is not in "
                f"{self.index_path}; prepare the dataset again (`energon prepare`)."
            )
        return shard, found, local % KEY_BLOCK

    def key(self, index: int) -> str:
        """The ``__key__`` of sample ``index``, from the index (no shard read)."""
        _, found, at = self._block_entry(index)
        return found[0][at]

    def visit(self, index: int) -> tuple[str, str, float | None]:
        """Shard name, ``__key__`` and length (from the length index; None without one, or if
        it lacks the key) of sample ``index``, from the indexes (no shard read)."""
        shard, found, at = self._block_entry(index)
        return self.shards[shard][0], found[0][at], found[1][at]

    def shard_name(self, index: int) -> str:
        """The shard file name of sample ``index``."""
        return self.shards[self.locate(index)[0]][0]

    def keep(self, index: int) -> bool:
        """False if Energon's ``sample_filter`` excludes sample ``index``."""
        if self.sample_filter is None:
            return True
        return bool(self.sample_filter(f"{self.shard_name(index)}/{self.key(index)}"))

    def _fd(self, shard: int) -> int:
        fd = self._files.get(shard)
        if fd is not None:
            self._files.move_to_end(shard)
            return fd
        fd = os.open(self.base_path / self.shards[shard][0], os.O_RDONLY)
        self._files[shard] = fd
        while len(self._files) > self.cache_shards:
            os.close(self._files.popitem(last=False)[1])
        return fd

    def read(self, index: int) -> dict[str, Any] | None:
        """Sample ``index`` as Energon's reader returns it (a ``FilteredSample`` dict), or None
        if ``sample_filter`` excludes it."""
        from megatron.energon.source_info import SourceInfo

        shard, local = self.locate(index)
        name = self.shards[shard][0]
        rows = self._connection().execute(
            "SELECT s.sample_key, p.part_name, p.content_byte_offset, p.content_byte_size "
            "FROM samples s JOIN sample_parts p "
            "ON p.tar_file_id = s.tar_file_id AND p.sample_index = s.sample_index "
            "WHERE s.tar_file_id = ? AND s.sample_index = ? ORDER BY p.content_byte_offset",
            (self._tar_ids[name], local),
        ).fetchall()
        if not rows:
            raise OrderingConfigError(
                f"ByteRangeReader: sample {local} of shard {name} is not in {self.index_path}; "
                "prepare the dataset again (`energon prepare`)."
            )
        key = rows[0][0]
        if self.sample_filter is not None and not self.sample_filter(f"{name}/{key}"):
            return None
        parts = [row[1:] for row in rows]
        start = parts[0][1]
        end = max(offset + size for _, offset, size in parts)
        data = os.pread(self._fd(shard), end - start, start)
        sample: dict[str, Any] = {
            "__key__": key,
            "__shard__": name,
            "__restore_key__": ("Webdataset", index),
        }
        file_names = []
        for part, offset, size in parts:
            if self.part_filter is not None and not self.part_filter(part):
                continue
            sample[part] = data[offset - start : offset - start + size]
            file_names.append(f"{key}.{part}")
        sample["__sources__"] = (
            SourceInfo(
                dataset_path=self._epath,
                index=index,
                shard_name=name,
                file_names=tuple(file_names),
            ),
        )
        return sample

    def close(self) -> None:
        """Closes this process's sqlite connection and shard files."""
        if self._pid == os.getpid():
            for fd in self._files.values():
                os.close(fd)
            if self._con is not None:
                self._con.close()
        self._reset_process_state()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_con=None, _blocks={}, _files=OrderedDict(), _pid=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    def __repr__(self) -> str:
        return f"ByteRangeReader({self.base_path}, samples={len(self)}, shards={len(self.shards)})"


def _epath(path: Path) -> Any:
    from megatron.energon.epathlib import EPath

    return EPath(path)
