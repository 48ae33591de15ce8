"""Lost compute: straggler idle per micro-batch and per optimizer step, padding by tokens.

Pure, vectorised measures of what a training run pays for an order (DESIGN.md, "What fast and
correct are measured by"). The cost of a sample of L tokens is ``L + L^2 / 4096`` (MLPs and
attention, 4,096 tokens the crossover); a micro-batch costs the sum of its samples.

- :func:`idle_per_micro_batch`: ranks wait at every micro-batch (expert parallelism): mean over
  steps and micro-batch indices of ``1 - mean_r / max_r`` of the ranks' micro-batch costs.
- :func:`idle_per_step`: ranks wait at the gradient reduction once per optimizer step: the
  same of each rank's cost summed over its M micro-batches, averaged over steps. This is the
  figure pure data parallelism pays.
- :func:`padding_by_tokens` / :func:`pack_padding_by_tokens`: a GPU computes padding tokens as
  it computes real ones, so padding is weighted by tokens: ``sum(B max L - sum L) /
  sum(B max L)`` over all micro-batches (a mean of per-micro-batch ratios understates it on
  heavy tails, where the long micro-batches hold most tokens).
- :func:`free_dealing_bound`: the idle per step when each step's samples are dealt to the ranks
  with no micro-batch structure (longest first onto the least-loaded rank): what no order of
  the same steps' samples can beat by much.
- :func:`held_packs_bound`: with packing, the idle per step no dealing of the same packs can
  beat: the rank holding a step's costliest pack holds M - 1 more packs, each costing at least
  the step's cheapest (a full pack costs at least its tokens).
- :func:`lost_compute`: idle per step + padding by tokens, the headline figure.

Every figure is a fraction in [0, 1]; a step (or micro-batch) whose ranks all cost 0 counts as
0 idle.
"""

from __future__ import annotations

import numpy as np

from energon_ordering.errors import OrderingConfigError, show
from energon_ordering.inspect.diagnostics import ATTENTION_CROSSOVER_TOKENS

__all__ = [
    "free_dealing_bound",
    "held_packs_bound",
    "idle_per_micro_batch",
    "idle_per_step",
    "lost_compute",
    "micro_batch_costs",
    "pack_padding_by_tokens",
    "padding_by_tokens",
]


def _array(name: str, value: np.ndarray, ndim: int, shape: str) -> np.ndarray:
    """``value`` as float64 of ``ndim`` dimensions, finite and >= 0, else a one-line error."""
    a = np.asarray(value, dtype=np.float64)
    if a.ndim != ndim:
        raise OrderingConfigError(
            f"lost compute: {name} has shape {a.shape}; give {shape} ({ndim} dimensions).")
    if a.size and not (np.isfinite(a).all() and (a >= 0).all()):
        raise OrderingConfigError(
            f"lost compute: {name} holds {show(float(a[~(np.isfinite(a) & (a >= 0))][0]))}; "
            "give finite values >= 0.")
    return a


def _idle(costs: np.ndarray) -> np.ndarray:
    """``1 - mean / max`` over the last axis (0 where the max is 0)."""
    peak = costs.max(axis=-1)
    safe = np.where(peak > 0, peak, 1.0)
    return np.where(peak > 0, 1.0 - costs.mean(axis=-1) / safe, 0.0)


def micro_batch_costs(lengths: np.ndarray) -> np.ndarray:
    """``[..., B]`` sample lengths (tokens; 0: an empty slot) -> ``[...]`` micro-batch costs,
    ``sum(L + L^2 / 4096)``.

    For a plan's ``[steps, R, M, B]`` lengths this gives the ``[steps, R, M]`` costs the idle
    measures take. A packed micro-batch's cost is the sum over its documents: pass the
    documents' lengths (``[..., documents]``, zeros for no document)."""
    L = np.asarray(lengths, dtype=np.float64)
    return (L + L * L / ATTENTION_CROSSOVER_TOKENS).sum(axis=-1)


def idle_per_micro_batch(costs: np.ndarray) -> float:
    """Straggler idle per micro-batch: the ranks wait for each other at every micro-batch.

    Args:
        costs: ``[steps, R, M]`` cost of each rank's m-th micro-batch of each step
            (:func:`micro_batch_costs`).

    Returns:
        Mean over (step, m) of ``1 - mean_r(cost) / max_r(cost)``.
    """
    c = _array("costs", costs, 3, "[steps, ranks, micro-batches per step]")
    if c.size == 0:
        raise OrderingConfigError(f"lost compute: costs has shape {c.shape}; give at least one "
                                  "step, rank and micro-batch.")
    return float(_idle(c.transpose(0, 2, 1)).mean())


