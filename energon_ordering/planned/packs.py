"""Packing in the planned global order: every step's packs, built to the step's cap, balanced.

With sequence packing (``packing_buffer_size``) a micro-batch is B *packs*, each a group of
samples whose tokens fit the cap of the step it is emitted in (``pack_seq_length``, or the
sequence-length warmup's cap at that step). The plan decides the packs, so every rank
computes the same ones and no rank packs its own slice. Per optimizer step (G = R M B packs):

1. **How many samples** (:func:`plan_packed_step`). The step's source counts for n samples are
   :func:`~energon_ordering.mixture.step_source_counts` of the step's weights for n draws with
   the carry (each source within one sample of ``weight x n``; cumulative counts track the
   integral). n is searched by :mod:`.pack_search`: the token bound (the largest count whose
   draws' tokens, each cut to the cap, fit ``G x cap``), packed first
   :data:`~.pack_search.START_MARGIN` below it. That count is taken if every draw fits and the
   ranks' idle is within :data:`~.pack_search.IDLE_TOLERANCE` (one packing: the usual case);
   else the count is lowered until every draw fits (and, where the ranks were unbalanced, from
   an emptier count: balance first; where no count balances, the one that loses the least
   compute, idle + padding), then bisected back up, to within
   :data:`~.pack_search.FILL_RESOLUTION`, to the largest count that packs whole with the ranks
   balanced as well. The step's counts stay exact for its n.
2. **Packs and ranks** (:func:`~.pack_fill.fill_packs`). Every rank owns ``M B`` packs (its M
   micro-batches of B packs). Each pack first takes one of the G longest samples (dealt in
   tuples of R, so no pack stays empty); the others, longest first, go to the rank with the
   smallest attention cost ``sum(L + L^2/4096)`` so far (longest-processing-time dealing,
   vectorised in rounds), into its cheapest pack that still has room. Ranks' costs agree to
   within about one sample's cost, and a rank's packs fill evenly.

A window (:func:`plan_packed_window`) plans its K steps one after the other from the plan
cursor (the permutation draws, the carry), so the plan stays a pure function of global
information, like :func:`~.window.plan_window`. A finite epoch ends before the first step that
would need more samples of a source than its epoch has left (:attr:`PackedWindowPlan.epoch_end`).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass

import numpy as np

from energon_ordering.errors import OrderingConfigError, show

from .cursor import PlanCursor, check_window_steps
from .lpt import deal_tuples
from .mix import PlannedMix, check_planned_mix
from .pack_fill import fill_packs
from .pack_search import IDLE_TOLERANCE, packed_count
from .sample_ids import SampleIds
from .sort_order import stable_by_int
from .source_draws import SourceDraws
from .window_packs import plan_window_packs

__all__ = ["PACKED_PLAN_VERSION", "PackedWindowPlan", "deal_packs", "fill_packs",
           "plan_packed_step", "plan_packed_window"]

#: Bumped whenever a packed plan changes for the same inputs; a packed planned state stamps it.
PACKED_PLAN_VERSION = 5  # 2: every pack seeded with one of the step's longest samples; 3: a
# step's count searched from 0.4% below the token bound, one packing where it fits and balances
# (pack_search.py); 4: the search's resolution measured against the count that did not pack; 5:
# where no count balances, the one that loses the least compute (idle + padding)


def deal_packs(pack_costs: np.ndarray, world_size: int, packs_per_rank: int) -> np.ndarray:
    """``[R, P]`` pack indices: one step's ``R P`` packs dealt to R ranks of P packs each.

    Used when a resume continues a step's packs at another data-parallel size (same global
    batch): the window balance's last step (:func:`~.lpt.deal_tuples`) on packs: costliest first,
    in tuples of R neighbours, each tuple's packs going costliest first to the ranks with the
    smallest running cost (ties by rank), so rank costs agree to within a tuple's spread."""
    R, P = int(world_size), int(packs_per_rank)
    c = np.asarray(pack_costs, dtype=np.float64)
    if len(c) != R * P:
        raise OrderingConfigError(
            f"planned packing: {len(c)} packs cannot be dealt to {R} ranks x {P} packs.")
    return deal_tuples(np.arange(R * P), c, R, P)


