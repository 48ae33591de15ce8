"""A stable ascending order of a window's lengths, fast where the lengths are whole tokens.

Every rank must compute the same plan, so the plans sort stably (ties in index order, whatever
the machine's sorting code). ``np.argsort(kind="stable")`` of 2^20 float lengths takes about
80 ms, most of a window's plan. Whole lengths below 2^39 with fewer than 2^24 values are instead
packed with their index into one int64 key, ``length << 24 | index``: the keys are distinct, so
any sort orders them alike, and numpy's sort of the keys gives the stable order in about 9 ms
where it is vectorised (AVX-512 on Intel) and about 60 ms where it is not. Lengths with
fractions, negative or larger ones fall back to the stable argsort.

:func:`scatter_by_length` sorts a window's samples by length (ties in draw order) where every
length is below 2^16 tokens: a counting sort, chunk by chunk (numpy's radix sort of each chunk's
uint16 lengths, then a scatter to each sample's place among the window's), writing the keys
``length << bits | id`` straight into the plan's buffer. 2^22 samples: about 90 ms, where
numpy's sort of the same int64 keys takes 270 ms on a machine whose sort is not vectorised
(``tools/bench_planned.py`` prints the machine's sort speed).

:func:`stable_argsort` is ``np.argsort(kind="stable")`` of a 1-D array computed by numpy's
default sort, 5x faster on the rank costs a pack fill sorts every round (8,192 floats), the
same order wherever no two values tie; where some do, it sorts distinct keys (each value's rank
among the distinct values, then its index). (Rows of a dealing's running totals, which tie
often, take :func:`stable_argsort_rows` instead: there this extra pass cost more than it saved.)

:func:`stable_by_int` orders items by a small non-negative integer key (a pack's index in its
window) by 16-bit digits, least significant first: each digit is a radix sort in numpy (445,000
keys below 2^19: 8 ms, where ``np.lexsort`` of the key's two parts took 45 ms).

:func:`stable_argsort_rows` orders each row of the ranks' running costs in a dealing (sums of
``L + L^2/4096`` over whole lengths: multiples of 1/4096) by distinct int64 keys ``4096 cost
<< bits | column``: the keys are distinct, so any sort gives the stable order of the costs, and
the rows are sorted by :func:`runs_sort_kind`'s sort. A dealing's running totals come in long
ascending runs (the cheapest rank took the costliest item), which numpy's stable sort (timsort
for int64) merges rather than sorts: the 56 rows of 16,384 ranks one window of 16,384 ranks x 8
micro-batches deals take 14 ms so, against 32 ms by numpy's default sort of the same keys and
22 ms by the stable argsort of the floats, on a machine whose default sort is not vectorised.
Where it is (x86-simd-sort on AVX-512 Intel CPUs; numpy leaves it off on AMD's), the default
sort of distinct keys is several times faster than any scalar sort, runs or not.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from energon_ordering.pool.pack_order import ATTENTION_CROSSOVER_TOKENS

__all__ = ["COST_SCALE", "COUNTED_LENGTHS", "runs_sort_kind", "scatter_by_length",
           "stable_argsort", "stable_argsort_rows", "stable_ascending", "stable_by_int",
           "whole_int64"]

#: Bits of the index in a composite key (at most 2^24 values: a window's plan is capped there).
_INDEX_BITS = 24


def stable_ascending(values: np.ndarray) -> np.ndarray:
    """Indices that sort the 1-D ``values`` ascending, ties in index order: exactly
    ``np.argsort(values, kind="stable")`` (int64)."""
    v = np.asarray(values)
    key = None if len(v) > (1 << _INDEX_BITS) else _sorted_keys(v, _INDEX_BITS)
    if key is None:
        return np.argsort(v, kind="stable")
    key &= (1 << _INDEX_BITS) - 1
    return key


#: Lengths :func:`scatter_by_length` counts: below 2^16 (uint16, numpy's radix sort).
COUNTED_LENGTHS = 1 << 16
#: Samples :func:`scatter_by_length` orders at once (its temporaries: a few times this).
_SCATTER_CHUNK = 1 << 16


def scatter_by_length(lengths: np.ndarray, low: np.ndarray | None, bits: int,
                      out: np.ndarray) -> None:
    """Writes the keys ``lengths << bits | low`` into ``out`` in a stable ascending order of
    the lengths (ties in index order): the keys ``np.argsort(lengths, kind="stable")`` puts
    in order, by a counting sort read chunk by chunk (temporaries of a chunk, not of the
    array).

    Args:
        lengths: uint16 lengths (below :data:`COUNTED_LENGTHS`).
        low: Non-negative integers below ``2^bits``, one per length (a sample's id); None:
            each length's index.
        bits: Bits of ``low`` in a key (``16 + bits <= 63``).
        out: An int64 array of ``len(lengths)`` elements, not sharing memory with the inputs.
    """
    L = np.asarray(lengths)
    n_low = len(L) if low is None else len(low)
    if L.dtype != np.uint16 or L.ndim != 1 or n_low != len(L) or len(out) != len(L):
        raise ValueError(f"scatter_by_length: 1-D uint16 lengths with as many low values and "
                         f"outputs expected, got {L.dtype} {L.shape}, {n_low}, {len(out)}")
    if not 0 < bits <= 63 - 16:
        raise ValueError(f"scatter_by_length: bits={bits} leaves no room for a 16-bit length "
                         f"in an int64 key (1 <= bits <= 47)")
    size = int(L.max()) + 1 if len(L) else 1  # the tables: one count per length up to the top
    total = np.zeros(size, dtype=np.int64)
    for a in range(0, len(L), _SCATTER_CHUNK):  # (np.bincount copies its input as int64)
        total += np.bincount(L[a:a + _SCATTER_CHUNK], minlength=size)
    nxt = np.cumsum(total)
    nxt -= total  # where the next sample of each length goes
    for a in range(0, len(L), _SCATTER_CHUNK):
        part = L[a:a + _SCATTER_CHUNK]
        order = np.argsort(part, kind="stable")  # numpy's radix sort (uint16)
        here = np.bincount(part, minlength=size)
        first = np.cumsum(here)
        first -= here  # each length's first place in the chunk's order
        ordered = part[order]
        dest = nxt[ordered]
        dest -= first[ordered]
        dest += np.arange(len(order), dtype=np.int64)
        key = ordered.astype(np.int64)
        key <<= bits
        key |= order + a if low is None else np.asarray(low[a:a + _SCATTER_CHUNK])[order]
        out[dest] = key
        nxt += here


def whole_int64(values: np.ndarray, limit: int) -> np.ndarray | None:
    """``values`` as int64 (a new array), or None unless every one is whole, >= 0 and below
    ``limit``: the test for sorting lengths by composite keys."""
    v = np.asarray(values)
    if v.dtype.kind not in "iuf":
        return None
    if len(v) and not (0 <= v.min() and v.max() < limit):  # (NaN fails here too)
        return None
    out = v.astype(np.int64)
    if v.dtype.kind == "f" and not np.array_equal(out, v):
        return None
    return out


def _sorted_keys(values: np.ndarray, bits: int) -> np.ndarray | None:
    """``values << bits | index`` sorted, as int64; None unless every value is whole, >= 0
    and below ``2^(63 - bits)``."""
    if not len(values) or bits > 62:
        return None
    key = whole_int64(values, 1 << (63 - bits))
    if key is None:
        return None
    key <<= bits
    key |= np.arange(len(key), dtype=np.int64)
    key.sort()
    return key


def stable_by_int(keys: np.ndarray) -> np.ndarray:
    """Indices that sort the 1-D non-negative integer ``keys`` ascending, ties in index order:
    the order of ``np.argsort(keys, kind="stable")``, by 16-bit digits (int32 below 2^31 keys,
    else int64; a packed window of 16,384 ranks holds about a million: the peak counts)."""
    k = np.asarray(keys)
    if k.dtype.kind not in "iu":
        raise TypeError(f"stable_by_int: integer keys expected, got {k.dtype}")
    if not len(k):
        return np.zeros(0, dtype=np.int64)
    if k.min() < 0:
        raise ValueError("stable_by_int: the keys must be >= 0")
    if k.dtype.itemsize < 4:
        k = k.astype(np.int32)  # room for the digit mask
    top, shift = int(k.max()), 16
    order = np.argsort((k & 0xFFFF).astype(np.uint16), kind="stable")  # numpy's radix sort
    if len(k) < 2**31:
        order = order.astype(np.int32)
    while top >> shift:
        digit = ((k[order] >> shift) & 0xFFFF).astype(np.uint16)
        step = np.argsort(digit, kind="stable")
        del digit
        order = order[step]
        del step
        shift += 16
    return order


def stable_argsort(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, kind="stable")`` of a 1-D array, by numpy's default sort (see the
    module)."""
    v = np.asarray(values)
    if v.ndim != 1:
        raise ValueError(f"stable_argsort: a 1-D array expected, got shape {v.shape}")
    order = np.argsort(v)
    if len(v) < 2:
        return order
    s = v[order]
    step = s[1:] != s[:-1]
    if step.all():
        if v.dtype.kind == "f" and np.isnan(s[-1]):  # NaNs sort last and never compare equal
            return np.argsort(v, kind="stable")
        return order
    key = np.empty(len(v), dtype=np.int64)  # rank among the distinct values, then the index
    key[order[0]] = 0
    key[order[1:]] = np.cumsum(step)
    key *= len(v)
    key += np.arange(len(v))
    return np.argsort(key)


#: numpy's default sort counts as vectorised where it sorts random int64 keys this many times
#: faster than its stable sort (timsort): timsort merges the ascending runs of a dealing's
#: running totals about 2.5x faster than it sorts random keys, so below this it wins on them.
VECTORISED_SORT_RATIO = 3.0


@functools.cache
def runs_sort_kind() -> str | None:
    """The ``kind`` of numpy's sort for distinct int64 keys that come in ascending runs (a
    dealing's running totals, a packing round's ranks): None (numpy's default sort) where that
    is vectorised, else ``"stable"`` (timsort, which merges the runs).

    Decided once per process by timing both on the same random keys (a few milliseconds):
    numpy says which instruction sets it dispatches to, not whether its sort is among them
    (x86-simd-sort runs on AVX-512 Intel CPUs; numpy leaves it off on AMD's). The keys are
    distinct, so either kind gives the same order: only the speed depends on the outcome."""
    keys = np.random.default_rng(0).integers(0, 2**40, (4, 4096))

    def took(kind: str | None) -> float:
        best = float("inf")
        for _ in range(3):
            k = keys.copy()
            t0 = time.perf_counter()
            k.sort(axis=1, kind=kind)
            best = min(best, time.perf_counter() - t0)
        return best

    return None if took(None) * VECTORISED_SORT_RATIO <= took("stable") else "stable"


#: Costs of whole lengths, ``L + L^2 / 4096``, are multiples of 1/COST_SCALE.
COST_SCALE = ATTENTION_CROSSOVER_TOKENS
#: Rows shorter than this are sorted stably as they are (the keys cost more than they save).
_KEYED_ROW = 64


def stable_argsort_rows(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, axis=1, kind="stable")`` of a 2-D array of costs, by distinct int64
    keys where every value is a whole multiple of ``1 / COST_SCALE`` that fits beside its
    column's bits (sums of the costs of whole lengths), else by the stable sort itself."""
    v = np.asarray(values)
    if v.ndim != 2:
        raise ValueError(f"stable_argsort_rows: a 2-D array expected, got shape {v.shape}")
    n, m = v.shape
    if m < _KEYED_ROW or not n or v.dtype.kind != "f":
        return np.argsort(v, axis=1, kind="stable")
    bits = int(m - 1).bit_length()
    scaled = v * float(COST_SCALE)
    if not (float(scaled.min()) >= 0 and float(scaled.max()) < 2.0 ** (62 - bits)):
        return np.argsort(v, axis=1, kind="stable")  # (NaN fails here too)
    key = scaled.astype(np.int64)
    if not np.array_equal(key, scaled):
        return np.argsort(v, axis=1, kind="stable")  # a fraction finer than 1/4096
    del scaled
    key <<= bits
    key |= np.arange(m, dtype=np.int64)
    key.sort(axis=1, kind=runs_sort_kind())  # the rows come in ascending runs (module)
    key &= (1 << bits) - 1
    return key
