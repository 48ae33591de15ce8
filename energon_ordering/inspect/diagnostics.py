"""Diagnostics over recorded batches: pure functions, no Energon needed.

Definitions (DESIGN.md, "What fast and correct are measured by"):

- cost of a micro-batch: ``sum(L + L**2 / 4096)`` over its samples (a linear term for the MLPs
  and a quadratic one for attention, with 4,096 tokens as the crossover);
- straggler idle of a step: ``1 - mean_r(cost_r) / max_r(cost_r)`` over the data-parallel ranks,
  i.e. the fraction of GPU time the ranks spend waiting for the slowest one; averaged over steps
  (here a "step" is what the ranks wait at together: :func:`straggler_idle` of micro-batches is
  the idle per micro-batch; the idle per optimizer step, each rank's micro-batches of a step
  summed, is :func:`energon_ordering.inspect.lost_compute.idle_per_step`);
- padding waste of a micro-batch: ``1 - sum(L) / (B * max(L))``; averaged over micro-batches
  (:func:`padding_waste`; weighted by tokens, what the GPU computes in vain, it is
  :func:`energon_ordering.inspect.lost_compute.padding_by_tokens`, which the reports lead with);
- with sequence packing: packing efficiency ``real tokens / (packs * target)``, and per pack the
  histogram of its documents' sources (:func:`pack_source_histograms`); the cost of a packed
  micro-batch is the sum over its documents, so :func:`straggler_idle` takes the documents'
  lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from energon_ordering.errors import StateMismatchError, show

__all__ = [
    "autocorrelation",
    "batch_cost",
    "detect_sawtooth",
    "histogram_dispersion",
    "pack_source_histograms",
    "pack_source_summary",
    "packing_efficiency",
    "source_histograms",
    "sources_by_step",
    "padding_waste",
    "rank_overlap",
    "straggler_idle",
    "switch_lag",
    "warmup_counts",
]

#: Sequence length at which the quadratic (attention) term equals the linear one.
ATTENTION_CROSSOVER_TOKENS = 4096


def batch_cost(lengths: Sequence[float]) -> float:
    """Compute cost of one micro-batch: ``sum(L + L**2 / 4096)``, in token units."""
    return float(sum(L + L * L / ATTENTION_CROSSOVER_TOKENS for L in lengths))


def step_idle(step_lengths: Sequence[Sequence[Sequence[float]]]) -> list[float]:
    """Per step, ``1 - mean_r(cost_r) / max_r(cost_r)`` over the data-parallel ranks.

    Args:
        step_lengths: ``step_lengths[step][rank]`` is the list of sample lengths of that rank's
            micro-batch at that step.
    """
    out = []
    for step, ranks in enumerate(step_lengths):
        if not ranks:
            raise ValueError(f"straggler_idle: step {step} has no ranks.")
        costs = [batch_cost(b) for b in ranks]
        peak = max(costs)
        out.append(0.0 if peak == 0 else 1.0 - (sum(costs) / len(costs)) / peak)
    return out


def straggler_idle(step_lengths: Sequence[Sequence[Sequence[float]]]) -> float:
    """Mean over steps of :func:`step_idle`: the fraction of GPU time ranks spend waiting.

    Returns:
        Idle fraction in [0, 1); 0 when every rank's batch costs the same.
    """
    if not step_lengths:
        raise ValueError("straggler_idle: no steps given.")
    idle = step_idle(step_lengths)
    return sum(idle) / len(idle)


def padding_waste(batches: Sequence[Sequence[float]]) -> float:
    """Mean over micro-batches of ``1 - sum(L) / (B * max(L))``."""
    batches = [b for b in batches if len(b) > 0]
    if not batches:
        raise ValueError("padding_waste: no non-empty batches given.")
    return sum(1.0 - sum(b) / (len(b) * max(b)) for b in batches) / len(batches)


def rank_overlap(keys_per_rank: Sequence[Sequence[str]]) -> set[str]:
    """Sample keys that appear on more than one rank (empty for a correct split)."""
    seen: dict[str, int] = {}
    dup: set[str] = set()
    for rank, keys in enumerate(keys_per_rank):
        for k in set(keys):
            if k in seen and seen[k] != rank:
                dup.add(k)
            seen.setdefault(k, rank)
    return dup


def switch_lag(realized: Sequence[float], target: Sequence[float]) -> float:
    """How many steps late a mixture switch arrives, from per-step shares of one source.

    ``realized[s]`` and ``target[s]`` are the source's realised and scheduled share at step s over
    a window that starts before the switch and ends after it has fully arrived. The missing
    (or surplus) share, divided by the size of the jump, is the shift of the switch in steps:
    exact for a delayed step function, and the mean delay for a smeared one. Positive = late.
    """
    if len(realized) != len(target) or len(target) < 2:
        raise ValueError("switch_lag: need two sequences of equal length >= 2.")
    jump = target[-1] - target[0]
    if jump == 0:
        raise ValueError("switch_lag: the target does not change over the window.")
    return float(sum(t - r for r, t in zip(realized, target)) / jump)


#: Classes whose saved state holds warmup counters (``_counts``), summed by :func:`warmup_counts`.
COUNTING_STAGES = ("SeqLenWarmupDataset", "PackCapDataset", "PlannedPackDataset")

#: How to make a loader's saved state current at every micro-batch (Energon's own settings).
EXACT_LOADER = ("get_savable_loader(dataset, checkpoint_every_sec=0, "
                "checkpoint_every_min_n_samples=1)")


def warmup_counts(loader_state: object) -> dict[str, int]:
    """Sums the sequence-length warmup counters (seen, truncated, truncated_tokens,
    kept_over_cap, dropped; with packing also packs_over_cap: packs of the packer above the cap of
    their emission step, re-split first-fit) over every loader worker in a
    ``save_state_rank()`` result (of the batch-time warmup, or of the pack-time cut with
    packing).

    The sums are the counters at the save, whatever ``num_workers``. With loader workers,
    Energon answers ``save_state_rank()`` with each worker's last stored checkpoint plus the
    micro-batches it emitted since (``offset``, replayed on restore); a checkpoint is stored
    every ``checkpoint_every_sec`` (60 s by default), so its counters miss those micro-batches
    (Megatron-LM's example counted 32 samples with 2 workers against 112 without, for the same
    packs). Such a state is refused, naming the worker and the fix: build the loader with
    :data:`EXACT_LOADER` (a checkpoint after every micro-batch, which also restores without
    replaying), or read the counters of a loader without workers.

    With Energon's packing the cut counts samples as the packer takes them into its buffer (up
    to ``packing_buffer_size`` ahead of the packs emitted, per worker).

    Raises:
        StateMismatchError: A worker's checkpoint lags the save (see above).
    """
    total: dict[str, int] = {}
    lagging: list[tuple[int, int]] = []
    for worker, node in enumerate(getattr(loader_state, "worker_states", None) or [loader_state]):
        offset = getattr(node, "offset", 0)
        if isinstance(offset, int) and offset > 0:
            lagging.append((worker, offset))
        for counts in _stage_counts(node):
            for k, v in counts.items():
                total[k] = total.get(k, 0) + int(v)
    if lagging and total:
        worker, offset = lagging[0]
        raise StateMismatchError(
            f"warmup_counts: loader worker {worker}'s saved state is its checkpoint from "
            f"{offset} micro-batches before the save (Energon stores one every "
            "checkpoint_every_sec, 60 s by default, and replays the rest on restore), so its "
            f"counters miss them; build the loader with {EXACT_LOADER} for exact counts, or "
            "read them from a loader with num_workers = 0.")
    return total


def _stage_counts(state: object) -> list[dict[str, Any]]:
    """The ``_counts`` of every counting stage (:data:`COUNTING_STAGES`) inside ``state``."""
    import dataclasses

    found = []
    stack = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("__class__") in COUNTING_STAGES and isinstance(node.get("_counts"), dict):
                found.append(node["_counts"])
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            stack.extend(getattr(node, f.name) for f in dataclasses.fields(node))
    return found


def source_histograms(batch_sources: Sequence[Sequence[str]], sources: Sequence[str]):
    """Per-batch source counts: array ``[n_batches, len(sources)]``."""
    import numpy as np

    index = {s: i for i, s in enumerate(sources)}
    out = np.zeros((len(batch_sources), len(sources)))
    for b, names in enumerate(batch_sources):
        for name in names:
            if name not in index:
                raise ValueError(f"source_histograms: batch {b} has source {show(name)}, not in {list(sources)}.")
            out[b, index[name]] += 1
    return out


def sources_by_step(
    batch_sources: Sequence[Sequence[Sequence[str]]], micro_batches_per_step: int = 1
) -> list[list[str]]:
    """Groups the sources of every micro-batch of every rank by optimizer step.

    What the optimizer sees is the step: all micro-batches of all data-parallel ranks. The
    groups feed :func:`histogram_dispersion` to measure the per-step mix.

    Args:
        batch_sources: ``batch_sources[rank][micro_batch]`` is the list of sample sources of
            that rank's micro-batch.
        micro_batches_per_step: Micro-batches per rank per optimizer step (gradient
            accumulation), >= 1.

    Returns:
        ``groups[step]``: the sources of every sample of that step, over the whole steps that
        every rank completed.
    """
    if micro_batches_per_step < 1:
        raise ValueError(
            f"sources_by_step: micro_batches_per_step = {micro_batches_per_step}; give an int >= 1."
        )
    if not batch_sources:
        return []
    steps = min(len(rank) for rank in batch_sources) // micro_batches_per_step
    groups = []
    for step in range(steps):
        lo, hi = step * micro_batches_per_step, (step + 1) * micro_batches_per_step
        groups.append([s for rank in batch_sources for batch in rank[lo:hi] for s in batch])
    return groups


def histogram_dispersion(
    batch_sources: Sequence[Sequence[str]],
    sources: Sequence[str],
    expected: Any = None,
) -> float:
    """How much the per-batch source histogram swings, relative to independent draws.

    For each source, the variance of its per-batch count divided by the binomial variance
    ``B p (1 - p)`` that independent draws with its overall share p would give; averaged over
    the sources with 0 < p < 1. About 1 for a well-mixed stream (or less, for a low-discrepancy
    blend); well above 1 when batches are clumped by source (the shuffle is not mixing).

    Args:
        batch_sources: The source name of every sample, per batch (or per step's group).
        sources: All source names.
        expected: Optional target shares per batch, array ``[n_batches, len(sources)]`` (e.g. a
            schedule's weights at each step): counts are then compared with ``B_b * w_b``
            instead of the overall share, so that a schedule that changes over the batches
            does not count as dispersion. None: the overall share of each source.
    """
    import numpy as np

    hist = source_histograms(batch_sources, sources)
    sizes = hist.sum(axis=1)
    if len(hist) < 2 or sizes.min() <= 0:
        raise ValueError("histogram_dispersion: need at least two non-empty batches.")
    if expected is None:
        p = hist.sum(axis=0) / sizes.sum()
        ratios = [
            hist[:, i].var() / (sizes.mean() * p[i] * (1 - p[i]))
            for i in range(len(sources))
            if 0 < p[i] < 1
        ]
        return float(np.mean(ratios)) if ratios else 0.0
    w = np.asarray(expected, dtype=np.float64)
    if w.shape != hist.shape:
        raise ValueError(f"histogram_dispersion: expected has shape {w.shape}, need {hist.shape}.")
    mean = sizes[:, None] * w
    binomial = (mean * (1 - w)).mean(axis=0)
    excess = ((hist - mean) ** 2).mean(axis=0)
    ratios = [excess[i] / binomial[i] for i in range(len(sources)) if binomial[i] > 0]
    return float(np.mean(ratios)) if ratios else 0.0


def autocorrelation(series: Sequence[float], lag: int) -> float:
    """Pearson autocorrelation of ``series`` at ``lag`` (0 for a constant series)."""
    import numpy as np

    x = np.asarray(series, dtype=np.float64)
    if not 0 < lag < len(x) - 1:
        raise ValueError(f"autocorrelation: lag {lag} must lie in (0, {len(x) - 1}).")
    a, b = x[:-lag], x[lag:]
    if a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


def detect_sawtooth(
    batch_sources: Sequence[Sequence[str]],
    sources: Sequence[str],
    period_batches: int,
    *,
    threshold: float = 0.3,
    min_dispersion: float = 1.5,
) -> tuple[bool, dict[str, float]]:
    """Flags a stream whose per-source share repeats with the shard-length period.

    Shards read in blocks make each source's per-batch share a periodic wave (a sawtooth in the
    per-source loss); a well-shuffled stream has no autocorrelation at any lag. Computes each
    source's share autocorrelation at ``period_batches`` (the shard length in micro-batches,
    or one full cycle of shards) and flags the stream if any exceeds ``threshold`` and the
    noise level ``3 / sqrt(n_batches)`` AND the histogram swings more than independent draws
    would (:func:`histogram_dispersion` above ``min_dispersion``): a low-discrepancy blend is
    periodic too, but its batches vary less than random ones, which does no harm.

    Returns:
        ``(flagged, {source: autocorrelation at the period})``.
    """
    import numpy as np

    hist = source_histograms(batch_sources, sources)
    shares = hist / np.maximum(hist.sum(axis=1, keepdims=True), 1)
    ac = {s: autocorrelation(shares[:, i], period_batches) for i, s in enumerate(sources)}
    noise = 3 / np.sqrt(len(batch_sources))
    periodic = any(v > max(threshold, noise) for v in ac.values())
    return periodic and histogram_dispersion(batch_sources, sources) > min_dispersion, ac


def packing_efficiency(pack_totals: Sequence[float], targets: Sequence[float]) -> float:
    """Real tokens over pack capacity: ``sum(tokens) / sum(target)`` over the packs.

    Args:
        pack_totals: Tokens in each pack.
        targets: The target (capacity) of each pack, in tokens (e.g. the warmup cap of its step).
    """
    if len(pack_totals) != len(targets) or not targets:
        raise ValueError("packing_efficiency: need one target per pack and at least one pack.")
    return float(sum(pack_totals) / sum(targets))


def pack_source_histograms(pack_sources: Sequence[Sequence[str]], sources: Sequence[str]):
    """Per-pack source histogram: array ``[n_packs, len(sources)]`` of document counts.

    ``pack_sources[p]`` lists the source of each document of pack p (e.g.
    ``PackedSyntheticBatch.pack_sources``, flattened over micro-batches).
    """
    return source_histograms(pack_sources, sources)


def pack_source_summary(pack_sources: Sequence[Sequence[str]], sources: Sequence[str]) -> dict[str, float]:
    """How packs mix sources.

    Returns:
        ``share:<source>``: each source's share of the packed documents (compare with the
        schedule); ``single_source_packs``: fraction of packs with >= 2 documents that hold one
        source only; ``expected_single_source``: that fraction if documents were drawn
        independently with the realised shares (a pack built from neighbours of one shard
        would be far above it); ``same_source_neighbours`` and its independent-draw
        expectation ``expected_same_source_neighbours`` (``sum p**2``) for adjacent documents.
    """
    import numpy as np

    hist = pack_source_histograms(pack_sources, sources)
    total = hist.sum()
    if total == 0:
        raise ValueError("pack_source_summary: no documents.")
    p = hist.sum(axis=0) / total
    multi = [i for i, names in enumerate(pack_sources) if len(names) >= 2]
    single = [int((hist[i] > 0).sum() == 1) for i in multi]
    expected_single = [float((p ** len(pack_sources[i])).sum()) for i in multi]
    pairs = [(a, b) for names in pack_sources for a, b in zip(names, names[1:])]
    out = {f"share:{s}": float(p[k]) for k, s in enumerate(sources)}
    out["single_source_packs"] = float(np.mean(single)) if single else 0.0
    out["expected_single_source"] = float(np.mean(expected_single)) if expected_single else 0.0
    out["same_source_neighbours"] = (
        float(np.mean([a == b for a, b in pairs])) if pairs else 0.0
    )
    out["expected_same_source_neighbours"] = float((p**2).sum())
    return out
