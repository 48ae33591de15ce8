"""Pack costs and the order of a pool of packs: pure functions.

With sequence packing every micro-batch holds about the same number of tokens, so what still
differs across data-parallel ranks is the attention cost inside each packed document. The cost
of a pack is ``sum(L + L**2 / 4096)`` over its documents (a linear term for the MLPs, a
quadratic one for per-document attention; 4,096 tokens is where they are equal), the same
measure :mod:`energon_ordering.inspect.diagnostics` uses for micro-batches.

A pool of packs (:class:`~energon_ordering.pool.pack_pool_sort.PackPoolSortDataset`) sorts packs
by this cost and permutes them with the rank-independent seed of
:func:`~energon_ordering.pool.order.pool_seed`: the ranks' i-th packs then cost about the same.
The permutation is the one of :data:`~energon_ordering.pool.order.POOL_ORDERS`, applied to costs
instead of lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

from energon_ordering.pool.order import POOL_ORDERS

__all__ = ["ATTENTION_CROSSOVER_TOKENS", "pack_cost", "pack_order"]

#: Sequence length at which the quadratic (attention) term equals the linear one.
ATTENTION_CROSSOVER_TOKENS = 4096


def pack_cost(doc_lengths: Sequence[float]) -> float:
    """Cost of one pack: ``sum(L + L**2 / 4096)`` over its documents, in token units."""
    return float(sum(L + L * L / ATTENTION_CROSSOVER_TOKENS for L in doc_lengths))


def pack_order(
    pack_doc_lengths: Sequence[Sequence[float]], seed: int, mode: str, batch_size: int | None
) -> list[int]:
    """Emission order of a pool of packs: sort by :func:`pack_cost`, permute with ``seed``.

    Args:
        pack_doc_lengths: Per pack, the lengths of its documents in tokens, in arrival order.
        seed: The pool's permutation seed (rank-independent, see
            :func:`~energon_ordering.pool.order.pool_seed`).
        mode: ``"sample"`` (permute single packs) or ``"batch"`` (permute sorted chunks of
            ``batch_size`` packs).
        batch_size: Packs per micro-batch; required for ``mode="batch"``.

    Returns:
        Arrival indices in emission order.
    """
    if mode not in POOL_ORDERS:
        raise ValueError(f"pack_order: mode = {mode!r} is unknown; use one of {sorted(POOL_ORDERS)}.")
    return POOL_ORDERS[mode]([pack_cost(d) for d in pack_doc_lengths], seed, batch_size)
