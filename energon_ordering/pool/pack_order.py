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

Under the sequence-length warmup the packs of one pool are emitted over many steps whose caps
grow. :func:`pack_order` then takes the cap of every emission position (``position_caps``) and
sorts and permutes only within runs of positions that share one cap (:func:`cap_runs`; a run
starts and ends on micro-batch boundaries because a cap belongs to a step): a pack that arrived
at position i, built to the cap of position i, is emitted at a position with the same cap, so it
fits it and fills it. Run 0 uses the pool's seed, run g > 0 the seed :func:`run_seed` derives,
so a pool with a single cap (every pool after the warmup) gets exactly the order it had without
caps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from energon_ordering.pool.order import POOL_ORDERS
from energon_ordering.errors import show

__all__ = [
    "ATTENTION_CROSSOVER_TOKENS",
    "cap_runs",
    "cost_order",
    "emission_batch",
    "pack_cost",
    "pack_order",
    "run_seed",
]

#: Sequence length at which the quadratic (attention) term equals the linear one.
ATTENTION_CROSSOVER_TOKENS = 4096


def pack_cost(doc_lengths: Sequence[float]) -> float:
    """Cost of one pack: ``sum(L + L**2 / 4096)`` over its documents, in token units."""
    return float(sum(L + L * L / ATTENTION_CROSSOVER_TOKENS for L in doc_lengths))


def emission_batch(b0: int, offset: int, position: int, batch_size: int, num_workers: int) -> int:
    """The rank's micro-batch index in which position ``position`` of a pool goes out.

    A pool fills while micro-batch ``b0`` is built, after ``offset`` packs of that micro-batch
    were taken, then drains in order, ``batch_size`` packs per micro-batch of this loader
    worker, whose micro-batches are ``num_workers`` apart in the rank's index (Energon takes
    micro-batch b from worker ``b % num_workers``). Positions past the pool continue into the
    next pools, which fill right where this one ends.
    """
    return b0 + ((offset + position) // batch_size) * max(1, num_workers)


def cap_runs(position_caps: Sequence[float | None]) -> list[int]:
    """Lengths of the runs of equal consecutive caps, in position order (they sum to the input's
    length; ``[]`` for no positions)."""
    runs: list[int] = []
    for k, cap in enumerate(position_caps):
        if k and cap == position_caps[k - 1]:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def run_seed(seed: int, run: int) -> int:
    """The permutation seed of run ``run`` of a pool: ``seed`` for run 0, else a 64-bit hash of
    (seed, run); rank-independent like ``seed``."""
    if run == 0:
        return seed
    digest = hashlib.sha256(f"energon_ordering.pack_order.run:{seed}:{run}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def pack_order(
    pack_doc_lengths: Sequence[Sequence[float]],
    seed: int,
    mode: str,
    batch_size: int | None,
    position_caps: Sequence[float | None] | None = None,
) -> list[int]:
    """Emission order of a pool of packs: sort by :func:`pack_cost`, permute with ``seed``.

    Args:
        pack_doc_lengths: Per pack, the lengths of its documents in tokens, in arrival order.
        seed: The pool's permutation seed (rank-independent, see
            :func:`~energon_ordering.pool.order.pool_seed`).
        mode: ``"sample"`` (permute single packs) or ``"batch"`` (permute sorted chunks of
            ``batch_size`` packs).
        batch_size: Packs per micro-batch; required for ``mode="batch"``.
        position_caps: The pack cap (tokens) of each emission position 0..n-1 (non-decreasing),
            or None (one cap). Packs are sorted and permuted only within a run of equal caps:
            the pack that arrived at position i is emitted at a position of i's run.

    Returns:
        Arrival indices in emission order.

    Raises:
        ValueError: Unknown mode, or ``position_caps`` not one per pack.
    """
    return cost_order([pack_cost(d) for d in pack_doc_lengths], seed, mode, batch_size, position_caps)


def cost_order(
    costs: Sequence[float],
    seed: int,
    mode: str,
    batch_size: int | None,
    position_caps: Sequence[float | None] | None = None,
) -> list[int]:
    """:func:`pack_order` on pack costs already computed (the pool of packs calls this).

    Args:
        costs: :func:`pack_cost` of each pack, in arrival order.
        seed, mode, batch_size, position_caps: As in :func:`pack_order`.

    Returns:
        Arrival indices in emission order.
    """
    if mode not in POOL_ORDERS:
        raise ValueError(f"pack_order: mode = {show(mode)} is unknown; use one of {sorted(POOL_ORDERS)}.")
    if position_caps is None:
        return POOL_ORDERS[mode](costs, seed, batch_size)
    if len(position_caps) != len(costs):
        raise ValueError(
            f"pack_order: {len(position_caps)} position caps for {len(costs)} packs; give one "
            "cap per emission position."
        )
    order: list[int] = []
    start = 0
    for g, size in enumerate(cap_runs(position_caps)):
        run = POOL_ORDERS[mode](costs[start : start + size], run_seed(seed, g), batch_size)
        order.extend(start + i for i in run)
        start += size
    return order
