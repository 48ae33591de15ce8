"""First-fit decreasing: the default packer, a pure function ``(lengths, capacity) -> bins``.

Sequence packing puts documents into packs of at most ``capacity`` tokens. First-fit
decreasing (FFD) takes the documents longest first and puts each into the first open pack it
fits, opening a new pack when none has room. It never uses more than ``11/9 OPT + 6/9`` packs
(Dosa 2007, tight), runs in ``O(n log n + n * packs)`` and is deterministic: ties in length keep
their arrival order, so the same lengths always give the same packs on every rank.

Used by :class:`~energon_ordering.task_encoder.OrderingTaskEncoder` as the default
``select_samples_to_pack`` for task encoders that have none. A document longer than
``capacity`` (e.g. media that may not be cut) gets a pack of its own.

``capacity`` may also be one value per pack, in the order packs are opened (non-decreasing):
with the sequence-length warmup the k-th pack of a buffer is emitted k micro-batches later,
under a cap that is never smaller (see :mod:`energon_ordering.warmup.pack_cap`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from energon_ordering.errors import show

__all__ = ["first_fit_decreasing"]


def first_fit_decreasing(
    lengths: Sequence[float], capacity: float | Sequence[float]
) -> list[list[int]]:
    """Packs documents into as few packs of ``capacity`` tokens as FFD finds.

    Args:
        lengths: Length of each document, in tokens (>= 0), in arrival order.
        capacity: Tokens per pack (> 0), or the capacity of the k-th pack opened, for k up to
            ``len(lengths) - 1`` (non-decreasing).

    Returns:
        Packs as lists of document indices, in the order the packs were opened; inside a pack
        the documents are in the order they were placed (longest first). Every index appears
        exactly once.

    Raises:
        ValueError: A capacity is not positive, per-pack capacities decrease or are fewer than
            the documents, or a length is negative.
    """
    if isinstance(capacity, numbers.Real):
        caps: Sequence[float] = [capacity] * len(lengths)
        if not capacity > 0:
            raise ValueError(f"first_fit_decreasing: capacity = {show(capacity)} must be > 0 (tokens per pack).")
    else:
        caps = capacity
        if len(caps) < len(lengths):
            raise ValueError(
                f"first_fit_decreasing: {len(caps)} per-pack capacities for {len(lengths)} "
                "documents; give one per document (a pack may hold one document)."
            )
        if any(not c > 0 for c in caps) or any(a > b for a, b in zip(caps, caps[1:])):
            raise ValueError(
                "first_fit_decreasing: per-pack capacities must be > 0 and non-decreasing, got "
                f"{list(caps)[:8]}..."
            )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[float] = []
    for i in order:
        length = lengths[i]
        if length < 0:
            raise ValueError(f"first_fit_decreasing: lengths[{i}] = {show(length)} must be >= 0.")
        for b, room in enumerate(free):
            if length <= room:
                bins[b].append(i)
                free[b] = room - length
                break
        else:
            bins.append([i])
            free.append(caps[len(bins) - 1] - length)
    return bins
