"""Filling packs: items -> the P packs of ``cap`` tokens of each of R ranks, ranks balanced.

:func:`fill_packs` packs a step's (or a window's) items: every pack seeded with one of the
longest, the others longest first, each to the rank with the smallest attention cost
``sum(L + L^2/4096)`` so far, into that rank's cheapest pack with room (longest-processing-time
dealing, vectorised in rounds), so ranks' costs agree to within about one item's cost and a
rank's packs fill evenly. :func:`pack_fill` also returns the packing (:class:`Packing`: the
ranks' costs), which the count search (:mod:`.pack_search`) reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .balance import radix_keys, sample_cost
from .lpt import deal_tuples
from .sort_order import COST_SCALE, runs_sort_kind, stable_argsort

__all__ = ["Packing", "fill_packs", "pack_fill"]


@dataclass
class Packing:
    """R ranks of P packs of ``cap`` tokens as filled so far.

    Attributes:
        cap: Tokens per pack.
        load: ``[R, P]`` tokens in each pack. pack_cost: ``[R, P]`` attention cost of each pack.
        rank_cost: ``[R]`` attention cost of each rank. room: ``[R]`` each rank's most room in
            one of its packs.
    """

    cap: float
    load: np.ndarray
    pack_cost: np.ndarray
    rank_cost: np.ndarray
    room: np.ndarray

    @classmethod
    def empty(cls, world_size: int, packs_per_rank: int, cap: float) -> Packing:
        R, P = int(world_size), int(packs_per_rank)
        return cls(float(cap), np.zeros((R, P)), np.zeros((R, P)), np.zeros(R),
                   np.full(R, float(cap)))

    @property
    def idle(self) -> float:
        """The ranks' straggler idle, ``1 - mean / max`` of their costs (0 when all are 0)."""
        top = float(self.rank_cost.max())
        return 1.0 - float(self.rank_cost.mean()) / top if top > 0 else 0.0

    @property
    def padding(self) -> float:
        """The packs' room left, as a share of their tokens (``R P cap``)."""
        return 1.0 - float(self.load.sum()) / (self.load.size * self.cap)

    @property
    def lost(self) -> float:
        """The compute the packing loses, idle per step + padding by tokens (DESIGN.md's lost
        compute: the ranks' costs sum their packs, so ``idle`` is per optimizer step)."""
        return self.idle + self.padding

    def seed(self, L: np.ndarray, first: np.ndarray, out: np.ndarray) -> None:
        """Every pack of an empty packing takes one of ``first`` (the ``R P`` longest items,
        longest first), dealt in tuples of R, the costliest to the cheapest rank: no pack stays
        empty, whatever is dealt after."""
        R, P = self.load.shape
        seat = deal_tuples(np.arange(R * P), sample_cost(L[first]), R, P)  # [R, P] -> position
        items = first[seat]
        out[items] = np.arange(R * P).reshape(R, P)
        self.load[:] = L[items]
        self.pack_cost[:] = sample_cost(L[items])
        self.rank_cost[:] = self.pack_cost.sum(axis=1)
        self.room[:] = self.cap - _row_min(self.load)

    def place(self, L: np.ndarray, queue: np.ndarray, out: np.ndarray) -> None:
        """Deals the items ``queue`` (indices into ``L``, longest first, ties by index) in
        rounds, writing each one's flat pack ``rank * P + pack`` into ``out`` (an item that fits
        no pack any more is left as it is in ``out``).

        The round's i-th item goes to the rank with the i-th smallest cost so far (ties by
        rank), into that rank's pack with the smallest cost among those with room for it (ties
        by pack). A round serves only the ranks with room for its longest item whose cost is
        within that item's cost of the cheapest such rank, so it deals as
        longest-processing-time dealing one item at a time would, vectorised. Whole lengths
        are dealt in exact integers (:class:`_WholeCosts`), others in floats: the same packs.
        """
        whole = _WholeCosts.of(self, L, queue)
        if whole is None:
            self._place_floats(L, queue, out)
        else:
            whole.place(queue, out)
            whole.write_back(self)

    def _place_floats(self, L: np.ndarray, queue: np.ndarray, out: np.ndarray) -> None:
        """:meth:`place` in float costs (lengths with fractions, or too long for
        :class:`_WholeCosts`)."""
        load, pcost, rcost, room = self.load, self.pack_cost, self.rank_cost, self.room
        cap = self.cap
        P = load.shape[1]
        # the queue's lengths, negated (ascending), read from ``head`` on: each round finds where
        # the items that still fit start without gathering the whole queue again
        neg = -L[queue]
        head = 0
        while head < len(queue):
            # the longest items fit no pack any more (rooms only shrink): they stay unplaced
            head += int(np.searchsorted(neg[head:], -room.max(), "left"))
            if head == len(queue):
                break
            big = queue[head]
            big_cost = float(sample_cost(L[big]))
            roomy = np.flatnonzero(room >= L[big])
            # the ranks with room within the longest item's cost of the cheapest of them take
            # one item each, cheapest first (ties by rank); only those few are sorted
            near = rcost[roomy]
            near = roomy[near <= near.min() + big_cost]
            near = near[stable_argsort(rcost[near])]
            items = queue[head:head + len(near)]
            head += len(items)
            ranks = near[:len(items)]
            # each item into its rank's cheapest pack with room (every rank here has room)
            li = L[items]
            rows = load[ranks]
            ok = (cap - rows) >= li[:, None]
            pk = np.argmin(np.where(ok, pcost[ranks], np.inf), axis=1)
            out[items] = ranks * P + pk
            at = np.arange(len(ranks))
            rows[at, pk] += li  # one item per rank in a round
            load[ranks, pk] = rows[at, pk]
            c = sample_cost(li)
            pcost[ranks, pk] += c
            rcost[ranks] += c
            room[ranks] = cap - _row_min(rows)


