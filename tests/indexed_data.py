"""Synthetic prepared datasets whose every source has a length index (by
:class:`~energon_ordering.inspect.synthetic_task.IndexedSyntheticTaskEncoder`): the data of the
pre-encode pools' and the planned order's tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.build import build_length_index


def indexed_synthetic(root: Path, sources: Sequence[SourceSpec], *, shard_size: int,
                      workers: int = 1) -> Path:
    """``make_synthetic_dataset(root, sources)`` and each source's length index; returns the
    metadataset (a source's prepared folder is ``root / name``)."""
    meta = make_synthetic_dataset(root, sources, shard_size=shard_size)
    for spec in sources:
        build_length_index(Path(root) / spec.name, task_encoder=IndexedSyntheticTaskEncoder(),
                           workers=workers)
    return meta
