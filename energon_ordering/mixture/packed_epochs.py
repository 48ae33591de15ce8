"""Implied epochs under sequence packing: a step's global batch counts packs, not documents.

Megatron-LM's global batch counts the sequences it trains on; with packing each sequence is a
pack of several documents, so a step draws ``packs x documents per pack`` documents from the
blend, and a source's epochs are that many times higher than ``global batch x steps`` suggests.

Documents per pack at step ``s`` are estimated from the pack's token target
``cap(s) = min(pack_seq_length, max_seq_len(s))`` and the sources' document lengths:

    documents_per_pack(s) = max(1, fill * cap(s) / sum_k w_k(s) * E[min(L_k, cap(s))])

``E[min(L_k, cap)]`` is the mean length of source k's documents with the ones longer than the
cap cut to it (the packer cuts them; a cut document fills a pack alone). ``fill`` is the share of
a pack's tokens that are documents: first-fit decreasing over a buffer of a few hundred documents
fills 97-98% (``tools/bench_packing.py``). Pure functions; no dataset needed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from energon_ordering.mixture.schedule import MixtureSchedule

__all__ = ["DEFAULT_PACK_FILL", "PackedEpochs", "capped_mean_lengths", "packed_implied_epochs"]

#: Share of a pack's tokens that are documents (first-fit decreasing, tools/bench_packing.py).
DEFAULT_PACK_FILL = 0.97


def capped_mean_lengths(lengths: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """``E[min(L, cap)]`` over ``lengths`` for every cap in ``caps`` (tokens)."""
    lengths = np.sort(np.asarray(lengths, dtype=np.float64))
    if lengths.size == 0:
        raise ValueError("capped_mean_lengths: no lengths given.")
    caps = np.asarray(caps, dtype=np.float64)
    below = np.searchsorted(lengths, caps, side="right")
    cum = np.concatenate([[0.0], np.cumsum(lengths)])
    return (cum[below] + caps * (lengths.size - below)) / lengths.size


class PackedEpochs(dict):
    """``{source: epochs}`` plus ``docs_per_pack``, the mean documents per pack over the run."""

    docs_per_pack: float


def packed_implied_epochs(
    schedule: MixtureSchedule,
    total_steps: int,
    packs_per_step: int,
    source_sizes: Mapping[str, int],
    source_lengths: Mapping[str, np.ndarray],
    *,
    pack_seq_length: int,
    max_seq_len: Callable[[int], int] | None = None,
    fill: float = DEFAULT_PACK_FILL,
) -> PackedEpochs:
    """Expected passes over each source when every step trains on ``packs_per_step`` packs.

    Args:
        schedule: The mixture schedule (its weights are shares of documents: the blend draws
            documents before they are packed).
        total_steps: Optimizer steps of the run.
        packs_per_step: Megatron's global batch size under packing (packs per step).
        source_sizes: Documents per source; must name every source of the schedule.
        source_lengths: Per source, document lengths in tokens (a length index's, or a single
            assumed mean).
        pack_seq_length: The pack's token target.
        max_seq_len: The sequence-length warmup's ``max_seq_len(step)``, which caps the pack
            target (None: no warmup).
        fill: Share of a pack's tokens that are documents (see the module docstring).

    Returns:
        ``{source: epochs}``, with ``.docs_per_pack`` the mean documents per pack.
    """
    missing = [s for s in schedule.sources if s not in source_sizes or s not in source_lengths]
    if missing:
        raise ValueError(f"packed_implied_epochs: no size or lengths for sources {missing}.")
    if not 0 < fill <= 1:
        raise ValueError(f"packed_implied_epochs: fill = {fill} must lie in (0, 1].")
    if pack_seq_length < 1 or packs_per_step < 1 or total_steps < 1:
        raise ValueError("packed_implied_epochs: pack_seq_length, packs_per_step and total_steps "
                         f"must be >= 1, got {pack_seq_length}, {packs_per_step}, {total_steps}.")
    totals = np.zeros(len(schedule.sources))
    packs_docs = 0.0
    chunk = 1 << 16
    for start in range(0, total_steps, chunk):
        steps = np.arange(start, min(total_steps, start + chunk))
        caps = np.full(steps.size, float(pack_seq_length))
        if max_seq_len is not None:
            caps = np.minimum(caps, [max_seq_len(int(s)) for s in steps])
        weights = schedule.weights_table(steps)  # (steps, sources)
        means = np.stack([capped_mean_lengths(source_lengths[s], caps) for s in schedule.sources],
                         axis=1)
        docs = np.maximum(1.0, fill * caps / (weights * means).sum(axis=1))
        packs_docs += float(docs.sum())
        totals += (weights * (docs * packs_per_step)[:, None]).sum(axis=0)
    out = PackedEpochs({name: float(draws / source_sizes[name])
                        for name, draws in zip(schedule.sources, totals)})
    out.docs_per_pack = packs_docs / total_steps
    return out