#: Lengths converted at once (bounds the float temporaries).
_CHUNK = 1 << 16


@dataclass
class _WholeCosts:
    """A packing's state in exact integers, for :meth:`Packing.place` on whole lengths.

    Float costs of whole lengths are multiples of 1/4096 far below 2^41, so they add exactly and
    compare as ``4096 L + L^2`` does in int64. That lets each comparison carry its tie-break in
    its low bits: a rank's key is ``cost << rank_bits | rank`` (so numpy's fast sort of the keys
    is the stable order of the costs), a pack's ``cost << pack_bits | pack`` (so the smallest key
    of a row is its cheapest pack, ties by pack). ``cheap`` caches each rank's cheapest pack: the
    item goes there when it has room, and only the others (about half the items of a window of
    1,024 ranks x 8 packs, most of them late in the fill) search their rank's packs. The queue's
    lengths are held once, negated, as int32 in queue order (a step of 16,384 ranks x 8 packs
    holds a million items): a round reads its items' lengths as a slice.
    """

    neg: np.ndarray  # [n] int32: -length of each queued item, in queue order (ascending)
    cap: int
    load: np.ndarray  # [R, P] int64 tokens
    pack_key: np.ndarray  # [R, P] int64: cost << pack_bits | pack
    rank_cost: np.ndarray  # [R] int64
    room: np.ndarray  # [R] int64
    cheap: np.ndarray  # [R] each rank's cheapest pack
    pack_bits: int
    rank_bits: int

    @classmethod
    def of(cls, packing: Packing, L: np.ndarray, queue: np.ndarray) -> _WholeCosts | None:
        """The packing in integers, or None where a length (or the cap) is not whole, or the
        keys could overflow (the packs' costs and all of the queue's must fit beside the
        tie-break bits)."""
        R, P = packing.load.shape
        if not len(queue) or float(packing.cap) != int(packing.cap):
            return None
        pack_bits = max(1, int(P - 1).bit_length())
        rank_bits = max(1, int(R - 1).bit_length())
        scaled = np.rint(packing.pack_cost * COST_SCALE)
        if not np.array_equal(scaled / COST_SCALE, packing.pack_cost):
            return None
        neg = np.empty(len(queue), dtype=np.int32)
        tokens = top = 0.0
        for lo in range(0, len(queue), _CHUNK):  # no float temporaries of the whole queue
            part = L[queue[lo:lo + _CHUNK]]
            if not (float(part.min()) >= 0 and float(part.max()) < 2**31):
                return None
            np.negative(part, out=part)
            neg[lo:lo + _CHUNK] = part
            if not np.array_equal(neg[lo:lo + _CHUNK], part):
                return None  # a fraction (or NaN)
            tokens -= float(part.sum())
            top = max(top, -float(part.min()))
        # every cost a pack or rank can reach is below all costs together, and those below
        # (4096 + the longest) x all tokens (L^2 <= max L x L)
        if float(scaled.sum()) + (COST_SCALE + top) * tokens >= 2.0 ** (
                62 - max(pack_bits, rank_bits)):
            return None
        pack_cost = scaled.astype(np.int64)
        pack_key = pack_cost << pack_bits
        pack_key |= np.arange(P, dtype=np.int64)
        load = packing.load.astype(np.int64)
        cap = int(packing.cap)
        return cls(neg, cap, load, pack_key, pack_cost.sum(axis=1), cap - _row_min(load),
                   _row_min(pack_key) & ((1 << pack_bits) - 1), pack_bits, rank_bits)

    def place(self, queue: np.ndarray, out: np.ndarray) -> None:
        """:meth:`Packing.place` (the same rounds, the same packs)."""
        neg, cap, load, key, rcost, room = (self.neg, self.cap, self.load, self.pack_key,
                                            self.rank_cost, self.room)
        P = load.shape[1]
        pmask, rbits = (1 << self.pack_bits) - 1, self.rank_bits
        flat_load, flat_key = load.reshape(-1), key.reshape(-1)
        runs = runs_sort_kind()  # (once, not every round)
        head = 0
        while head < len(queue):
            # the needle in the queue's dtype: an int64 one would convert the queue to int64
            head += int(np.searchsorted(neg[head:], np.int32(-room.max()), "left"))
            if head == len(queue):
                break
            big = -int(neg[head])
            roomy = np.flatnonzero(room >= big)
            near = rcost[roomy]
            near = roomy[near <= near.min() + big * COST_SCALE + big * big]
            order = rcost[near] << rbits
            order |= near
            # distinct keys: the stable order of the costs, sorted as runs (the near ranks'
            # costs come in runs: timsort merges them where numpy's sort is not vectorised,
            # 10% of a packing at 1,024 ranks)
            order.sort(kind=runs)
            n = min(len(near), len(queue) - head)
            items = queue[head:head + n]
            li = -neg[head:head + n].astype(np.int64)
            head += n
            ranks = order[:n] & ((1 << rbits) - 1)
            pk = self.cheap[ranks]
            flat = ranks * P + pk
            full = np.flatnonzero(flat_load[flat] + li > cap)
            if len(full):  # the cheapest pack has no room: the cheapest that has
                fr = ranks[full]
                k = np.where((cap - np.take(load, fr, axis=0)) >= li[full, None],
                             np.take(key, fr, axis=0), np.iinfo(np.int64).max)
                pk[full] = _row_min(k) & pmask
                flat[full] = fr * P + pk[full]
            out[items] = flat
            flat_load[flat] += li  # one item per rank in a round
            c = _scaled_cost(li)
            rcost[ranks] += c
            c <<= self.pack_bits
            flat_key[flat] += c
            # rows by np.take: 2x faster than fancy indexing of a 2-D array
            self.cheap[ranks] = _row_min(np.take(key, ranks, axis=0)) & pmask
            room[ranks] = cap - _row_min(np.take(load, ranks, axis=0))

    def write_back(self, packing: Packing) -> None:
        """The float state of ``packing`` (its costs exact: multiples of 1/4096)."""
        packing.load[:] = self.load
        packing.pack_cost[:] = (self.pack_key >> self.pack_bits) / COST_SCALE
        packing.rank_cost[:] = self.rank_cost / COST_SCALE
        packing.room[:] = self.room


