"""The part of a length index one process of a distributed build measured, as a file.

Each process writes ``<index file>.part-<rank>-of-<world size>`` beside the index (under a
temporary name, then renamed: a part is whole or absent), then rank 0 merges the parts. A part
is JSON: what it belongs to (the dataset's ``index.uuid``, the split, what computed the lengths,
the world size and rank, the package version and :data:`PART_FORMAT`), its shards (position in
the split, name, content digest, size, modification time, the samples' keys and lengths) and a
digest of all that (``content_digest``). A rerun after a lost process reuses every part whose
digest, belonging and shards are this build's (:func:`load_part` says why it cannot otherwise);
a part written by another package version is refused (its lengths may be computed otherwise).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from energon_ordering.errors import LengthIndexError, show

__all__ = ["PART_FORMAT", "PartOwner", "ShardLengths", "load_part", "part_path", "part_files",
           "write_part"]

#: Version of the part layout.
PART_FORMAT = 1


@dataclass(frozen=True)
class PartOwner:
    """What a part belongs to; a part of another owner is never merged."""

    package_version: str
    dataset_uuid: str
    split_part: str
    computed_by: str
    world_size: int
    rank: int


@dataclass(frozen=True)
class ShardLengths:
    """One shard's lengths: its position in the split, file name and stamp, its samples' keys
    and lengths in shard order, the keys indexed with length 0 because they failed
    (``skip_bad_samples``), and whether they were measured (False: reused from an index)."""

    position: int
    name: str
    digest: str
    size: int
    mtime_ns: int
    keys: list[str]
    lengths: list[float]
    skipped: list[str] = field(default_factory=list)
    measured: bool = True


def part_path(index_file: Path, rank: int, world_size: int) -> Path:
    """The part of ``rank`` of a build by ``world_size`` processes of ``index_file``."""
    return index_file.with_name(f"{index_file.name}.part-{rank}-of-{world_size}")


def part_files(index_file: Path) -> list[Path]:
    """Every part of ``index_file`` present, of any world size (temporary files excluded)."""
    return sorted(p for p in index_file.parent.glob(f"{index_file.name}.part-*-of-*")
                  if ".tmp-" not in p.name)


def _digest(body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def write_part(path: Path, owner: PartOwner, shards: list[ShardLengths]) -> None:
    """Writes a part atomically (temporary name, then ``os.replace``)."""
    body = {"format": PART_FORMAT, "owner": asdict(owner), "shards": [asdict(s) for s in shards]}
    text = json.dumps({**body, "content_digest": _digest(body)}, sort_keys=True)
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise LengthIndexError(
            f"length index: cannot write the part {path} ({e}); the index folder must be "
            "writable by every process (or give a shared writable --index-dir)."
        ) from e


def load_part(path: Path, owner: PartOwner,
              shards: list[tuple[int, str]]) -> tuple[list[ShardLengths] | None, str]:
    """The shards of the part at ``path`` if it is this build's, else None and why not.

    Args:
        owner: What the part must belong to.
        shards: ``(position, name)`` of the shards the part must hold, in order.

    Raises:
        LengthIndexError: The part was written by another package version.
    """
    try:
        record = json.loads(path.read_text())
        body = {k: record[k] for k in ("format", "owner", "shards")}
        found = record["content_digest"]
    except FileNotFoundError:
        return None, "absent"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"unreadable ({type(e).__name__})"
    theirs = body["owner"] if isinstance(body["owner"], dict) else {}
    if theirs.get("package_version") != owner.package_version or body["format"] != PART_FORMAT:
        raise LengthIndexError(
            f"length index: the part {path} was written by energon-ordering "
            f"{show(theirs.get('package_version'))} (part format {show(body['format'])}), this is "
            f"{owner.package_version} (format {PART_FORMAT}); its lengths may be computed "
            f"otherwise. Delete the parts (rm {path.parent}/{path.name.split('.part-')[0]}"
            ".part-*) and build again."
        )
    if _digest(body) != found:
        return None, "its content digest does not match (damaged)"
    for name, value in asdict(owner).items():
        if theirs.get(name) != value:
            return None, f"of another build ({name} {show(theirs.get(name))}, now {show(value)})"
    try:
        parsed = [ShardLengths(**s) for s in body["shards"]]
    except TypeError as e:
        return None, f"malformed ({e})"
    if [(s.position, s.name) for s in parsed] != shards:
        return None, "of another split of the shards"
    return parsed, "reused"
