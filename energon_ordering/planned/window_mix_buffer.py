"""The window mix's plan built in the memory of its output.

:func:`~.window_mix.mix_window` followed by :func:`~.window_mix.deal_bands` (the reference)
holds the whole window several times at once: its ids, lengths, sources and ages in draw
order, the sort's order and slots, the steps' ids and lengths, the dealt positions and the plan.
That is about 45-50 bytes a sample without the warmup's caps and 80-90 with them (1,048,576
samples, ``tools/bench_planned.py``'s mixes), so the window a loader worker can afford at
64 MiB is short where the global batch is large (16,384 ranks x 1 x 4: 16 steps, idle 9-11%
per step).

:func:`plan_mix_in_buffer` computes the same plan (every id in place, the per-step counts and
the next cursor, for the same inputs) in one int64 buffer of the plan's size, plus temporaries
of :data:`~.window_mix.CHUNK_SAMPLES` samples:

1. **Bands as keys.** Without caps, a group's samples are drawn straight into its part of the
   buffer, their ids copied out (4 bytes a sample) with their lengths (2 bytes: a length from
   2^16 - 1 tokens up counts as 2^16 - 1), and the part overwritten with the keys
   ``length << id_bits | id`` sorted by length, ties in draw order: a counting sort
   (:func:`~.sort_order.scatter_by_length`), then the samples counted at the top, which are
   the last ones, sorted by their own lengths (a long context's few). Band b (to step
   ``steps[b]``, :func:`~.window_mix.band_order`) is the sorted keys ``[b G, (b + 1) G)``:
   the reference's order.
2. **Under caps** the group's candidates are held in draw order (id, age, length: 24 bytes a
   sample) with the sweep's sort as ``length << 24 | position`` (8 more; counted as in 1 where
   every length is below 2^16 tokens, into a new array: 10 more while it is built). The
   sweep's slots ``u_i`` rise strictly with the sorted position i (each is ``i +`` a running
   maximum), so the samples that overflow are the sorted suffix from the first ``u_i >= n``,
   found chunk by chunk; deferral and the forced placement follow the reference's rules. The
   placed rows are written to the buffer as keys ``length << id_bits | id`` in the reference's
   row order (by length, ties by draw order or, where the forced placement mixes in, by slot).
3. **Dealt in place.** Chunks of bands are read off the buffer (ids, lengths, per-step
   counts), dealt by the reference's own ``_deal_steps`` (each step's dealing depends on its
   row, K and the window's tokens only) and their plan rows written back over their keys;
   then the blocks are permuted in place from band order to step order.

Lengths must be whole, >= 0 and fit the keys (token counts always do); otherwise, or where a
group holds over 2^24 samples under caps, :func:`plan_mix_in_buffer` returns None and the
caller plans with the reference (whose sums of fractional lengths depend on their order).
``tests/test_window_mix_buffer.py`` checks the two agree on random windows with and without
caps, schedule groups, deferral, forced placement and carried-over deferred samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import window_mix
from .cursor import PlanCursor
from .sample_ids import SampleIds
from .sort_order import COUNTED_LENGTHS, scatter_by_length, whole_int64
from .window_mix import CHUNK_SAMPLES, _Candidates, _deal_steps, band_order, window_counts

__all__ = ["plan_mix_in_buffer"]

#: The largest length code of the counting sort: longer lengths count as it, and are sorted
#: after it by their own lengths (:func:`_sort_tail`).
_TOP_CODE = COUNTED_LENGTHS - 1
#: Bits of a sample's position in a capped group's sort key (the reference's stable sort of
#: lengths packs the same ``length << 24 | position``).
_POSITION_BITS = 24


class _NotWhole(Exception):
    """A length that is not a whole number of tokens that fits a key: plan with the
    reference."""


def plan_mix_in_buffer(lengths: Sequence[np.ndarray], *, seed: int, cursor: PlanCursor,
                       weights: np.ndarray, caps: np.ndarray | None, world_size: int,
                       micro_batch: int, micro_batches_per_step: int, defer: bool = True,
                       out: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray, PlanCursor] | None:
    """The window-mix plan of :func:`~.window.plan_window` (``mix="window"``) in one buffer.

    Args:
        lengths, seed, cursor, weights, caps, defer: As :func:`~.window_mix.mix_window`.
        world_size, micro_batch, micro_batches_per_step: R, B, M.
        out: A C-contiguous int64 array of ``K R M B`` elements to build the plan in (None: a
            new one).

    Returns:
        ``(ids [K, R, M, B] (a view of out), counts [K, S], next cursor)``, or None where a
        length is not whole or does not fit a key (the caller plans with the reference).
    """
    ids = SampleIds.of([len(x) for x in lengths])
    S = len(ids.sizes)
    w = np.asarray(weights, dtype=np.float64)
    K = w.shape[0]
    R, M, B = int(world_size), int(micro_batches_per_step), int(micro_batch)
    G = R * M * B
    n = K * G
    if out is None:
        buf = np.empty(n, dtype=np.int64)
    else:
        if out.dtype != np.int64 or out.size != n or not out.flags.c_contiguous:
            raise ValueError(f"plan_mix_in_buffer: out must be C-contiguous int64 of {n} "
                             f"elements, got {out.dtype} of {out.size}")
        buf = out.reshape(-1)
    bits = max(1, int(ids.total - 1).bit_length())
    if bits > 62:
        return None
    group_of_step, split, carry = window_counts(w, G, cursor.carry)
    owner, _ = ids.split(np.asarray(cursor.deferred, dtype=np.int64))
    D = len(cursor.deferred)
    offsets = ids.offsets.tolist()
    streams = [_Candidates(seed, s, ids.sizes[s], offsets[s], cursor.drawn[s],
                           [(a, g) for a, (g, o) in enumerate(zip(cursor.deferred, owner))
                            if o == s]) for s in range(S)]
    block_of_step = np.empty(K, dtype=np.int64)
    deferred: list[tuple[int, int]] = []
    tokens = 0
    block = 0
    try:
        for g in range(len(split)):
            steps = band_order(caps, np.flatnonzero(group_of_step == g), seed, cursor.window, K)
            seg = buf[block * G:(block + len(steps)) * G]
            if caps is None:
                tokens += _draw_sorted(seg, streams, split[g], D, lengths, ids, bits)
            else:
                band_caps = np.asarray(caps, dtype=np.float64)[steps]
                tokens += _place_capped(seg, streams, split[g], D, lengths, ids, band_caps, G,
                                        bits, defer, deferred)
            block_of_step[steps] = block + np.arange(len(steps))
            block += len(steps)
    except _NotWhole:
        return None
    counts = _deal_in_place(buf, block_of_step, ids, bits, float(max(tokens, 1)), R, M, B)
    _blocks_to_steps(buf.reshape(K, G), block_of_step)
    left = [item for c in streams for item in c.left_over()] + deferred
    left.sort()
    nxt = PlanCursor(cursor.window + 1,
                     tuple(int(cursor.drawn[s] + streams[s].pulled) for s in range(S)),
                     tuple(float(c) for c in carry), tuple(int(g) for _, g in left))
    return buf.reshape(K, R, M, B), counts, nxt


def _whole(values: np.ndarray, limit: int) -> np.ndarray:
    """``values`` as int64, or :class:`_NotWhole` unless every one is whole, >= 0 and below
    ``limit`` (the reference's test for sorting by keys, :func:`~.sort_order.whole_int64`)."""
    out = whole_int64(values, limit)
    if out is None:
        raise _NotWhole
    return out


def _whole_top(values: np.ndarray, limit: int) -> tuple[np.ndarray, int]:
    """``(values, their largest)``: integer lengths as they are (checked in range), others as
    :func:`_whole` gives them; the largest -1 where there are none."""
    if not len(values):
        return values, -1
    if values.dtype.kind in "iu":
        low, top = int(values.min()), int(values.max())
        if low < 0 or top >= limit:
            raise _NotWhole
        return values, top
    out = _whole(values, limit)
    return out, int(out.max())


def _draw_sorted(seg: np.ndarray, streams: list[_Candidates], counts: np.ndarray,
                 age_base: int, lengths: Sequence[np.ndarray], ids: SampleIds, bits: int) -> int:
    """Draws a group's candidates and writes them to ``seg`` as keys ``length << bits | id``
    sorted by length, ties in draw order (source by source); returns their tokens.

    The draws go to ``seg`` first, then their ids to a compact copy (4 bytes a sample below
    2^31 ids) and their lengths to 2 bytes each, counted up to :data:`_TOP_CODE` (longer
    lengths count as it); ``seg`` takes the keys by a counting sort
    (:func:`~.sort_order.scatter_by_length`). The samples counted at the top code are the last
    ones, in draw order, and are then sorted by their own lengths (:func:`_sort_tail`)."""
    n = len(seg)
    if bits > 47:
        raise _NotWhole  # no room beside the ids for a counted length (2^47 samples)
    limit = 1 << (63 - bits)
    short = np.empty(n, dtype=np.uint16)
    tail = 0  # samples counted at the top code
    tokens, lo = 0, 0
    for s, k in enumerate(np.asarray(counts, dtype=np.int64).tolist()):
        part = seg[lo:lo + k]
        streams[s].take(k, age_base, part, None)
        src = np.asarray(lengths[s])
        for a in range(0, k, CHUNK_SAMPLES):
            L, top = _whole_top(src[part[a:a + CHUNK_SAMPLES] - streams[s].offset], limit)
            tokens += int(L.sum(dtype=np.int64))
            if top >= _TOP_CODE:
                tail += int(np.count_nonzero(L >= _TOP_CODE))
                L = np.minimum(L, _TOP_CODE)
            short[lo + a:lo + a + len(L)] = L
        lo += k
    gid = seg.astype(_id_dtype(ids))
    scatter_by_length(short, gid, bits, seg)
    del short, gid
    if tail:
        _sort_tail(seg[n - tail:], lengths, ids, bits)
    return tokens


def _id_dtype(ids: SampleIds) -> type:
    """The dtype of a compact copy of ids: int32 below 2^31 ids, else int64."""
    return np.int32 if ids.total <= np.iinfo(np.int32).max else np.int64


def _sort_tail(tail: np.ndarray, lengths: Sequence[np.ndarray], ids: SampleIds,
               bits: int) -> None:
    """``tail``'s keys ``code << bits | id`` (in draw order) rewritten as ``length << bits |
    id`` sorted by each sample's own length, ties in draw order: the keys ``length << p |
    position`` sorted in place, each position's id read back from a compact copy."""
    t = len(tail)
    mask = (1 << bits) - 1
    gid = np.empty(t, dtype=_id_dtype(ids))
    np.bitwise_and(tail, mask, out=gid, casting="unsafe")
    p = max(1, (t - 1).bit_length())
    limit = 1 << (63 - max(bits, p))
    for a in range(0, t, CHUNK_SAMPLES):
        g = gid[a:a + CHUNK_SAMPLES].astype(np.int64)
        source, local = ids.split(g)
        L = np.empty(len(g), dtype=np.int64)
        for s in np.unique(source).tolist():
            at = source == s
            L[at] = _whole(np.asarray(lengths[s])[local[at]], limit)
        L <<= p
        L |= np.arange(a, a + len(g), dtype=np.int64)
        tail[a:a + len(g)] = L
    tail.sort()
    for a in range(0, t, CHUNK_SAMPLES):
        tail[a:a + CHUNK_SAMPLES] = _row_keys(tail[a:a + CHUNK_SAMPLES], gid, bits, p)


def _gather(streams: list[_Candidates], counts: np.ndarray, age_base: int,
            lengths: Sequence[np.ndarray], limit: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The next ``counts[s]`` candidates of every source in draw order: ``(id, age, length)``
    (the reference's ``_gather`` without the source column, lengths as int64)."""
    c = np.asarray(counts, dtype=np.int64)
    total = int(c.sum())
    gid = np.empty(total, dtype=np.int64)
    age = np.empty(total, dtype=np.int64)
    L = np.empty(total, dtype=np.int64)
    lo = 0
    for s, k in enumerate(c.tolist()):
        streams[s].take(k, age_base, gid[lo:lo + k], age[lo:lo + k])
        src = np.asarray(lengths[s])
        for a in range(lo, lo + k, CHUNK_SAMPLES):
            b = min(a + CHUNK_SAMPLES, lo + k)
            L[a:b] = _whole(src[gid[a:b] - streams[s].offset], limit)
        lo += k
    return gid, age, L


def _sorted_by_length(L: np.ndarray) -> np.ndarray:
    """The keys ``length << 24 | position`` of the int64 lengths ``L``, sorted: the order of
    ``np.argsort(L, kind="stable")`` (a counting sort into a new array where every length is
    below 2^16, else ``L`` itself turned into the keys and sorted)."""
    if len(L) and int(L.max()) < COUNTED_LENGTHS:
        out = np.empty_like(L)
        scatter_by_length(L.astype(np.uint16), None, _POSITION_BITS, out)
        return out
    L <<= _POSITION_BITS
    for a in range(0, len(L), CHUNK_SAMPLES):
        L[a:a + CHUNK_SAMPLES] |= np.arange(a, min(a + CHUNK_SAMPLES, len(L)), dtype=np.int64)
    L.sort()
    return L


def _lengths_by_position(key: np.ndarray) -> np.ndarray:
    """The lengths in draw order again, from :func:`_sorted_by_length`'s keys."""
    L = np.empty(len(key), dtype=np.int64)
    for a in range(0, len(key), CHUNK_SAMPLES):
        k = key[a:a + CHUNK_SAMPLES]
        L[k & ((1 << _POSITION_BITS) - 1)] = k >> _POSITION_BITS
    return L


def _row_keys(key: np.ndarray, gid: np.ndarray, bits: int,
              position_bits: int = _POSITION_BITS) -> np.ndarray:
    """Row keys ``length << bits | id`` of sorted keys ``length << position_bits | position``
    (``gid``: the id at each position)."""
    out = key >> position_bits
    out <<= bits
    out |= gid[key & ((1 << position_bits) - 1)]
    return out


def _first_overflow(key: np.ndarray, band_caps: np.ndarray, G: int,
                    seg: np.ndarray | None = None, gid: np.ndarray | None = None,
                    bits: int = 0) -> int:
    """The first sorted position whose sweep slot ``u_i`` (the reference's ``_sweep``) is past
    the group's ``n`` slots (n: none overflows); with ``seg``, also writes each sample placed
    to its slot, as a row key (:func:`_row_keys` with ``gid`` and ``bits``)."""
    n = len(key)
    running = np.iinfo(np.int64).min
    for a in range(0, n, CHUNK_SAMPLES):
        i = np.arange(a, min(a + CHUNK_SAMPLES, n), dtype=np.int64)
        u = np.searchsorted(band_caps, key[a:a + len(i)] >> _POSITION_BITS, "left")
        u *= G
        u -= i
        np.maximum.accumulate(u, out=u)
        np.maximum(u, running, out=u)
        running = int(u[-1])
        u += i
        over = int(np.searchsorted(u, n, "left"))  # u rises strictly
        if seg is not None:
            seg[u[:over]] = _row_keys(key[a:a + over], gid, bits)
        if over < len(i):
            return a + over
    return n


def _place_capped(seg: np.ndarray, streams: list[_Candidates], counts: np.ndarray,
                  age_base: int, lengths: Sequence[np.ndarray], ids: SampleIds,
                  band_caps: np.ndarray, G: int, bits: int, defer: bool,
                  deferred: list[tuple[int, int]]) -> int:
    """A capped group's bands, written to ``seg`` as keys ``length << bits | id`` in each band's
    row order (the reference's sweep, deferral and forced placement); returns their tokens."""
    n = len(seg)
    if n > (1 << _POSITION_BITS):
        raise _NotWhole  # the reference sorts these stably otherwise: not worth a second path
    limit = 1 << (63 - max(bits, _POSITION_BITS))
    S = len(ids.sizes)
    gid, age, L = _gather(streams, counts, age_base, lengths, limit)
    rounds = window_mix.DEFER_ROUNDS  # (read here: the deferral's limits are the reference's)
    for round_ in range(rounds + 1):
        key = _sorted_by_length(L)
        del L
        first = _first_overflow(key, band_caps, G)
        room = (window_mix.MAX_DEFERRED - len(deferred)
                - sum(len(c.left_over()) for c in streams) if defer else 0)
        if first == n or round_ == rounds or room <= 0:
            break
        over = np.sort(key[first:] & ((1 << _POSITION_BITS) - 1))  # positions, ascending
        over = over[np.argsort(age[over], kind="stable")][:room]
        deferred += list(zip(age[over].tolist(), gid[over].tolist()))
        keep = np.ones(n, dtype=bool)
        keep[over] = False
        L = _lengths_by_position(key)
        del key
        more = _gather(streams, np.bincount(ids.split(gid[over])[0], minlength=S), age_base,
                       lengths, limit)
        kept = n - len(over)  # the kept samples in draw order, then their replacements
        for a, b in zip((gid, age, L), more):
            a[:kept] = a[keep]
            a[kept:] = b
        del keep, more
    del age
    tokens = 0
    for a in range(0, n, CHUNK_SAMPLES):
        tokens += int((key[a:a + CHUNK_SAMPLES] >> _POSITION_BITS).sum())
    if first == n:  # the bands are the sorted samples
        for a in range(0, n, CHUNK_SAMPLES):
            seg[a:a + CHUNK_SAMPLES] = _row_keys(key[a:a + CHUNK_SAMPLES], gid, bits)
        return tokens
    # forced: each placed sample to its slot, then the overflowing suffix (longest last) into
    # the free slots in ascending order. The reference then orders each band by length, ties by
    # slot; that is the slot order already: a band's placed samples fill its first slots (a
    # slot after a free one starts a band: u jumps only to a band's start), ascending in
    # length, and the suffix is at least as long as every placed sample.
    seg[:] = -1  # keys are >= 0: -1 marks a free slot
    _first_overflow(key, band_caps, G, seg, gid, bits)
    free = np.flatnonzero(seg < 0)
    for a in range(0, len(free), CHUNK_SAMPLES):
        seg[free[a:a + CHUNK_SAMPLES]] = _row_keys(key[first + a:first + a + CHUNK_SAMPLES],
                                                   gid, bits)
    return tokens


def _deal_in_place(buf: np.ndarray, block_of_step: np.ndarray, ids: SampleIds, bits: int,
                   tokens: float, R: int, M: int, B: int) -> np.ndarray:
    """Deals every band block of ``buf`` (keys ``length << bits | id`` in row order) and writes
    its ``[R, M, B]`` ids over it; returns the ``[K, S]`` counts per step."""
    K = len(block_of_step)
    G = R * M * B
    S = len(ids.sizes)
    counts = np.empty((K, S), dtype=np.int64)
    step_of_block = np.empty(K, dtype=np.int64)
    step_of_block[block_of_step] = np.arange(K)
    mask = (1 << bits) - 1
    chunk = max(1, CHUNK_SAMPLES // G)
    blocks = buf.reshape(K, G)
    for lo in range(0, K, chunk):
        rows = blocks[lo:lo + chunk]
        L = (rows >> bits).astype(np.float64)
        pos = _deal_steps(L, K, tokens, R, B, M)
        del L
        gid = rows & mask  # (after the dealing: one step may be 2^19 samples, 4 MiB a copy)
        steps = step_of_block[lo:lo + len(rows)]
        counts[steps] = G if S == 1 else ids.source_counts(gid)
        for t in range(len(rows)):
            np.take(gid[t], pos[t], out=rows[t].reshape(R, M, B), mode="clip")  # in range
        del gid, pos
    return counts


def _blocks_to_steps(blocks: np.ndarray, block_of_step: np.ndarray) -> None:
    """Moves ``blocks`` ``[K, G]`` in place so that row t holds what row ``block_of_step[t]``
    held (cycle by cycle, one row of temporary)."""
    K = len(block_of_step)
    if blocks.size <= CHUNK_SAMPLES:
        blocks[:] = blocks[block_of_step]
        return
    done = block_of_step == np.arange(K)
    tmp = np.empty(blocks.shape[1], dtype=blocks.dtype)
    for start in np.flatnonzero(~done).tolist():
        if done[start]:
            continue
        tmp[:] = blocks[start]
        t = start
        while True:
            done[t] = True
            src = int(block_of_step[t])
            if src == start:
                blocks[t] = tmp
                break
            blocks[t] = blocks[src]
            t = src
