"""How many optimizer steps a plan window holds when ``plan_window_steps`` is not given.

``planned_mix="step"`` sorts its window into M bands of K slots, one slot of each band per step,
so a slot spans 1/(K M) of the window's lengths: padding by tokens falls about as 1/K. Its
balancing grows as K^2 in memory and time, so its window holds about :data:`STEP_MIX_SAMPLES`
samples, between :data:`~.window.DEFAULT_WINDOW_STEPS` (32) and :data:`STEP_MAX_WINDOW_STEPS`
(128) steps, and fewer than 32 only where 32 steps would be over 2^20 samples (a loader worker
planning 32 steps of 16,384 ranks x 8 x 4 would hold 2^24 ids and 1.4 GiB). Measured with
``tools/bench_planned.py``'s mixes at M = 8, B = 4 (K = 32 -> 64 -> 128): padding by tokens on
the heavy-tailed mix 3.1% -> 1.7% -> 0.9% at 8-256 ranks, idle per step 0.27-0.78% -> 0.08-0.15%,
CPU per step not higher, peak 9-25 -> 16-61 MiB (1M samples at 256 ranks and K = 128: 61-67 MiB,
so K = 64 there). Packed, it packs step by step (K does not change the packs): 32 steps, at most
:data:`STEP_MIX_PACKS` packs.

Packed windows are sized in packs, and also in samples where a pack holds many: a packed
window's planning holds about 53 bytes a sample (the step mix, packing step by step, holds
the window's ids, 8 bytes a sample, beside one step's packing), so short samples would make a
window of 2^16 packs 2.5 million samples of 217 tokens and 123 MiB.
:func:`packed_samples_per_pack` reads the most samples a pack holds on average under the run's
weights off the length index, and the window holds at most :data:`WINDOW_MIX_PACKED_SAMPLES`
(:data:`STEP_MIX_PACKED_SAMPLES`) of them. The window mix's packs, 2^17, are about what 2^20
samples fill on the benchmark's mixes (5-9 samples a pack of 8,192 tokens), so their peak stays
at 36-56 MiB; 2^16 packs (before 7 December 2026) used half of that for more idle at large
global batches (``tools/bench_packed_window_memory.py``).

``planned_mix="window"`` sizes its window in samples, not steps: a window's steps are bands of
the window's sorted lengths, so what decides how narrow a band is (padding) and how alike a
step's samples are (idle) is how many samples the window sorts, the more the better, while its
memory grows as the samples. The plan is built in its own memory (:mod:`.window_mix_buffer`:
8 bytes a sample, 14 while its samples are sorted, a peak of 59-62 MiB at 2^22 samples), except
under the warmup's caps, whose planner holds each candidate's id, age and sort key besides it
(about 40 bytes a sample). So the window holds about :data:`WINDOW_MIX_SAMPLES` (2^22) samples,
:data:`WINDOW_MIX_CAPPED_SAMPLES` (2^20) with ``seq_length_warmup`` (packed:
:data:`WINDOW_MIX_PACKS` packs of about seven samples each at 8,192 tokens), at most
:data:`MAX_WINDOW_MIX_STEPS` steps, at least one:

============================  ===========  ===============================================
shape (G = R M B per step)    K            samples per window
============================  ===========  ===============================================
2 ranks, M = 1, B = 4         4,096        32,768 (at K = 32: 256)
8 ranks, M = 2, B = 4         4,096        262,144 (at K = 32: 2,048)
1,024 ranks, M = 8, B = 4     128          4,194,304 (warmup: 32)
16,384 ranks, M = 1, B = 4    64           4,194,304 (warmup: 16)
16,384 ranks, M = 8, B = 4    8            4,194,304 (warmup: 2; K = 32: 2^24 ids)
============================  ===========  ===============================================

Measured by ``tools/bench_planned.py --quick`` (5 December, 8 ranks, M = 2, B = 4, padded):
lost compute (idle per optimizer step + padding by tokens) 0.02-0.04% on the trimodal, demo and
heavy-tailed mixes with K = 4,096, 0.05-0.14% with K = 1,024, 1.4-4.0% with K = 32 (2,048
samples a window), against 0.79-1.14% for a batch pool of 100,000 samples; on the demo's 5,200
samples at M = 1 (``advise``, 7 December) 1.9% at the 100 steps that data allows against 5.6%
with K = 32 (0.1% at 4,096 steps before then came from copies of samples sharing steps). At 1,024 ranks (7 December, side by side,
one window each, M = 1 and 8) 2^22 samples against 2^20 lost 0.04-0.36% against 0.25-1.28%, for
the same planning CPU per step and a peak of 37-38 MiB; at 16,384 ranks x 1 and x 8 they idle
2.4-6.9% per step against 9.3-40% (``docs/benchmarks.md``, *Windows at 16,384 ranks*). Packed
at 1,024 ranks, M = 8, K = 15-16 peaks at 36-53 MiB (K = 8: 18-28 MiB; K = 32: 143-203 MiB).

The mix of a ``"window"`` plan holds per window, so a longer window spreads a source's share
over more steps: a mixture schedule whose weights change within K steps is followed per window
(its zero weights still per step). Set ``plan_window_steps`` to bound that.

On repeating data the build also keeps a default window within one epoch of every source
(:func:`steps_within_an_epoch`, read off the length index): a window sorts its draws by length,
so the copies of a sample drawn twice in it (one length) would share an optimizer step; a given
``plan_window_steps`` beyond that is kept and warned about (:func:`window_epoch_draws`). K
depends only on the global batch, the length index and the weights, which an elastic resume
keeps; a resume that changes the global batch (``allow_global_batch_change``) needs
``plan_window_steps`` set to the saved run's K.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .mix import PlannedMix, check_planned_mix
from .window import DEFAULT_WINDOW_STEPS

__all__ = ["MAX_WINDOW_MIX_STEPS", "MAX_WINDOW_STEPS", "STEP_MAX_WINDOW_STEPS", "STEP_MIX_PACKS",
           "STEP_MIX_MAX_SAMPLES", "STEP_MIX_SAMPLES", "WINDOW_MIX_CAPPED_SAMPLES",
           "WINDOW_MIX_PACKS", "WINDOW_MIX_PACKED_SAMPLES", "STEP_MIX_PACKED_SAMPLES",
           "PACKED_PLAN_BYTES_PER_SAMPLE", "packed_step_over_budget",
           "WINDOW_MIX_SAMPLES", "default_window_steps", "packed_samples_per_pack",
           "steps_within_an_epoch", "window_epoch_draws"]

#: The largest ``plan_window_steps`` of the step mix (``OrderingConfig`` refuses more): its
#: balancing costs memory and time that grow as K^2.
MAX_WINDOW_STEPS = 1024
#: The largest ``plan_window_steps`` of the window mix, whose cost grows with its samples only:
#: at 2 ranks x 1 x 4 a window of 1,024 steps (8,192 samples) lost 0.20-0.56% where a 100,000-
#: sample batch pool lost 0.20-0.24%; 4,096 steps lost 0.06-0.16% (``tools/bench_planned.py``).
MAX_WINDOW_MIX_STEPS = 4096
#: Samples a ``"window"`` plan of padded micro-batches aims for without the warmup's caps: 2^22
#: ids, planned in their own 32 MiB and a peak of 59-61 MiB (``tools/bench_window_mix_memory.py``
#: at 98329d7, ``tools/bench_planned.py`` at c65b2ac: the counting sort's and the dealing's
#: temporaries beside the plan).
WINDOW_MIX_SAMPLES = 1 << 22
#: The same under the warmup's caps (``seq_length_warmup``), whose planner holds each
#: candidate's id, age and sort key besides the plan: 2^20 ids, a peak of 45-47 MiB.
WINDOW_MIX_CAPPED_SAMPLES = 1 << 20
#: Packs a packed ``"window"`` plan aims for (and at most :data:`WINDOW_MIX_PACKED_SAMPLES`
#: samples): 2^17 packs of 8,192 tokens hold about 890,000 samples of the trimodal mix, a peak
#: of 36-53 MiB on the benchmark's three mixes (1,024 ranks, M = 8: K = 15-16; K = 32 peaked at
#: 143-203 MiB). 2^16 until 7 December 2026.
WINDOW_MIX_PACKS = 1 << 17
#: Samples a packed window holds at most, whatever its packs: a packed ``"window"`` plan holds
#: about 53 bytes a sample while it plans (``tools/bench_planned.py``'s mixes and 220-token
#: samples alike), so 2^20 samples peak near 53 MiB. Short samples fill a pack with many: 2^16
#: packs of 8,192 tokens hold 2.5 million samples of 217 tokens (123 MiB), and the window
#: then holds fewer packs (:func:`packed_samples_per_pack`).
WINDOW_MIX_PACKED_SAMPLES = 1 << 20
#: The same for a packed ``"step"`` plan, which packs step by step and holds the window's ids
#: (8 bytes a sample) beside one step's packing (about 53 bytes a sample): 2^17 packs of
#: 217-token samples peaked at 116 MiB, 2^21 samples at 16,384 ranks x 1-2 packs at 64.5-64.9
#: MiB. K does not change its packs, so a shorter window costs nothing.
STEP_MIX_PACKED_SAMPLES = 1 << 20
#: Bytes a packed plan holds a sample while it plans (the packed windows' budgets above).
PACKED_PLAN_BYTES_PER_SAMPLE = 53
#: Samples a padded ``"step"`` plan's window aims for (module docstring).
STEP_MIX_SAMPLES = 1 << 19
#: Samples beyond which a ``"step"`` window holds fewer than 32 steps by default (module
#: docstring: 32 steps of 16,384 ranks x 8 x 4 would be 2^24 ids).
STEP_MIX_MAX_SAMPLES = 1 << 20
#: The most steps a ``"step"`` window takes by default (its balancing grows as K^2).
STEP_MAX_WINDOW_STEPS = 128
#: Packs a packed ``"step"`` plan's window holds at most: it packs step by step, so 16 steps of
#: 1,024 ranks x 8 packs (2^17); 2^18 packs (2 steps of 16,384 ranks x 8) peaked at 109 MiB.
STEP_MIX_PACKS = 1 << 17


def default_window_steps(mix: PlannedMix | str, draws_per_step: int, packed: bool = False,
                         capped: bool = False, samples_per_pack: float | None = None) -> int:
    """K when ``plan_window_steps`` is not given (module docstring).

    Args:
        mix: ``planned_mix``.
        draws_per_step: G = R M B: samples (padded) or packs (packed) per optimizer step.
        packed: Whether the plan packs (G counts packs).
        capped: Whether a sequence-length warmup caps the steps (``seq_length_warmup``).
        samples_per_pack: Packed: the most samples a pack holds on average under any of the
            run's weights (:func:`packed_samples_per_pack`, from the length index); None: the
            packs alone decide.

    Returns:
        ``"window"``: ``clamp(2^22 // G, 1, 4,096)`` (capped ``2^20 // G``, packed
        ``2^17 // G`` and at most 2^20 samples); ``"step"``: ``clamp(2^19 // G, 32, 128)``,
        below 32 only as ``2^20 // G`` (packed ``clamp(2^17 // G, 1, 32)`` and at most 2^20
        samples).
    """
    mix = check_planned_mix(mix)
    g = int(draws_per_step)
    if g < 1:
        raise ValueError(f"default_window_steps: draws_per_step = {g}; give an int >= 1.")
    if packed:
        packs, samples, most = ((WINDOW_MIX_PACKS, WINDOW_MIX_PACKED_SAMPLES, MAX_WINDOW_MIX_STEPS)
                                if mix == "window" else
                                (STEP_MIX_PACKS, STEP_MIX_PACKED_SAMPLES, DEFAULT_WINDOW_STEPS))
        if samples_per_pack is not None:
            if not samples_per_pack >= 1:  # also NaN
                raise ValueError(f"default_window_steps: samples_per_pack = {samples_per_pack}; "
                                 "give a number >= 1 (packed_samples_per_pack).")
            packs = min(packs, int(samples / samples_per_pack))
        return max(1, min(most, packs // g))
    if mix == "window":
        samples = WINDOW_MIX_CAPPED_SAMPLES if capped else WINDOW_MIX_SAMPLES
        return max(1, min(MAX_WINDOW_MIX_STEPS, samples // g))
    at_most_32 = min(DEFAULT_WINDOW_STEPS, STEP_MIX_MAX_SAMPLES // g)  # 32 up to 2^20 samples
    return max(1, min(STEP_MAX_WINDOW_STEPS, max(at_most_32, STEP_MIX_SAMPLES // g)))


def packed_samples_per_pack(lengths: Sequence[np.ndarray], weights: np.ndarray, cap: int,
                            most_read: int = 1 << 16) -> float:
    """The most samples a pack of ``cap`` tokens holds on average under any row of
    ``weights``: ``cap / sum_s w_s mean_s(min(L, cap))``, at least 1.

    A pure function of the length index (read at ``most_read`` evenly spaced samples of each
    source at most: the same on every rank, and a mean within about 1% on heavy tails), the
    weights and the cap, for :func:`default_window_steps`.

    Args:
        lengths: Per source, every sample's length (the length index).
        weights: ``[n, S]`` rows of weights the run can draw by (the blend weights, or the
            mixture schedule's at the ends of its pieces: between them its mean length moves
            monotonically). Rows are normalised here.
        cap: Tokens per pack (the largest cap of the run).
    """
    w = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    if w.shape[1] != len(lengths) or not np.isfinite(w).all() or (w < 0).any() or (
            w.sum(axis=1) <= 0).any():
        raise ValueError(f"packed_samples_per_pack: weights of shape {w.shape} for "
                         f"{len(lengths)} sources; give rows of finite weights >= 0, one > 0.")
    means = np.zeros(len(lengths))
    for s, x in enumerate(lengths):
        n = len(x)
        if n:
            at = np.linspace(0, n - 1, min(n, int(most_read))).astype(np.int64)
            means[s] = float(np.minimum(np.asarray(x)[at], cap).astype(np.float64).mean())
    mean = (w / w.sum(axis=1, keepdims=True)) @ means
    least = float(mean.min())
    return max(1.0, float(cap) / least) if least > 0 else float(cap)


def packed_step_over_budget(mix: PlannedMix | str, packs_per_step: int,
                            samples_per_pack: float) -> float | None:
    """The samples one packed optimizer step holds where they are over the mix's window budget
    (:data:`WINDOW_MIX_PACKED_SAMPLES`, :data:`STEP_MIX_PACKED_SAMPLES`), else None.

    A window holds at least one step, and a step is planned at once, so such a step's planning
    peaks above the budget's memory (about :data:`PACKED_PLAN_BYTES_PER_SAMPLE` bytes a sample)
    whatever ``plan_window_steps`` is: 16,384 ranks x 8 packs of 8,192 tokens of 217-token
    samples are about 4.9 million samples a step."""
    mix = check_planned_mix(mix)
    budget = WINDOW_MIX_PACKED_SAMPLES if mix == "window" else STEP_MIX_PACKED_SAMPLES
    samples = float(packs_per_step) * float(samples_per_pack)
    return samples if samples > budget else None


def window_epoch_draws(sizes: Sequence[int], weights: np.ndarray, samples_per_step: float,
                       window_steps: int) -> np.ndarray:
    """Per source, the most draws a window of ``window_steps`` steps takes of it, as a share of
    its size (its epoch): ``max_row(w_s) x samples_per_step x K / size_s`` (0 for a source
    without weight or samples).

    Above 1, a window draws some of the source's samples twice or more; the window's sort by
    length then puts the copies of a sample (one length) side by side, in one optimizer step.

    Args:
        sizes: Samples of each source (its length index).
        weights: ``[n, S]`` rows of weights the run can draw by (normalised here), as
            :func:`packed_samples_per_pack`'s.
        samples_per_step: Samples an optimizer step draws: ``R M B`` padded; packed, its packs
            times the most samples a pack holds (:func:`packed_samples_per_pack`).
        window_steps: K.
    """
    w = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    n = np.asarray(sizes, dtype=np.float64)
    if w.shape[1] != len(n) or not np.isfinite(w).all() or (w < 0).any() or (
            w.sum(axis=1) <= 0).any() or (n < 0).any():
        raise ValueError(f"window_epoch_draws: weights of shape {w.shape} for {len(n)} source "
                         "sizes; give rows of finite weights >= 0, one > 0, and sizes >= 0.")
    share = (w / w.sum(axis=1, keepdims=True)).max(axis=0)
    draws = share * float(samples_per_step) * int(window_steps)
    return np.divide(draws, n, out=np.zeros_like(draws), where=n > 0)


def steps_within_an_epoch(sizes: Sequence[int], weights: np.ndarray,
                          samples_per_step: float) -> int:
    """The most steps a window holds while it draws no source beyond its size (one epoch of
    it; :func:`window_epoch_draws` <= 1), at least 1: a source smaller than its share of one
    step repeats samples in any order."""
    per_step = window_epoch_draws(sizes, weights, samples_per_step, 1)
    drawn = per_step > 0
    if not drawn.any():
        return MAX_WINDOW_MIX_STEPS
    # 1e-9: a window of exactly one epoch (size / draws a step whole) is not cut by rounding
    return max(1, int(np.floor((1.0 / per_step[drawn]).min() + 1e-9)))
