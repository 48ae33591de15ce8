"""The upcoming draws of each source in a packed window, fetched on demand.

A packed plan does not know beforehand how many samples a step (or window) takes: its search
(:mod:`.pack_search`) reads the draws' lengths a count would bring, and the plan then takes the
count it settled on (:meth:`SourceDraws.take`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .cursor import draws

__all__ = ["SourceDraws", "cut_lengths"]


class SourceDraws:
    """The upcoming draws of one source in a window: lengths cut to a cap, fetched on demand."""

    def __init__(self, seed: int, source: int, lengths: np.ndarray, first: int):
        self.seed, self.source, self.lengths, self.first = seed, source, lengths, int(first)
        self.index = np.empty(0, dtype=np.int32 if len(lengths) < 2**31 else np.int64)
        self.length = np.empty(0)

    def ensure(self, count: int) -> None:
        have = len(self.index)
        if count <= have:
            return
        more = max(int(count) - have, have, 256)
        ix = draws(self.seed, self.source, len(self.lengths), self.first + have, more)
        # indices within the source in __init__'s dtype: int32 where they fit (a packed step of
        # 16,384 ranks x 8 draws about a million samples; the search holds up to twice that)
        self.index = np.concatenate((self.index, ix.astype(self.index.dtype, copy=False)))
        # gather, then convert: converting the source first copied all of its lengths (a
        # 10^8-sample lengths file: 800 MiB) at every call
        self.length = np.concatenate((self.length, np.asarray(self.lengths)[ix].astype(np.float64)))

    def keep(self, count: int) -> None:
        """Drops the fetched draws beyond the first ``count`` (a search probed further than it
        takes: they are fetched again if asked for, the same draws)."""
        if len(self.index) > count:
            self.index = self.index[:count].copy()
            self.length = self.length[:count].copy()

    def take(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Removes and returns the next ``count`` draws (indices as int64, lengths)."""
        self.ensure(count)
        ix, ln = self.index[:count].astype(np.int64), self.length[:count]
        self.index, self.length = self.index[count:], self.length[count:]
        self.first += count
        return ix, ln


def cut_lengths(streams: Sequence[SourceDraws], counts: np.ndarray, cap: int) -> np.ndarray:
    """The first ``counts[s]`` upcoming draws' lengths of every source, in source order, each
    cut to ``cap`` (float64), written in place (no per-source temporaries)."""
    c = [int(k) for k in counts]
    out = np.empty(sum(c))
    lo = 0
    for s, k in enumerate(c):
        streams[s].ensure(k)
        np.minimum(streams[s].length[:k], cap, out=out[lo:lo + k])
        lo += k
    return out
