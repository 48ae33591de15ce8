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
the parts out of it at the offsets the index holds. It trusts nothing it reads: the read must
return every byte of the range, and the tar header in front of each part (read in the same
``pread``: the range starts at the sample's first header, ``samples.byte_offset``) must name
that part of that sample (``<key>.<part>``) with the size the index gives. A shard truncated,
replaced or rewritten after ``energon prepare`` raises
:class:`~energon_ordering.errors.ShardReadError` naming the shard, the sample and the fix, where
Energon's own reader raises too (``tarfile.ReadError``, "Inconsistent sample base name"): never a
sample with half its text, nor garbage bytes that the decoder's error handler would skip one
sample at a time. The check compares header fields in place, a few microseconds per sample
(headers it cannot vouch for that way, e.g. long names in PAX headers, are parsed with
``tarfile``); within the noise of the read itself in ``tools/bench_scale.py``'s random reads.

Sample keys are fetched from the index in blocks of neighbouring samples and cached per process,
a bounded number at a time; given a length index (``lengths=``), each block also carries the
samples' lengths, joined in the same query, so a pool's fill needs no lookup per sample.
The samples it returns are equal to Energon's (same ``__key__``, ``__shard__``,
``__restore_key__``, ``__sources__`` and part bytes; ``part_filter`` and ``sample_filter``
applied the same way), which a test checks sample by sample.