def plan_packed_step(streams: Sequence[SourceDraws], weights: np.ndarray, carry: np.ndarray, *,
                     cap: int, world_size: int, packs_per_rank: int,
                     limits: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """How many of each source's next draws one step takes, and its packs (see the module).

    Returns:
        ``(counts [S], carry [S], pack of each taken draw)`` (draws in source order), or None if
        the step would need more samples of a source than ``limits`` allows (a finite epoch's
        end).
    """
    found = packed_count(streams, weights, carry, cap=cap, world_size=world_size,
                         packs_per_rank=packs_per_rank, limits=limits,
                         idle_tolerance=IDLE_TOLERANCE)
    return None if found is None else (found.counts, found.carry, found.pack)


@dataclass(frozen=True)
class PackedWindowPlan:
    """The packed plan of one window.

    Attributes:
        ids: Global sample ids of every pack, in (step, rank, micro-batch, pack, position)
            order.
        offsets: ``[steps * R * M * B + 1]``: where each pack starts in ``ids``.
        counts: ``[steps, S]`` samples per step and source.
        caps: ``[steps]`` tokens per pack of each step.
        cursor: The cursor this window started from. next_cursor: The next window's.
        epoch_end: A finite epoch ends after this window's ``len(counts)`` steps (fewer than
            ``plan_window_steps`` if it ends inside the window).
    """

    ids: np.ndarray
    offsets: np.ndarray
    counts: np.ndarray
    caps: np.ndarray
    cursor: PlanCursor
    next_cursor: PlanCursor
    epoch_end: bool
    shape: tuple[int, int, int]

    @property
    def steps(self) -> int:
        return len(self.counts)

    def to_array(self) -> np.ndarray:
        """The plan as one flat int64 array (to share it between processes; the cursor it
        started from is the caller's): :meth:`from_array` reads it back."""
        R, M, B = self.shape
        S = self.counts.shape[1]
        head = [self.steps, int(self.epoch_end), S, R, M, B, len(self.ids)]
        carry = np.asarray(self.next_cursor.carry, dtype=np.float64).view(np.int64)
        return np.concatenate([np.asarray(head, np.int64),
                               np.asarray(self.next_cursor.drawn, np.int64), carry,
                               self.counts.ravel(), self.caps, self.offsets, self.ids]
                              ).astype(np.int64)

    @classmethod
    def from_array(cls, a: np.ndarray, cursor: PlanCursor) -> PackedWindowPlan:
        """The plan :meth:`to_array` wrote (``a`` may be a read-only memory map)."""
        steps, end, S, R, M, B, n = (int(x) for x in a[:7])
        at = 7
        drawn = a[at:at + S]
        at += S
        carry = np.asarray(a[at:at + S]).view(np.float64)
        at += S
        counts = np.array(a[at:at + steps * S]).reshape(steps, S)
        at += steps * S
        caps = np.array(a[at:at + steps])
        at += steps
        offsets = a[at:at + steps * R * M * B + 1]
        at += steps * R * M * B + 1
        ids = a[at:at + n]
        nxt = PlanCursor(cursor.window + 1, tuple(int(d) for d in drawn),
                         tuple(float(c) for c in carry))
        return cls(ids, offsets, counts, caps, cursor, nxt, bool(end), (R, M, B))

    def without_packs(self) -> PackedWindowPlan:
        """This plan without its packs (``ids``, ``offsets``): what a loader keeps of a window
        once it has its own rows (the packs may be a memory map of a shared plan)."""
        empty = np.zeros(0, dtype=np.int64)
        return dataclasses.replace(self, ids=empty, offsets=empty)

    @property
    def has_packs(self) -> bool:
        return len(self.offsets) > 0

    def rank_step(self, step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``rank``'s samples of the window's ``step`` (flat, in pack order) and the ``[M B +
        1]`` offsets of its packs in them."""
        R, M, B = self.shape
        p0 = (step * R + rank) * M * B
        bounds = self.offsets[p0:p0 + M * B + 1]
        return self.ids[bounds[0]:bounds[-1]], bounds - bounds[0]


def plan_packed_window(
    lengths: Sequence[np.ndarray],
    *,
    seed: int,
    cursor: PlanCursor,
    weights: np.ndarray,
    caps: Sequence[int],
    world_size: int,
    micro_batch: int,
    micro_batches_per_step: int,
    epoch_limits: Sequence[int] | None = None,
    mix: PlannedMix = "step",
) -> PackedWindowPlan:
    """Plans window ``cursor.window`` with packing: K = ``len(caps)`` steps of
    ``R x M x B`` packs, the packs of step t built to ``caps[t]`` tokens.

    Args:
        lengths: Per source, every sample's length (the length index).
        seed: The ordering seed. cursor: Where the window starts.
        weights: ``[K, S]`` normalised weights of the window's steps.
        caps: Tokens per pack of each step (``pack_seq_length``, or the warmup's cap).
        world_size: R. micro_batch: B, packs per micro-batch. micro_batches_per_step: M.
        epoch_limits: A finite epoch: per source, the draw count (over all source epochs) the
            epoch ends at; None: the sources repeat.
        mix: ``"step"``: every step's packs hold each source within one sample of its share of
            the step's samples; ``"window"``: the window's packs do, built from the window's
            draws and seeded by band (:mod:`.window_packs`; a window in which the schedule
            switches a source on or off, or a finite epoch ends, is packed per step).
    """
    mix = check_planned_mix(mix)
    ids_of = SampleIds.of([len(x) for x in lengths])
    S = len(ids_of.sizes)
    K = check_window_steps(len(caps))
    R, B, M = int(world_size), int(micro_batch), int(micro_batches_per_step)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (K, S):
        raise OrderingConfigError(
            f"planned packing: weights have shape {w.shape}, expected (steps={K}, sources={S}).")
    for t, c in enumerate(caps):
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or int(c) < 1:
            raise OrderingConfigError(
                f"planned packing: the pack cap of step {t} is {show(c)}; set "
                "OrderingConfig.pack_seq_length (Megatron: --packing-seq-length) to an int >= 1.")
    G = R * M * B
    streams = [SourceDraws(seed, s, lengths[s], cursor.drawn[s]) for s in range(S)]
    carry = np.asarray(cursor.carry, dtype=np.float64)
    drawn = np.asarray(cursor.drawn, dtype=np.int64)
    all_ids, all_sizes, counts, epoch_end = [], [], [], False
    if mix == "window":
        limits = None if epoch_limits is None else np.asarray(epoch_limits) - drawn
        got = plan_window_packs(streams, w, carry, np.asarray(caps, np.int64), seed=seed,
                                window=cursor.window, world_size=R, packs_per_rank=M * B,
                                limits=limits)
        if got is not None:
            c, carry, step_of, pack = got
            gid = np.concatenate([streams[s].take(int(k))[0] + off
                                  for s, (k, off) in enumerate(zip(c, ids_of.offsets.tolist()))])
            # packs in (step, rank, micro-batch, pack) order, samples in draw order within each
            # (one sort of the window, no per-step copies: a window of 16,384 ranks x 8 packs
            # holds a million samples)
            key = step_of.astype(np.int64)
            key *= G
            key += pack
            all_ids.append(gid[stable_by_int(key)])
            del gid
            all_sizes.append(np.bincount(key, minlength=K * G))
            del key
            step_of = step_of.astype(np.int64)
            src = np.repeat(np.arange(S, dtype=np.int64), c)
            counts.extend(np.bincount(step_of * S + src, minlength=K * S).reshape(K, S))
            del step_of, src, pack
            drawn = drawn + c
    for t in range(K if not counts else 0):  # the step mix (or a window it falls back to)
        limits = None if epoch_limits is None else np.asarray(epoch_limits) - drawn
        step = plan_packed_step(streams, w[t], carry, cap=int(caps[t]), world_size=R,
                                packs_per_rank=M * B, limits=limits)
        if step is None:
            epoch_end = True
            break
        c, carry, pack = step
        taken = [streams[s].take(int(k)) for s, k in enumerate(c)]
        gid = np.concatenate([ix + off for (ix, _), off in zip(taken, ids_of.offsets.tolist())])
        # packs in (rank, micro-batch, pack) order, samples in draw order within each
        all_ids.append(gid[stable_by_int(pack)])
        all_sizes.append(np.bincount(pack, minlength=G))
        counts.append(c)
        drawn = drawn + c
    counts_arr = (np.asarray(counts, dtype=np.int64) if counts
                  else np.zeros((0, S), dtype=np.int64))
    sizes_all = np.concatenate(all_sizes) if all_sizes else np.zeros(0, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes_all))).astype(np.int64)
    ids = np.concatenate(all_ids) if all_ids else np.zeros(0, dtype=np.int64)
    nxt = PlanCursor(cursor.window + 1, tuple(int(d) for d in drawn),
                     tuple(float(x) for x in carry))
    return PackedWindowPlan(ids, offsets, counts_arr, np.asarray(caps[:len(counts)], np.int64),
                            cursor, nxt, epoch_end, (R, M, B))