def idle_per_step(costs: np.ndarray) -> float:
    """Straggler idle per optimizer step: the ranks wait at the gradient reduction once a step.

    Args:
        costs: ``[steps, R, M]`` micro-batch costs (:func:`micro_batch_costs`).

    Returns:
        Mean over steps of ``1 - mean_r / max_r`` of each rank's cost summed over its M
        micro-batches. Never above :func:`idle_per_micro_batch`'s figure by more than the
        micro-batches' imbalances can add (the sums average them out).
    """
    c = _array("costs", costs, 3, "[steps, ranks, micro-batches per step]")
    if c.size == 0:
        raise OrderingConfigError(f"lost compute: costs has shape {c.shape}; give at least one "
                                  "step, rank and micro-batch.")
    return float(_idle(c.sum(axis=2)).mean())


def padding_by_tokens(lengths: np.ndarray) -> float:
    """Padding of padded micro-batches, weighted by tokens.

    A micro-batch of B samples is padded to B x its longest sample; the GPU computes every
    padding token. Slots of length 0 are empty (a micro-batch with fewer samples, e.g. the
    last of a finite epoch): they are not padded, so a micro-batch's B is its count of
    non-empty slots.

    Args:
        lengths: ``[N, B]`` sample lengths (tokens) of N micro-batches, 0 for an empty slot;
            any leading shape (``[steps, R, M, B]``) is flattened to micro-batches.

    Returns:
        ``sum(B max L - sum L) / sum(B max L)`` over the micro-batches; 0 if they hold no
        tokens.
    """
    L = np.asarray(lengths, dtype=np.float64)
    if L.ndim < 2:
        raise OrderingConfigError(
            f"lost compute: lengths has shape {L.shape}; give [micro-batches, samples] (2 or "
            "more dimensions, the last one the micro-batch's samples).")
    L = _array("lengths", L.reshape(-1, L.shape[-1]), 2, "[micro-batches, samples]")
    padded = (L.max(axis=1, initial=0.0) * (L > 0).sum(axis=1)).sum()
    return float(1.0 - L.sum() / padded) if padded > 0 else 0.0


def pack_padding_by_tokens(used: np.ndarray, capacity: np.ndarray | float) -> float:
    """Padding of packed micro-batches (packs), weighted by tokens.

    Args:
        used: ``[packs]`` real tokens in each pack.
        capacity: Tokens each pack is padded to (``pack_seq_length``): one number, or one per
            pack (packs of a warmup step have a smaller cap).

    Returns:
        ``sum(capacity - used) / sum(capacity)``; 0 for no capacity.

    Raises:
        OrderingConfigError: a pack holds more tokens than its capacity.
    """
    u = _array("used", np.ravel(used), 1, "[packs]")
    cap = _array("capacity", np.ravel(capacity), 1, "one number or [packs]")
    if cap.size not in (1, u.size):
        raise OrderingConfigError(
            f"lost compute: capacity has {np.size(capacity)} values for {u.size} packs; give "
            "one number or one per pack.")
    cap = np.broadcast_to(cap, u.shape)
    over = np.flatnonzero(u > cap)
    if len(over):
        i = int(over[0])
        raise OrderingConfigError(
            f"lost compute: pack {i} holds {show(float(u[i]))} tokens, above its capacity "
            f"{show(float(cap[i]))}; give each pack's real tokens and its cap.")
    total = cap.sum()
    return float((cap - u).sum() / total) if total > 0 else 0.0


def _lpt_loads(costs: np.ndarray, world_size: int) -> np.ndarray:
    """``[steps, n]`` sample costs -> ``[steps, R]`` rank loads after longest-processing-time
    dealing: each sample, longest first, onto the least-loaded rank.

    Vectorised in chunks: with the loads sorted ascending ``l_0 <= l_1 <= ...`` and the next
    samples descending ``x_0 >= x_1 >= ...``, sample i goes to rank i exactly as one-at-a-time
    dealing would put it, as long as ``l_i <= l_k + x_k`` for every k < i (no rank served
    earlier in the chunk has become cheaper than rank i). The longest such prefix (common to
    all steps) is dealt at once; it is at least one sample, and nearly R once the longest
    samples are placed. Ties between equal loads may differ from a heap's choice; the loads'
    multiset, all idle depends on, does not."""
    steps, n = costs.shape
    R = world_size
    desc = -np.sort(-costs, axis=1)
    loads = np.zeros((steps, R))
    rows = np.arange(steps)[:, None]
    j = 0
    while j < n:
        loads.sort(axis=1)
        width = min(R, n - j)
        x = desc[:, j: j + width]
        after = loads[:, :width] + x
        # exclusive running minimum of l_k + x_k, k < i
        prior = np.concatenate((np.full((steps, 1), np.inf),
                                np.minimum.accumulate(after, axis=1)[:, :-1]), axis=1)
        fits = loads[:, :width] <= prior  # column 0 always fits: c >= 1
        c = int(np.where(fits.all(axis=1), width, (~fits).argmax(axis=1)).min())
        loads[rows, np.arange(c)[None, :]] += x[:, :c]
        j += c
    return loads


