"""The planned global order with sequence packing: this rank's packs of the plan.

With ``length_sort_mode = "planned"`` and packing (``packing_buffer_size``), the plan decides
the packs (:func:`energon_ordering.planned.packs.plan_packed_window`): every step's R x M x B
packs are built to the step's cap (``pack_seq_length``, or the sequence-length warmup's cap at
that step) and balanced across the ranks by attention cost. This rank reads the samples of its
packs as :class:`~.planned_source.PlannedSourceDataset` reads a micro-batch's, and the
pipeline continues::

    PlannedPackSourceDataset -> encode_sample -> PlannedPackDataset -> BatchDataset -> stamp

Each sample's restore key carries its pack (:meth:`PlannedPackSourceDataset._sample_tag`:
micro-batch, pack, position, pack size, cap), so :class:`PlannedPackDataset` groups the encoded
samples into the plan's packs, cuts a sample longer than the cap with the warmup's cutter, and
calls the encoder's ``pack_selected_samples`` on each (the encoder's ``select_samples_to_pack``
is not used: the plan selected). A micro-batch is B packs.

State: the source's (the next micro-batch, the sample within it, the plan cursor) and the
encoded samples of the pack being filled (their restore keys, as Energon's buffers save them).
A resume re-plans the window from the cursor and continues exactly.

Elastic resume (another data-parallel size or micro-batch count, the same global batch of
packs, at an optimizer step): every window stays planned for the run's first shape of that
global batch, so every step keeps the packs (and caps) of the uninterrupted run, dealt to the new
ranks by attention cost (:func:`~energon_ordering.planned.packs.deal_packs`). With
``allow_global_batch_change`` the global batch may change at a plan window boundary: the windows
from there on are planned for it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import numpy as np
from megatron.energon.flavors.base_dataset import SavableDataset, set_sample_restore_key
from megatron.energon.wrappers.base import BaseWrapperDataset, get_sample_restore_key
from megatron.energon.wrappers.buffer import SavableSampleBuffer
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig

from energon_ordering.errors import OrderingConfigError, show
from energon_ordering.saved_counters import check_saved_counts
from energon_ordering.state_stamp import check_writer
from energon_ordering.planned.balance import sample_cost
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.plan_check import packed_plan_matches_inputs
from energon_ordering.planned.packs import (
    PACKED_PLAN_VERSION,
    PackedWindowPlan,
    deal_packs,
    plan_packed_window,
)
from energon_ordering.warmup.cap_cut import CapCutter, new_counts
from energon_ordering.warmup.pack_cap import PACK_WORDING, pack_target, packing_round
from energon_ordering.warmup.schedule import SeqLenWarmup
from energon_ordering.warmup.token_layout import TokenLayout

from .plan_ahead import WindowAtHand
from .planned_source import (PACKING_CHANGED, RESTORE_KIND, PlannedSourceDataset, _cursor_of,
                             _cursor_state)
from .shared_plans import stream_digest

__all__ = ["PlannedPackDataset", "PlannedPackSourceDataset", "pack_tag"]

logger = logging.getLogger(__name__)

#: Fields of a sample's pack tag in its restore key, after (kind, source, index).
TAG_FIELDS = ("micro_batch", "pack", "position", "pack_size", "cap")


def pack_tag(sample: Any) -> tuple[int, int, int, int, int] | None:
    """The pack tag (micro-batch, pack, position, pack size, cap) of an encoded sample, read
    from its restore key (None: not a sample of a packed plan)."""
    key = get_sample_restore_key(sample)
    if key is None:
        return None
    key = tuple(key)
    for i in range(len(key) - 2, -1, -1):
        if key[i] == RESTORE_KIND and len(key) - i == 3 + len(TAG_FIELDS):
            return tuple(int(x) for x in key[i + 3:])  # type: ignore[return-value]
    return None


class PlannedPackSourceDataset(PlannedSourceDataset):
    """This rank's packs of the planned global order (see the module docstring).

    Args (besides :class:`~.planned_source.PlannedSourceDataset`'s; ``batch_size`` is B, packs
    per micro-batch):
        pack_seq_length: Tokens per pack (None: the warmup's ``full``).
        warmup: The sequence-length warmup (packs of step s hold at most its cap at s), or None.
    """

    def __init__(self, *args: Any, pack_seq_length: int | None,
                 warmup: SeqLenWarmup | None, **kwargs: Any):
        if pack_seq_length is None and warmup is None:
            raise OrderingConfigError(
                "OrderingConfig.length_sort_mode = 'planned' with packing plans packs to a cap: "
                "set OrderingConfig.pack_seq_length (Megatron: --packing-seq-length).")
        self.pack_seq_length = pack_seq_length
        self.warmup = warmup
        super().__init__(*args, warmup=warmup, **kwargs)

    _packed = True

    def _expected_stamp(self) -> dict[str, Any]:
        return {
            **super()._expected_stamp(),
            "packing": {
                "packed_plan_version": PACKED_PLAN_VERSION,
                "pack_seq_length": self.pack_seq_length,
                "warmup": None if self.warmup is None else self.warmup.to_dict(),
            },
        }

    def end_step(self) -> int | None:
        """Unknown before the plan reaches it: a packed step's sample count depends on the
        lengths drawn (see :meth:`_epoch_over`)."""
        return None

    # -- the plan --------------------------------------------------------------------------

    def _caps(self, first: int, steps: int) -> list[int]:
        return [int(pack_target(first + t, self.pack_seq_length, self.warmup))
                for t in range(steps)]

    def _plan_from(self, cursor: PlanCursor) -> PackedWindowPlan:
        """The plan of the cursor's window, for the shape its packs are composed for
        (:meth:`_plan_shape`: the run's shape before any elastic restore that kept the global
        batch of packs); :meth:`_rank_step` deals a step run at another shape."""
        K = self.window_steps
        first = cursor.window * K
        R, M, B = self._plan_shape(first)
        limits = None
        if self.finite:
            limits = [(self._epoch + 1) * n for n in self.ids.sizes]
        weights, caps = self._step_weights(first, K), self._caps(first, K)
        inputs = stream_digest(PACKED_PLAN_VERSION, _cursor_state(cursor),
                               hashlib.sha256(weights.tobytes()).hexdigest(), caps, limits,
                               *(("window",) if self.planned_mix == "window" else ()))
        flat = self._shared_plans(R, M, B).ids(
            cursor.window, inputs, (-1,),
            lambda: plan_packed_window(
                self.lengths, seed=self.seed, cursor=cursor, weights=weights, caps=caps,
                world_size=R, micro_batch=B, micro_batches_per_step=M, epoch_limits=limits,
                mix=self.planned_mix,
            ).to_array(),
            check=lambda a: packed_plan_matches_inputs(
                a, seed=self.seed, sizes=self.ids.sizes, cursor=cursor, weights=weights,
                caps=caps, shape=(R, M, B), epoch_limits=limits, mix=self.planned_mix))
        plan = PackedWindowPlan.from_array(flat, cursor)
        if self.finite and cursor.window == 0 and plan.steps == 0:
            raise OrderingConfigError(
                f"planned order: a finite epoch (repeat=False) of sources of "
                f"{list(self.ids.sizes)} samples holds no full optimizer step of "
                f"{self._global_batch()} packs; use more data, a smaller global batch, or "
                "repeat=True.")
        return plan

    def packed_plan(self, window: int, b: int | None = None) -> PackedWindowPlan:
        """The packed plan of ``window`` (a plan with fewer steps than ``plan_window_steps``,
        possibly none, once a finite epoch ends), without its packs (this rank's are in the
        window at hand, :meth:`_at_hand`); the saved cursor moves to it."""
        return self._at_hand(window, b).plan

    def _plan_rows(self, window: int, start: dict[str, Any]) -> WindowAtHand:
        """Plans the windows from the cursor ``start`` (saved form) to ``window``, or to the
        end of a finite epoch before it, and keeps this rank's packs of each of its steps
        (:meth:`_rank_step`). Reads the configuration only: it may run on the planning-ahead
        thread."""
        cursor = _cursor_of(start)
        if window < cursor.window:
            raise OrderingConfigError(
                f"PlannedPackSourceDataset: window {window} lies before the cursor's window "
                f"{cursor.window}; the state is inconsistent, start fresh.")
        while True:
            plan = self._plan_from(cursor)
            if cursor.window == window or plan.epoch_end:
                break
            cursor = plan.next_cursor
        rank = int(self.worker_config.rank)
        first = plan.cursor.window * self.window_steps
        steps: list[tuple[np.ndarray, np.ndarray] | None] = []
        for k in range(plan.steps):
            R, M, B = self._shape_at(first + k)
            if (R, M, B) == plan.shape:
                steps.append(tuple(np.copy(x) for x in plan.rank_step(k, rank))
                             if rank < R else None)  # type: ignore[arg-type]
            else:  # an elastic resume inside the window: its packs, dealt to this shape
                steps.append(self._redealt(plan, k, R, M * B, rank))
        # keep the window's cursor and step count, not every rank's packs (the shared plan's
        # memory map is released with them)
        return WindowAtHand(plan.cursor.window, _cursor_state(plan.cursor),
                            _cursor_state(plan.next_cursor), steps, plan.without_packs(),
                            last=bool(plan.epoch_end))

    def _epoch_over(self, b: int) -> bool:
        if not self.finite:
            return False
        window, t = divmod(b // self.micro_batches_per_step, self.window_steps)
        plan = self.packed_plan(window, b)
        return plan.cursor.window < window or t >= plan.steps

    def _rank_step(self, step: int, b: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """This rank's samples of optimizer ``step`` (flat, in pack order) and the offsets of its
        packs in them; None if this rank had no share of the step (an elastic resume's rank
        beyond the earlier shape, before the resume's step)."""
        window, t = divmod(step, self.window_steps)
        return self._at_hand(window, b).rows[t]

    def _redealt(self, plan: PackedWindowPlan, k: int, world_size: int, packs_per_rank: int,
                 rank: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``rank``'s packs of the window's step ``k`` when the step's packs (planned for
        ``plan.shape``) are dealt to ``world_size`` ranks of ``packs_per_rank`` packs
        (:func:`~energon_ordering.planned.packs.deal_packs`, by attention cost)."""
        if rank >= world_size:
            return None
        R0, M0, B0 = plan.shape
        G = R0 * M0 * B0
        bounds = plan.offsets[k * G:(k + 1) * G + 1]
        ids = plan.ids[bounds[0]:bounds[-1]]
        rel = bounds - bounds[0]
        L = np.minimum(self.lengths_of(ids), int(plan.caps[k]))
        costs = np.add.reduceat(sample_cost(L), rel[:-1])
        mine = deal_packs(costs, world_size, packs_per_rank)[rank]
        out = [ids[rel[p]:rel[p + 1]] for p in mine.tolist()]
        sizes = [len(x) for x in out]
        return np.concatenate(out), np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)

    def _micro_batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Micro-batch ``b``'s ids and the ``[B + 1]`` offsets of its packs in them."""
        step, m = divmod(int(b), self.micro_batches_per_step)
        rows = self._rank_step(step, b)
        if rows is None:
            raise OrderingConfigError(
                f"PlannedPackSourceDataset: rank {self.worker_config.rank} has no share of "
                f"optimizer step {step}, planned before an elastic resume for fewer ranks.")
        ids, bounds = rows
        B = self.batch_size
        mb = bounds[m * B:(m + 1) * B + 1]
        return ids[mb[0]:mb[-1]], mb - mb[0]

    def micro_batch_ids(self, b: int) -> np.ndarray:
        return self._micro_batch(b)[0]

    def _sample_tag(self, b: int, pos: int) -> tuple[int, ...]:
        _, bounds = self._micro_batch(b)
        p = int(np.searchsorted(bounds, pos, "right")) - 1
        step = int(b) // self.micro_batches_per_step
        cap = int(pack_target(step, self.pack_seq_length, self.warmup))
        return (int(b), p, int(pos - bounds[p]), int(bounds[p + 1] - bounds[p]), cap)

    def len_worker(self, worker_idx: int | None = None) -> int:
        """Samples of one pass over all sources, this worker's share (an estimate: a packed
        step's sample count depends on the lengths drawn)."""
        return max(1, self.ids.total // (int(self.worker_config.world_size) * self._workers()))

    def __str__(self) -> str:
        return (f"PlannedPackSourceDataset(sources={list(self.ids.sizes)}, seed={self.seed}, "
                f"window_steps={self.window_steps}, micro_batches_per_step="
                f"{self.micro_batches_per_step}, packs_per_micro_batch={self.batch_size}, "
                f"pack_seq_length={self.pack_seq_length}, warmup={self.warmup})")


class PlannedPackDataset(BaseWrapperDataset[Any, Any]):
    """Groups the encoded samples of :class:`PlannedPackSourceDataset` into the plan's packs.

    A pack is complete when its last sample arrives; a sample of another pack arriving first
    (the encoder skipped one) completes the one being filled. Each sample longer than its
    pack's cap is cut to it by the cutter sequence packing uses in every mode
    (:class:`~energon_ordering.warmup.cap_cut.CapCutter`, with ``seq_length_overflow`` for
    media beyond the cap), and ``final_packer`` (the encoder's ``pack_selected_samples``) makes
    the pack. A restored pack is cut and packed again from its samples' restore keys.

    Args:
        dataset: The encoded samples (``encode_sample`` over the packed source).
        final_packer: ``list of samples -> packed sample``.
        layout: How to cut the encoder's samples (``ordering_token_layout``).
        overflow: ``seq_length_overflow``.
        sample_encoder: The encoder's own ``postencode_sample``, applied to a pack's samples
            before ``final_packer`` as Energon's packer does (None: the encoder has none).
        length_fn: The encoder's ``ordering_sample_length``: a pack whose samples exceed its
            cap by it is counted and warned about (None: not checked).
        micro_batches_per_step: M (the step of a pack, for ``cut``).
    """

    _savable_fields = ("_buffer", "_counts")

    def __init__(self, dataset: SavableDataset, *, final_packer: Callable[[list[Any]], Any],
                 layout: TokenLayout, overflow: str, micro_batches_per_step: int,
                 sample_encoder: Callable[[Any], Any] | None = None,
                 length_fn: Callable[[Any], float] | None = None,
                 worker_config: WorkerConfig):
        super().__init__(dataset, worker_config=worker_config)
        self.final_packer = final_packer
        self.sample_encoder = sample_encoder
        self.length_fn = length_fn
        self._warned = False
        self.cutter = CapCutter(overflow=overflow, layout=layout, wording=PACK_WORDING,
                                owner=type(self).__name__)
        self.micro_batches_per_step = int(micro_batches_per_step)
        self.reset_state_own()

    @staticmethod
    def _new_counts() -> dict[str, int]:
        return {**new_counts(), "packs_over_cap": 0}

    def reset_state_own(self) -> None:
        # the encoded samples of the pack being filled (saved as their restore keys)
        self._buffer = SavableSampleBuffer(self.dataset, worker_config=self.worker_config)
        # cut / kept / dropped samples and packs over their cap, of the packs emitted (saved:
        # :func:`~energon_ordering.inspect.diagnostics.warmup_counts` sums them over workers)
        self._counts = self._new_counts()

    def restore_state(self, state: FlexState) -> None:
        check_writer(type(self).__name__, state, PACKING_CHANGED)
        if "_counts" not in state:  # saved before the counters were: counted from here on
            state = type(state)({**state, "_counts": self._new_counts()})
        check_saved_counts(type(self).__name__, "_counts", state["_counts"],
                           self._new_counts().keys())
        super().restore_state(state)

    def counts(self) -> dict[str, int]:
        """This worker's counters: seen, truncated, truncated_tokens, kept_over_cap, dropped,
        packs_over_cap."""
        return dict(self._counts)

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def _pack(self, samples: list[Any], keys: Sequence[Any], counts: dict[str, int]) -> Any:
        """The pack of ``samples`` (restore keys ``keys``), each cut to the pack's cap, counted
        into ``counts``."""
        tag = pack_tag(samples[0])
        assert tag is not None
        step = tag[0] // self.micro_batches_per_step
        kept_whole = counts["kept_over_cap"]
        kept = [self.cutter.cut(x, tag[4], step=step, counts=counts) for x in samples]
        cut = [k[0] for k in kept if k is not None]
        if not cut:
            return None
        if self.length_fn is not None:
            # the cutter keeps a sample whole where its media tokens alone are over the cap
            self._check_fit(cut, tag[4], step, counts,
                            media_over_cap=counts["kept_over_cap"] > kept_whole)
        if self.sample_encoder is not None:  # as Energon's packer: on the selected samples
            cut = [self.sample_encoder(x) for x in cut]
        with packing_round(tag[4]):  # ordering_pack_target() answers the plan's cap
            packed = self.final_packer(cut)
        return set_sample_restore_key(packed, *keys, src=self)

    def _check_fit(self, samples: list[Any], cap: int, step: int, counts: dict[str, int],
                   media_over_cap: bool = False) -> None:
        """Counts (and warns once per worker about) a pack whose encoded samples hold more
        tokens than its cap: the plan packed the length index's lengths, so the encoder
        measures samples longer than the index says. The pack goes out as planned (nothing is
        dropped or moved: every rank's plan stays the same)."""
        total = sum(float(self.length_fn(x)) for x in samples)  # type: ignore[misc]
        if total <= cap:
            return
        counts["packs_over_cap"] += 1
        if not self._warned and media_over_cap:
            # what the cut may not shorten (a media item's tokens) is longer than the cap,
            # whatever the length index says
            self._warned = True
            logger.warning(
                "planned packing: a pack of optimizer step %d holds %d tokens, over its cap of "
                "%d, because the cut could not shorten a sample of it (its media tokens alone "
                "are over the cap: kept whole). Raise the cap above a media item's tokens "
                "(seq_length_warmup.start, or pack_seq_length); this pack and later ones go "
                "out as planned (counted as packs_over_cap).", step, int(total), cap)
        if not self._warned:
            self._warned = True
            logger.warning(
                "planned packing: a pack of optimizer step %d holds %d tokens, over its cap of "
                "%d: the encoder measures its samples longer than the length index does. "
                "Rebuild the index with the task encoder and decoder this loader uses "
                "(`energon-ordering index`); this pack and later ones go out as planned "
                "(counted as packs_over_cap).", step, int(total), cap)

    def _emit(self) -> Iterator[Any]:
        """Packs the buffered samples (the pack being filled) and yields the pack, if any."""
        samples, keys = self._buffer.flush()
        out = self._pack(samples, keys, self._counts)
        if out is not None:
            yield out

    def __iter__(self) -> Iterator[Any]:
        buf = self._buffer
        buf.worker_start()  # a restored buffer re-reads its samples
        # (micro-batch, pack) of the pack being filled
        filling = pack_tag(buf.buffer[0])[:2] if buf.buffer else None
        for sample in self.dataset:
            tag = pack_tag(sample)
            if tag is None:
                raise OrderingConfigError(
                    f"PlannedPackDataset: a sample without a pack tag in its restore key "
                    f"({show(get_sample_restore_key(sample))}); the encoder's encode_sample must keep "
                    "the sample's __restore_key__ (Energon does by default).")
            if buf.buffer and filling != tag[:2]:  # the encoder skipped the pack's last sample
                yield from self._emit()
            buf.append(sample)
            filling = tag[:2]
            if tag[2] + 1 == tag[3]:
                yield from self._emit()
        if buf.buffer:
            yield from self._emit()

    def can_restore_sample(self) -> bool:
        return self.dataset.can_restore_sample()

    def restore_sample(self, restore_key: tuple[Any, ...]) -> Any:
        kind, *keys = restore_key
        if kind != type(self).__name__:
            raise OrderingConfigError(
                f"PlannedPackDataset: restore key {show(restore_key)} is not ours.")
        samples = [self.dataset.restore_sample(k) for k in keys]
        return self._pack(samples, keys, self._new_counts())  # counted when it was emitted

    def config(self) -> dict[str, Any]:
        return {"type": type(self).__qualname__, "dataset": self.dataset.config(),
                "final_packer": self._function_config(self.final_packer),
                "micro_batches_per_step": self.micro_batches_per_step}

    def __str__(self) -> str:
        return f"PlannedPackDataset(final_packer={self.final_packer}, dataset={self.dataset})"
