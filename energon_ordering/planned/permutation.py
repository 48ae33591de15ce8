"""A keyed permutation of ``range(n)`` that is evaluated at any index, in O(1) memory.

Planned mode draws each source's samples in the order of a seeded permutation per source
epoch. A shuffled index array would need O(n) memory in every loader worker (800 MB for
n = 10^8); a format-preserving permutation needs none: :func:`permute` maps indices to
indices, :func:`unpermute` maps them back, both vectorised over numpy arrays.

Construction: a Feistel network on ``bits`` bits, the bit length of ``n - 1`` (at least 2, so
the domain ``2**bits`` is under ``2 n``), with halves of ``ceil(bits/2)`` and ``floor(bits/2)``
bits that swap widths every round (an unbalanced Feistel network: each round
``(l, r) -> (r, l ^ f(r))`` is a bijection for any ``f``). :data:`ROUNDS` rounds; the round
function is multiplicative hashing, the top ``width(l)`` bits of ``(r ^ key) * multiplier``
with a 64-bit key and an odd 64-bit multiplier per round. Indices that land at or above ``n``
are walked on (cycle walking) until they fall below ``n``: the walk follows the domain
permutation's cycle through the start, which lies below ``n``, so it ends, and the result is a
bijection of ``range(n)``. Expected walk length is under 2 steps per index. Measured: about
0.1 us per index vectorised (10^6 indices in 0.07 s), memory O(indices asked), never O(n).

Round keys are derived from ``(seed, source, epoch)`` with SHAKE-256 (:func:`permutation_key`),
so the order is the same on every platform, Python and numpy version (and never depends on
Python's per-process ``hash`` salt). Trade-off against a stored shuffle: arithmetic per index
instead of a memory read, and a permutation that is pseudo-random rather than uniform over all
n! orders (enough for data order).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

__all__ = ["CHUNK", "MAX_SIZE", "ROUNDS", "PermutationKey", "permutation_key", "permute", "unpermute"]

#: Feistel rounds. Bumping it (or anything else here) changes every planned order: it is part
#: of :data:`energon_ordering.planned.window.PLAN_VERSION`.
ROUNDS = 6



@dataclass(frozen=True)
class PermutationKey:
    """The round keys of one permutation (see :func:`permutation_key`)."""

    rounds: tuple[tuple[int, int], ...]
    """``(xor key, odd multiplier)`` per round."""


def permutation_key(seed: int, source: int, epoch: int) -> PermutationKey:
    """The key of source ``source``'s permutation in its epoch ``epoch`` under ``seed``.

    A pure function of its arguments (never of the rank or the worker), so every rank that
    plans the same source epoch draws the same order.
    """
    digest = hashlib.shake_256(
        f"energon_ordering.planned.permutation:{int(seed)}:{int(source)}:{int(epoch)}".encode()
    ).digest(16 * ROUNDS)
    words = [int.from_bytes(digest[8 * i: 8 * i + 8], "little") for i in range(2 * ROUNDS)]
    return PermutationKey(tuple((words[2 * i], words[2 * i + 1] | 1) for i in range(ROUNDS)))


#: Largest permuted range: bit lengths are taken from float64 exponents, exact below 2**53.
MAX_SIZE = 2**53


def _bits(n: np.ndarray) -> np.ndarray:
    """Bits of the Feistel domain per element: the bit length of ``n - 1``, at least 2, so
    the domain ``2**bits`` is under ``2 n`` (n >= 3)."""
    _, exponent = np.frexp((np.maximum(n, 2) - 1).astype(np.float64))  # m = f 2**e, f in [.5, 1)
    return np.maximum(exponent, 2).astype(np.uint64)


def _feistel(x: np.ndarray, bits: np.ndarray, keys: tuple[tuple[int, int], ...],
             inverse: bool) -> np.ndarray:
    """One pass of the (unbalanced) Feistel network on ``bits``-bit values: the high
    ``ceil(bits/2)`` bits and the low ``floor(bits/2)`` bits are the halves; a round maps
    ``(left, right)`` to ``(right, left ^ f(right))``, so the widths swap each round and come
    back after an even number of rounds."""
    wide = (bits + np.uint64(1)) >> np.uint64(1)
    narrow = bits - wide
    one = np.uint64(1)
    rounds = [(np.uint64(k), np.uint64(m)) for k, m in keys]

    buffer = np.empty_like(x)

    def f(half: np.ndarray, k: np.uint64, m: np.uint64, width: np.ndarray) -> np.ndarray:
        """The top ``width`` bits of ``(half ^ k) * m``, in ``buffer`` (no temporaries)."""
        out = np.bitwise_xor(half, k, out=buffer)
        out *= m
        out >>= np.uint64(64) - width
        return out

    if not inverse:
        left, right = x >> narrow, x & ((one << narrow) - one)
        w_left, w_right = wide, narrow
        for k, m in rounds:
            left ^= f(right, k, m, w_left)  # (left, right) -> (right, left ^ f(right))
            left, right = right, left
            w_left, w_right = w_right, w_left
        left <<= w_right
        left |= right
        return left
    # undo the rounds last to first; after an even number of rounds the widths are as above
    w_left, w_right = (wide, narrow) if len(rounds) % 2 == 0 else (narrow, wide)
    left, right = x >> w_right, x & ((one << w_right) - one)
    for k, m in reversed(rounds):
        # (left, right) = (r, l ^ f(r)) of the round's input (l, r): l has right's width
        right ^= f(left, k, m, w_right)
        left, right = right, left
        w_left, w_right = w_right, w_left
    left <<= w_right
    left |= right
    return left


#: Indices transformed at once: bounds the temporaries (about 20 arrays of this many 8-byte
#: words) and keeps them in cache, which is also faster than one pass over a long array.
CHUNK = 1 << 16


def _walk_chunk(x: np.ndarray, size: np.ndarray, key: PermutationKey,
                inverse: bool) -> np.ndarray:
    """One chunk: int64 ``x`` and ``size`` (same shape, or ``size`` 0-d) -> int64."""
    h = _bits(size)
    limit = size.astype(np.uint64)
    # indices are >= 0 (checked by _walk): the same bits as uint64, viewed, not copied
    out = _feistel(np.ascontiguousarray(x).view(np.uint64), h, key.rounds, inverse)
    walking = np.flatnonzero(out >= limit)
    while walking.size:  # cycle walking: at most the cycle through the start (< n)
        hw = h if h.ndim == 0 else h[walking]
        out[walking] = _feistel(out[walking], hw, key.rounds, inverse)
        walking = walking[out[walking] >= (limit if limit.ndim == 0 else limit[walking])]
    return out.view(np.int64)  # below the size, < 2^53: the same value


def _walk(indices: np.ndarray | int, n: np.ndarray | int, key: PermutationKey,
          inverse: bool) -> np.ndarray:
    x = np.asarray(indices, dtype=np.int64)
    size = np.asarray(n, dtype=np.int64)
    if size.size and (int(size.min()) < 1 or int(size.max()) > MAX_SIZE):
        raise ValueError(f"permute: n in [{int(size.min())}, {int(size.max())}]; a permutation "
                         f"needs 1 <= n <= 2**53 elements.")
    shape = np.broadcast_shapes(x.shape, size.shape)
    if size.ndim:
        x, size = (a.ravel() for a in np.broadcast_arrays(x, size))
    else:
        x = np.broadcast_to(x, shape).ravel()
    if x.size and (int(x.min()) < 0 or bool((x >= size).any())):
        raise ValueError("permute: every index must lie in [0, n).")
    out = np.empty(x.size, dtype=np.int64)
    for lo in range(0, x.size, CHUNK):
        part = size if size.ndim == 0 else size[lo: lo + CHUNK]
        out[lo: lo + CHUNK] = _walk_chunk(x[lo: lo + CHUNK], part, key, inverse)
    return out.reshape(shape)


def permute(indices: np.ndarray | int, n: np.ndarray | int, key: PermutationKey) -> np.ndarray:
    """``perm[indices]`` of the keyed permutation ``perm`` of ``range(n)``.

    Args:
        indices: Positions in ``[0, n)`` (any shape; int64).
        n: Size of the permuted range (>= 1); an int, or an array broadcast against
            ``indices`` (one permutation per size, same key: used to test many sizes at once).
        key: From :func:`permutation_key`.

    Returns:
        int64 array of the broadcast shape: the element at each position.
    """
    return _walk(indices, n, key, inverse=False)


def unpermute(values: np.ndarray | int, n: np.ndarray | int, key: PermutationKey) -> np.ndarray:
    """The inverse of :func:`permute`: the position of each value in ``[0, n)``."""
    return _walk(values, n, key, inverse=True)