Global sample index: Energon's reader numbers the samples of its ``shard_infos`` consecutively;
sample ``i`` of shard ``s`` has the index ``sum(count of shards before s) + i``.
"""

from __future__ import annotations

import copy
import io
import os
import sqlite3
import tarfile
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from energon_ordering.errors import LengthIndexError, OrderingConfigError, ShardReadError, show
from energon_ordering.sqlite_file import connect_readonly, readonly_uri, sqlite_problem

__all__ = ["KEY_BLOCK", "ByteRangeReader", "energon_index_path", "tar_members_problem"]

#: Sample keys fetched from the index at a time (loader slices read neighbouring samples).
KEY_BLOCK = 64

#: Energon's index of a prepared dataset, relative to the dataset folder.
ENERGON_INDEX = Path(".nv-meta") / "index.sqlite"

#: Bytes of a tar header block.
TAR_BLOCK = 512


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
        ShardReadError: On :meth:`read`, a shard does not hold the sample where the index says
            (see the module docstring); on any lookup, ``index.sqlite`` became unreadable.
        LengthIndexError: On a lookup, the length index was replaced or damaged under the job.
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
                try:
                    con.execute("ATTACH DATABASE ? AS lengths_index", (readonly_uri(self.lengths),))
                    row = con.execute(
                        "SELECT value FROM lengths_index.meta WHERE name = 'content_digest'"
                    ).fetchone()
                    LengthIndexError.check_unchanged(
                        self.lengths, row and row[0], self.lengths_digest
                    )
                except (LengthIndexError, sqlite3.Error) as e:
                    con.close()
                    if isinstance(e, sqlite3.Error):
                        raise self._index_error(e) from e
                    raise
            self._con = con
        return self._con

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        """Rows of ``sql``; an sqlite failure becomes a typed error naming the broken file."""
        con = self._connection()
        try:
            return con.execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise self._index_error(e) from e

    def _index_error(self, error: sqlite3.Error) -> Exception:
        """The typed error for ``error``: the length index's if that file is broken (it is
        checked when the job opens it, so it broke under the job), else Energon's index's."""
        if self.lengths is not None and sqlite_problem(self.lengths) is not None:
            return LengthIndexError.corrupt(self.lengths, self.base_path, error)
        return ShardReadError(
            f"ByteRangeReader: {self.index_path} is unreadable or corrupt ({error}); run "
            f"`energon prepare {self.base_path}` again, then `energon-ordering index "
            f"{self.base_path}`."
        )

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
            rows = self._query(
                query, (self._tar_ids[name], block * KEY_BLOCK, (block + 1) * KEY_BLOCK)
            )
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

    def thread_copy(self) -> ByteRangeReader:
        """A copy with its own sqlite connection, key cache and open files, for another thread
        (one reader's connection and files are not shared between threads)."""
        other = copy.copy(self)
        other._reset_process_state()
        return other

    def lengths_array(self) -> tuple[np.ndarray, int | None]:
        """Every sample's length from the length index, in the reader's sample order, in one
        query (float64; NaN where the length index lacks the key), and the first sample index
        without a length (None: all have one). Needs ``lengths=``."""
        if self.lengths is None:
            raise OrderingConfigError("ByteRangeReader.lengths_array needs a length index "
                                      "(lengths=).")
        out = np.full(len(self), np.nan)
        for pos, (name, count) in enumerate(self.shards):
            rows = self._query(
                "SELECT s.sample_index, l.length FROM samples s LEFT JOIN lengths_index.lengths "
                "l ON l.sample_key = s.sample_key WHERE s.tar_file_id = ? AND s.sample_index < ?",
                (self._tar_ids[name], count),
            )
            if rows:
                at = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
                val = np.fromiter((np.nan if r[1] is None else r[1] for r in rows),
                                  dtype=np.float64, count=len(rows))
                out[self._cumsum[pos] + at] = val
        missing = np.flatnonzero(np.isnan(out))
        return out, (int(missing[0]) if len(missing) else None)

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
        if ``sample_filter`` excludes it.

        Raises:
            ShardReadError: The shard does not hold that sample at the byte range the index
                gives (truncated, replaced or rewritten after ``energon prepare``).
        """
        from megatron.energon.source_info import SourceInfo

        shard, local = self.locate(index)
        name = self.shards[shard][0]
        rows = self._query(
            "SELECT s.sample_key, s.byte_offset, p.part_name, p.content_byte_offset, "
            "p.content_byte_size FROM samples s JOIN sample_parts p "
            "ON p.tar_file_id = s.tar_file_id AND p.sample_index = s.sample_index "
            "WHERE s.tar_file_id = ? AND s.sample_index = ? ORDER BY p.content_byte_offset",
            (self._tar_ids[name], local),
        )
        if not rows:
            raise OrderingConfigError(
                f"ByteRangeReader: sample {local} of shard {name} is not in {self.index_path}; "
                "prepare the dataset again (`energon prepare`)."
            )
        key = rows[0][0]
        if self.sample_filter is not None and not self.sample_filter(f"{name}/{key}"):
            return None
        parts = [row[2:] for row in rows]
        # From the first member's header (its name is checked) to the end of the last part.
        start = rows[0][1] if rows[0][1] is not None else max(parts[0][1] - TAR_BLOCK, 0)
        end = max(offset + size for _, offset, size in parts)
        data = self._pread(shard, start, end - start)
        problem = (
            f"the shard ends at byte {start + len(data)}, inside the sample's byte range "
            f"[{start}, {end}) (truncated?)"
            if len(data) < end - start
            else tar_members_problem(data, start, key, parts)
        )
        if problem is not None:
            raise ShardReadError(
                f"ByteRangeReader: shard {self.base_path / name} does not hold sample "
                f"{show(key)} (sample {local} of the shard, index {index}) where "
                f"{self.index_path} says: {problem}. The shard was changed after `energon "
                f"prepare`; run `energon prepare {self.base_path}` again, then "
                f"`energon-ordering index {self.base_path}` (its length index is tied to the "
                "prepared index)."
            )
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

    def _pread(self, shard: int, offset: int, size: int) -> bytes:
        """``size`` bytes of ``shard`` from ``offset``; fewer only at the end of the file."""
        fd = self._fd(shard)
        data = os.pread(fd, size, offset)
        if len(data) < size:  # a regular file reads short only at its end; a network one may not
            chunks = [data]
            got = len(data)
            while got < size and (more := os.pread(fd, size - got, offset + got)):
                chunks.append(more)
                got += len(more)
            data = b"".join(chunks)
        return data

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


def tar_members_problem(
    data: bytes, start: int, key: str, parts: Sequence[tuple[str, int, int]]
) -> str | None:
    """What is wrong with the tar headers of one sample's byte range, or None.

    Args:
        data: The shard's bytes from ``start``, the offset of the sample's first tar header,
            through the end of its last part.
        start: The shard offset of ``data[0]``.
        key: The sample's ``__key__`` (tar members ``<key>.<part>``).
        parts: ``(part name, shard offset of its content, content size)`` per part, as
            Energon's index lists them.

    Each part's content is preceded by its member's (last) header block. A plain one (name
    under 100 bytes, no ustar prefix, octal size) is checked field by field; anything else
    (PAX or GNU long names, base-256 sizes, or a header that does not match) is decided by
    parsing the range with :mod:`tarfile`.
    """
    for part, offset, size in parts:
        at = offset - start - TAR_BLOCK
        name = f"{key}.{part}".encode()
        n = len(name)
        if not (
            at >= 0
            and n < 100
            and data[at : at + n] == name
            and data[at + n] == 0
            and data[at + 156] in (0x30, 0)  # '0' or NUL: a regular file
            and data[at + 345] == 0  # no ustar name prefix
            and _octal(data[at + 124 : at + 136]) == size
        ):
            return _parsed_members_problem(data, start, key, parts)
    return None


def _octal(field: bytes) -> int | None:
    """A tar header's octal number field (None if it is not one, e.g. base-256)."""
    try:
        return int(field.strip(b" \0") or b"0", 8)
    except ValueError:
        return None


def _parsed_members_problem(
    data: bytes, start: int, key: str, parts: Sequence[tuple[str, int, int]]
) -> str | None:
    """:func:`tar_members_problem` by parsing the headers with :mod:`tarfile` (exact, slower)."""
    members: dict[int, tarfile.TarInfo] = {}
    try:
        with tarfile.TarFile(fileobj=io.BytesIO(data), mode="r") as tar:
            for member in tar:
                members[start + member.offset_data] = member
    except tarfile.TarError as e:
        # Past the last member the range holds (a member larger than the index says) tarfile
        # finds no more data: the members found so far decide.
        if not members:
            return f"no tar header at byte {start} ({e})"
    for part, offset, size in parts:
        expected = f"{key}.{part}"
        member = members.get(offset)
        if member is None:
            return f"no tar member's content starts at byte {offset} (part {show(expected)})"
        if member.name != expected or not member.isreg():
            return f"the tar member there is {show(member.name)}, not {show(expected)}"
        if member.size != size:
            return f"tar member {show(expected)} holds {member.size} bytes, the index says {size}"
    return None


def _epath(path: Path) -> Any:
    from megatron.energon.epathlib import EPath

    return EPath(path)
