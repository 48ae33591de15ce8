"""One prepared dataset's length index, measured shard by shard, by one process or many.

Each process of the build (:class:`~.distributed.Coordinator`) measures its contiguous run of
the split's shards (:func:`~.shard_split.split_shards`): for each shard it takes the file's
stamp (:mod:`.shard_digest`), reuses the lengths a previous index holds for that content
(:mod:`.reuse`) or reads its samples by byte range from Energon's index and measures them, and
checks that the file did not change meanwhile. A one-process build streams the shards into the
index; a process of a distributed build writes its shards as its part (:mod:`.parts`), and rank
0, once every part is written, merges the parts in rank order (the split's order), checking that
every shard of the split is covered exactly once with every sample, and writes the index and the
split's lengths file: the bytes a one-process build writes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from energon_ordering.errors import LengthIndexError
from energon_ordering.length_index.distributed import Coordinator
from energon_ordering.length_index.index import IndexSummary
from energon_ordering.length_index.parts import (
    PartOwner,
    ShardLengths,
    load_part,
    part_files,
    part_path,
    write_part,
)
from energon_ordering.length_index.reuse import PreviousIndex
from energon_ordering.length_index.shard_digest import check_unchanged, shard_stamp
from energon_ordering.length_index.shard_split import split_shards

__all__ = ["DatasetJob", "Outcome", "Tally", "build_dataset", "covered", "shard_lengths"]

#: ``measure_stream(raw samples)`` -> ``(key, length or None for a skipped sample)``, in order.
MeasureStream = Callable[[Iterator[Any]], Iterator[tuple[str, float | None]]]


@dataclass
class DatasetJob:
    """What every process knows of one dataset's build.

    Attributes:
        label: The dataset, for messages.
        folder: Its prepared folder.
        target: The index file to write.
        reader: Byte-range access to the split's samples (its ``shards``: the split).
        owner: What this process's part belongs to.
        tag: The dataset's name in the shared store.
        write_index: Writes the index from ``(key, length)`` pairs and ``shards`` (name, digest,
            samples), and the split's lengths file; returns the summary.
    """

    label: str
    folder: Path
    target: Path
    reader: Any
    owner: PartOwner
    tag: str
    write_index: Callable[..., IndexSummary]


@dataclass(frozen=True)
class Outcome:
    """What a dataset's build wrote: its summary, the samples measured (not reused from a
    previous index) and the samples indexed with length 0 because they failed."""

    summary: IndexSummary
    measured: int
    skipped: list[str]


def _raws(job: DatasetJob, positions: list[int], owner: list[int]) -> Iterator[Any]:
    """The raw samples of the shards at ``positions``, as Energon's reader yields them; the
    position of each is appended to ``owner`` as it is yielded."""
    from energon_ordering.pool.index_fill import raw_sample_at

    reader = job.reader
    starts = [0]
    for _, count in reader.shards:
        starts.append(starts[-1] + count)
    for pos in positions:
        for index in range(starts[pos], starts[pos + 1]):
            raw = raw_sample_at(reader, index)
            if raw is not None:  # None: Energon's sample filter excludes it
                owner.append(pos)
                yield raw


def _kept_keys(job: DatasetJob, pos: int) -> list[str]:
    reader = job.reader
    start = sum(count for _, count in reader.shards[:pos])
    return [reader.key(i) for i in range(start, start + reader.shards[pos][1]) if reader.keep(i)]


def shard_lengths(job: DatasetJob, positions: range, measure_stream: MeasureStream,
                  previous: PreviousIndex | None,
                  advance: Callable[[int], None]) -> Iterator[ShardLengths]:
    """Every shard at ``positions``, in order: reused from ``previous`` where its content is
    unchanged, else measured (``advance(n)`` after each ``n`` samples)."""
    stamps, reused = {}, {}
    for pos in positions:
        name = job.reader.shards[pos][0]
        stamps[pos] = shard_stamp(job.folder / name)
        if previous is not None:
            keys = _kept_keys(job, pos)
            lengths = previous.lengths(stamps[pos].digest, keys)
            if lengths is not None:
                reused[pos] = (keys, lengths)
    owner: list[int] = []
    results = measure_stream(_raws(job, [p for p in positions if p not in reused], owner))
    held: tuple[int, str, float | None] | None = None
    taken = 0
    for pos in positions:
        name, stamp = job.reader.shards[pos][0], stamps[pos]
        if pos in reused:
            keys, lengths = reused[pos]
            advance(len(keys))
            yield ShardLengths(pos, name, stamp.digest, stamp.size, stamp.mtime_ns, keys,
                               lengths, measured=False)
            continue
        keys, lengths, skipped = [], [], []
        while True:
            if held is None:
                result = next(results, None)
                if result is None:
                    break
                held = (owner[taken], *result)
                taken += 1
            if held[0] != pos:
                break
            _, key, length = held
            held = None
            if length is None:
                skipped.append(key)
                length = 0.0
            keys.append(key)
            lengths.append(length)
            advance(1)
        check_unchanged(job.folder / name, stamp)
        yield ShardLengths(pos, name, stamp.digest, stamp.size, stamp.mtime_ns, keys, lengths,
                           skipped)


@dataclass
class Tally:
    """What :func:`covered` saw: each shard's ``(name, digest, samples)``, the samples
    measured and the keys skipped."""

    stamps: list[tuple[str, str, int]] = field(default_factory=list)
    measured: int = 0
    skipped: list[str] = field(default_factory=list)


def covered(label: str, split: list[tuple[str, int]], exact: bool, shards: Iterator[ShardLengths],
            tally: Tally) -> Iterator[tuple[str, float]]:
    """The ``(key, length)`` pairs of ``shards``, checked to cover every shard of ``split``
    (``(name, samples)`` in order) exactly once, in order, each with all its samples (``exact``;
    False: at most, when Energon's sample filter excludes some); ``tally`` filled on the way.

    Raises:
        LengthIndexError: A shard is missing, repeated, out of order or short of samples.
    """
    expected = 0
    for shard in shards:
        name, count = split[expected] if expected < len(split) else ("(none: all covered)", 0)
        if shard.position != expected or shard.name != name:
            raise LengthIndexError(
                f"length index of {label}: the parts hold shard {shard.position} "
                f"({shard.name}) where shard {expected} ({name}) comes next: a shard is missing, "
                "repeated or of another split. Delete the parts (*.part-*) beside the index and "
                "build again."
            )
        held = len(shard.keys)
        if held != len(shard.lengths) or held > count or (exact and held != count):
            raise LengthIndexError(
                f"length index of {label}: shard {name} has {count} samples but its part holds "
                f"{held} keys and {len(shard.lengths)} lengths; was the dataset prepared again "
                "during the build? Build again."
            )
        tally.stamps.append((shard.name, shard.digest, held))
        tally.measured += held if shard.measured else 0
        tally.skipped.extend(shard.skipped)
        expected += 1
        yield from zip(shard.keys, shard.lengths)
    if expected != len(split):
        raise LengthIndexError(
            f"length index of {label}: the parts cover {expected} of the split's {len(split)} "
            "shards; a part is missing. Build again (finished parts are reused)."
        )


def _write(job: DatasetJob, shards: Iterator[ShardLengths]) -> Outcome:
    tally = Tally()
    pairs = covered(job.label, job.reader.shards, job.reader.sample_filter is None, shards, tally)
    summary = job.write_index(pairs, shards=tally.stamps)
    return Outcome(summary, tally.measured, tally.skipped)


def _merged_parts(job: DatasetJob, coord: Coordinator) -> Iterator[ShardLengths]:
    """Every part of the build, in rank order (the split's order), one part in memory."""
    world = coord.world_size
    for rank, positions in enumerate(split_shards([c for _, c in job.reader.shards], world)):
        path = part_path(job.target, rank, world)
        owner = PartOwner(**{**job.owner.__dict__, "rank": rank})
        shards, why = load_part(path, owner, [(p, job.reader.shards[p][0]) for p in positions])
        if shards is None:
            raise LengthIndexError(
                f"length index of {job.label}: the part {path} of rank {rank} is {why} after "
                "every process said it was written; is another build writing the same index? "
                "Build again."
            )
        coord.heartbeat()
        yield from shards


def build_dataset(job: DatasetJob, coord: Coordinator, measure_stream: MeasureStream, *,
                  previous: PreviousIndex | None, progress: Callable | None,
                  log: Callable[[str], None]) -> Outcome:
    """Builds one dataset's index with every process of ``coord`` (all must call it)."""
    counts = [c for _, c in job.reader.shards]
    positions = split_shards(counts, coord.world_size)[coord.rank]
    mine = sum(counts[p] for p in positions)
    advance = _Progress(job, coord, progress, mine, sum(counts))
    if not coord.distributed:
        return _write(job, shard_lengths(job, positions, measure_stream, previous, advance))
    try:
        _own_part(job, coord, positions, measure_stream, previous, advance, log)
    except BaseException as e:
        coord.failed(str(e) or type(e).__name__)
        raise
    coord.part_done(job.tag)
    if coord.rank != 0:
        coord.wait_merged(job.tag)
        result = json.loads(coord.store.get(f"{job.tag}/outcome").decode())
        summary = IndexSummary(Path(result["path"]), result["uuid"], result["samples"],
                               result["total_tokens"])
        return Outcome(summary, result["measured"], [])
    try:
        coord.wait_parts(job.tag, advance.tick)
        advance.tick(final=True)
        wall, cpu = time.perf_counter(), time.process_time()
        outcome = _write(job, _merged_parts(job, coord))
        _remove_parts(job, log)
        log(f"length index: merged {coord.world_size} parts, {outcome.summary.samples} samples, "
            f"into {job.target.name} and the split's lengths file in "
            f"{time.perf_counter() - wall:.2f} s ({time.process_time() - cpu:.2f} s CPU)")
    except BaseException as e:
        coord.merged(job.tag, str(e) or type(e).__name__)
        raise
    s = outcome.summary
    coord.store.set(f"{job.tag}/outcome", json.dumps(
        {"path": str(s.path), "uuid": s.uuid, "samples": s.samples, "total_tokens": s.total_tokens,
         "measured": outcome.measured}))
    coord.merged(job.tag, None)
    return outcome


def _own_part(job: DatasetJob, coord: Coordinator, positions: range,
              measure_stream: MeasureStream, previous: PreviousIndex | None,
              advance: _Progress, log: Callable[[str], None]) -> None:
    """Writes this process's part, or reuses the one a killed build left."""
    path = part_path(job.target, coord.rank, coord.world_size)
    expect = [(p, job.reader.shards[p][0]) for p in positions]
    found, why = load_part(path, job.owner, expect)
    if found is not None:
        samples = sum(len(s.keys) for s in found)
        log(f"length index: reusing {path.name} ({samples} samples of {len(found)} shards, "
            "content digest verified)")
        advance(samples)
        return
    if why != "absent":
        log(f"length index: not reusing {path.name}: it is {why}; measuring its shards again")
    wall, cpu = time.perf_counter(), time.process_time()
    shards = list(shard_lengths(job, positions, measure_stream, previous, advance))
    write_part(path, job.owner, shards)
    measured = sum(len(s.keys) for s in shards if s.measured)
    log(f"length index: wrote {path.name}: {sum(len(s.keys) for s in shards)} samples of "
        f"{len(shards)} shards, {measured} measured, in {time.perf_counter() - wall:.2f} s "
        f"({time.process_time() - cpu:.2f} s CPU of this process)")


def _remove_parts(job: DatasetJob, log: Callable[[str], None]) -> None:
    """After the merge: removes this build's parts and those of other builds (one log line)."""
    world = job.owner.world_size
    others = [p for p in part_files(job.target) if not p.name.endswith(f"-of-{world}")]
    if others:
        log(f"length index: removing {len(others)} part(s) of a build by another number of "
            f"processes ({others[0].name}, ...): never merged with this build's")
    for p in part_files(job.target):
        p.unlink(missing_ok=True)


class _Progress:
    """This process's bar (``progress(label, samples)``), the shared counter, and on rank 0
    of a distributed build the combined bar of every process."""

    def __init__(self, job: DatasetJob, coord: Coordinator, progress: Callable | None,
                 mine: int, total: int):
        self.job, self.coord = job, coord
        label = job.label if not coord.distributed else (
            f"{job.label} [rank {coord.rank}/{coord.world_size}]")
        self.own = progress(label, mine) if progress is not None else None
        self.all = (progress(f"{job.label} [all {coord.world_size} processes]", total)
                    if progress is not None and coord.distributed and coord.rank == 0 else None)
        self.shown, self.last = 0, 0.0

    def __call__(self, n: int) -> None:
        if self.own is not None:
            self.own(n)
        self.coord.progress(self.job.tag, n)
        self.tick()

    def tick(self, final: bool = False) -> None:
        if self.all is None or (not final and time.monotonic() - self.last < 0.5):
            return
        self.last = time.monotonic()
        seen = self.coord.measured(self.job.tag)
        if seen > self.shown:
            self.all(seen - self.shown)
            self.shown = seen