def free_dealing_bound(step_sample_costs: np.ndarray, world_size: int) -> float:
    """Idle per optimizer step when each step's samples are dealt freely to the ranks.

    Each step's samples go, longest first, to the least-loaded rank (longest-processing-time
    dealing), with no micro-batch structure: a rank may take any number of samples. This is
    within 4/3 of the best split of each step and, on the mixes this package measures, within
    a fraction of a point of it: an order that keeps every step's samples cannot do much
    better. On heavy tails it is set by single samples: a step whose longest sample costs more
    than the ranks' mean load cannot be balanced by any dealing.

    Args:
        step_sample_costs: ``[steps, G]`` cost of each of a step's G samples
            (``L + L^2 / 4096``; pad a short step with zeros).
        world_size: R, data-parallel ranks.

    Returns:
        Mean over steps of ``1 - mean_r / max_r`` of the dealt loads.
    """
    c = _array("step_sample_costs", step_sample_costs, 2, "[steps, samples of a step]")
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) \
            or world_size < 1:
        raise OrderingConfigError(
            f"lost compute: world_size = {show(world_size)}; give an int >= 1.")
    if c.shape[0] == 0:
        raise OrderingConfigError(f"lost compute: step_sample_costs has shape {c.shape}; give at "
                                  "least one step.")
    return float(_idle(_lpt_loads(c, int(world_size))).mean())


def held_packs_bound(pack_costs: np.ndarray) -> float:
    """Idle per optimizer step that no dealing of a packed plan's own packs can beat.

    A rank holds M packs a step. The rank holding the step's costliest pack also holds M - 1
    others, each costing at least the step's cheapest pack, so its step costs at least
    ``max + (M - 1) min`` and the step idles at least ``1 - mean rank step / that``. Packs
    filled to the cap cost at least their tokens, so a pack of one cap-long sample (3x its
    tokens at 8,192) sets this at one or two packs per step: the bound :func:`free_dealing_bound`
    cannot see (it deals samples, not packs). Only other packs lower it: an emptier pack beside
    the costliest (padding), or the long samples' packs gathered into the same steps.

    Args:
        pack_costs: ``[steps, R, M]`` cost of each rank's packs (:func:`micro_batch_costs` of
            their documents).

    Returns:
        Mean over steps of ``max(0, 1 - mean_r(step cost) / (max + (M - 1) min))``.
    """
    c = _array("pack_costs", pack_costs, 3, "[steps, ranks, packs per step]")
    if c.shape[0] == 0:
        raise OrderingConfigError(
            f"lost compute: pack_costs has shape {c.shape}; give at least one step.")
    steps, _, M = c.shape
    flat = c.reshape(steps, -1)
    held = flat.max(axis=1) + (M - 1) * flat.min(axis=1)
    mean = c.sum(axis=2).mean(axis=1)
    safe = np.where(held > 0, held, 1.0)
    return float(np.where(held > 0, np.maximum(0.0, 1.0 - mean / safe), 0.0).mean())


def lost_compute(idle_step: float, padding: float) -> float:
    """The share of compute an order loses: idle per optimizer step + padding by tokens.

    Args:
        idle_step: :func:`idle_per_step`.
        padding: :func:`padding_by_tokens` (or :func:`pack_padding_by_tokens`).

    Returns:
        Their sum (both are shares of the same GPU time to first order).
    """
    for name, v in (("idle_step", idle_step), ("padding", padding)):
        if not (isinstance(v, (int, float, np.floating, np.integer)) and 0 <= v <= 1):
            raise OrderingConfigError(
                f"lost compute: {name} = {show(v)}; give a fraction in [0, 1].")
    return float(idle_step) + float(padding)
