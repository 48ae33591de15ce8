"""Global sample ids of the planned order: one flat integer per sample of every source.

The sources are numbered in the order the plan is given them (the metadataset's order);
source s holds ``sizes[s]`` samples, numbered ``0..sizes[s]-1`` in Energon's sample index order
of that dataset (the row order of its ``.nv-meta/index.sqlite``, which the length index
follows). The global id of sample i of source s is ``offsets[s] + i`` with
``offsets[s] = sizes[0] + ... + sizes[s-1]``: a single int64 per sample, dense in
``[0, total)``, that a plan stores and a reader decodes with :meth:`SampleIds.split`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from energon_ordering.errors import OrderingConfigError, show

__all__ = ["SampleIds"]


#: Sources up to which :meth:`SampleIds.source_counts` compares ids with each source's end
#: (S - 1 passes) rather than searching each id's source (a binary search and a count per id).
_COMPARED_SOURCES = 8


@dataclass(frozen=True)
class SampleIds:
    """The id space of a list of sources.

    Attributes:
        sizes: Samples per source (each >= 1).
    """

    sizes: tuple[int, ...]

    @classmethod
    def of(cls, sizes: Sequence[int]) -> SampleIds:
        sizes = tuple(int(n) for n in sizes)
        if not sizes or min(sizes) < 1:
            raise OrderingConfigError(
                f"planned order: source sizes = {show(sizes)}; every source needs at least one "
                "sample (give each dataset of the blend a non-empty train split)."
            )
        return cls(sizes)

    @property
    def offsets(self) -> np.ndarray:
        """First global id of each source (int64)."""
        return np.concatenate(([0], np.cumsum(self.sizes[:-1], dtype=np.int64))).astype(np.int64)

    @property
    def total(self) -> int:
        return int(sum(self.sizes))

    def join(self, sources: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Global ids of ``(source, index within source)`` pairs."""
        offsets = self.offsets[np.asarray(sources, dtype=np.int64)]
        return offsets + np.asarray(indices, dtype=np.int64)

    def source_counts(self, rows: np.ndarray) -> np.ndarray:
        """``[n, S]``: how many ids of each source each row of ``rows`` ``[n, m]`` (ids in
        range) holds."""
        r = np.asarray(rows)
        S = len(self.sizes)
        if S <= _COMPARED_SOURCES:  # ids below each source's end, row by row: no per-id search
            below = np.empty((len(r), S + 1), dtype=np.int64)
            below[:, 0] = 0
            for s, end in enumerate(np.cumsum(self.sizes)[:-1].tolist()):
                below[:, s + 1] = np.count_nonzero(r < end, axis=1)
            below[:, S] = r.shape[1]
            return np.diff(below, axis=1)
        src = np.searchsorted(np.cumsum(self.sizes), r, side="right")
        src += (np.arange(len(r)) * S)[:, None]
        return np.bincount(src.reshape(-1), minlength=len(r) * S).reshape(-1, S)

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, index within source)`` of global ids (the inverse of :meth:`join`)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.total):
            raise ValueError(f"SampleIds.split: ids must lie in [0, {self.total}).")
        sources = np.searchsorted(np.cumsum(self.sizes), ids, side="right")
        return sources, ids - self.offsets[sources]