def _scaled_cost(L: np.ndarray) -> np.ndarray:
    """``sample_cost(L) x COST_SCALE``, ``4096 L + L^2``, of whole lengths: exact in int64."""
    c = L * L
    c += L * COST_SCALE
    return c


def _row_min(x: np.ndarray) -> np.ndarray:
    """``x.min(axis=1)`` of an ``[n, P]`` array with few columns, column by column: numpy reduces
    a short last axis row by row, several times slower (the same values)."""
    m = x[:, 0].copy()
    for j in range(1, x.shape[1]):
        np.minimum(m, x[:, j], out=m)
    return m


def _index_dtype(*sizes: int) -> type:
    return np.int32 if max(sizes) < 2**31 else np.int64


def _longest_first(L: np.ndarray) -> np.ndarray:
    """Item indices, longest first, ties by index (whole lengths: a radix sort)."""
    keys = radix_keys(L)
    return np.argsort(-L if keys is None else np.uint16(65535) - keys, kind="stable")


def pack_fill(lengths: np.ndarray, world_size: int, packs_per_rank: int, cap: int
              ) -> tuple[np.ndarray, Packing]:
    """:func:`fill_packs`, also returning the packing (its ranks' costs)."""
    L = np.asarray(lengths, dtype=np.float64)
    R, P = int(world_size), int(packs_per_rank)
    index = _index_dtype(len(L), R * P)
    packing = Packing.empty(R, P, cap)
    out = np.full(len(L), -1, dtype=index)
    queue = _longest_first(L).astype(index, copy=False)
    if len(queue) >= R * P:
        packing.seed(L, queue[:R * P], out)
        queue = queue[R * P:]
    packing.place(L, queue, out)
    return out, packing


def fill_packs(lengths: np.ndarray, world_size: int, packs_per_rank: int, cap: int) -> np.ndarray:
    """Assigns items to the ``packs_per_rank`` packs of ``cap`` tokens of each of R ranks,
    balancing the ranks' attention costs.

    Every pack first takes one of the ``R P`` longest items (when there are that many), dealt
    in tuples of R as :func:`~.packs.deal_packs` deals packs; the others go longest first (ties
    by index), in rounds (:meth:`Packing.place`). An item that fits no pack any more stays
    unplaced.

    Args:
        lengths: Tokens of each item (already cut to ``cap``: longer items never fit).
        world_size: R. packs_per_rank: P (>= 1 each).
        cap: Tokens per pack.

    Returns:
        ``[n]`` flat pack index ``rank * P + pack`` of each item (int32 below 2^31 packs and
        items, else int64), -1 for an item no pack could take.

    Memory: the items' lengths, their order and the result (a packed step of 16,384 ranks x 8
    packs holds about a million items); each item's cost is computed where it is dealt.
    """
    return pack_fill(lengths, world_size, packs_per_rank, cap)[0]
