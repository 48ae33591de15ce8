"""SeqLenWarmupDataset: caps sample lengths at batch time, keyed to the emission step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from megatron.energon.flavors.base_dataset import SavableDataset, add_sample_restore_key
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset

from energon_ordering.errors import OrderingConfigError, OrderingTypeError
from energon_ordering.saved_counters import check_saved_counts
from energon_ordering.state_stamp import check_stamp
from energon_ordering.step_clock import current_step, find_step_clock
from energon_ordering.warmup.cap_cut import (
    MAX_CONSECUTIVE_DROPS,
    CapCutter,
    CapWording,
    new_counts,
    new_epoch_counts,
)
from energon_ordering.warmup.schedule import SeqLenWarmup
from energon_ordering.warmup.token_layout import OVERFLOW_POLICIES, TokenLayout
from energon_ordering.errors import show

__all__ = ["MAX_CONSECUTIVE_DROPS", "OVERFLOW_POLICIES", "SeqLenWarmupDataset"]

T_sample = TypeVar("T_sample")


#: Version of the stage's saved-state layout and logic. 2: per-epoch counters (``_epoch``).
STATE_VERSION = 2

_WORDING = CapWording(
    stage="Sequence-length warmup",
    cap="warmup cap",
    kept="emitted uncut",
    unit="no batch can fill",
    fix="raise seq_length_warmup.start",
)


class SeqLenWarmupDataset(BaseWrapperDataset[T_sample, T_sample], Generic[T_sample]):
    """Cuts each sample to ``warmup.max_seq_len(step)`` tokens, where step is the EMISSION step.

    Sits directly before batching (``OrderingTaskEncoder`` puts it after the length pool), so the
    active batch index while a sample passes is the index of the batch it lands in:
    ``step = worker_config.active_worker_batch_index // micro_batches_per_step``. Over the planned
    order the step is the plan's own (:mod:`energon_ordering.step_clock`): after an elastic resume
    Energon's index restarts at 0 mid-plan, the plan's step does not. Applying the
    cap in ``encode_sample`` instead would key it to the index at which the sample was *pulled*
    into a pool or buffer, and a sample restored from such a buffer after a resume is re-encoded
    under another index: the resumed run would diverge.

    From ``warmup.warmup_steps`` on the stage passes samples through untouched: limiting
    samples to the full length stays the task encoder's job, as without warmup.

    The cut is :class:`~energon_ordering.warmup.cap_cut.CapCutter`'s, shared with the pack-time
    cut: only text tokens are cut, from the end; media placeholder tokens never. A sample whose
    media alone exceed the cap follows ``overflow``: ``keep`` (emitted uncut), ``drop`` (skipped)
    or ``error`` (:class:`SeqLenOverflowError`). Cut, kept and dropped samples are counted in the
    saved state (``_counts``; :func:`energon_ordering.inspect.diagnostics.warmup_counts` sums them
    over workers) and logged (the first ten, then every thousandth); a finite epoch that dropped
    every sample warns once with the count (``_epoch`` counts the current epoch).

    Deterministic: the cap is a pure function of the batch index. The warmup changes shapes,
    never the order of the samples (with ``keep``). Finite if the inner dataset is.
    """

    warmup: SeqLenWarmup
    overflow: str
    micro_batches_per_step: int
    layout: TokenLayout

    _stamp: dict[str, Any]
    _counts: dict[str, int]
    _epoch: dict[str, int]

    _savable_fields = ("_stamp", "_counts", "_epoch")

    def __init__(
        self,
        dataset: SavableDataset[T_sample],
        *,
        warmup: SeqLenWarmup,
        worker_config: WorkerConfig,
        micro_batches_per_step: int = 1,
        overflow: str = "keep",
        layout: TokenLayout | None = None,
    ):
        """Construct a SeqLenWarmupDataset.

        Args:
            dataset: Encoded samples, in emission order (nothing may buffer between this stage
                and the batcher).
            warmup: The sequence-length schedule.
            worker_config: Energon's worker configuration.
            micro_batches_per_step: Micro-batches per optimizer step on one rank.
            overflow: ``"keep"``, ``"drop"`` or ``"error"``.
            layout: How to cut the sample type; None = :class:`TokenLayout` defaults.
        """
        if not isinstance(warmup, SeqLenWarmup):
            raise OrderingTypeError(f"SeqLenWarmupDataset: warmup = {show(warmup)} must be a SeqLenWarmup.")
        if isinstance(micro_batches_per_step, bool) or not isinstance(micro_batches_per_step, int) or micro_batches_per_step < 1:
            raise OrderingConfigError(
                f"SeqLenWarmupDataset: micro_batches_per_step = {show(micro_batches_per_step)} must be an int >= 1."
            )
        layout = TokenLayout() if layout is None else layout
        cutter = CapCutter(overflow=overflow, layout=layout, wording=_WORDING, owner="SeqLenWarmupDataset")
        super().__init__(dataset, worker_config=worker_config)
        self.warmup = warmup
        self.overflow = overflow
        self.micro_batches_per_step = micro_batches_per_step
        self.layout = layout
        self.cutter = cutter
        #: The planned source below, whose step this stage reads (None: Energon's batch index).
        self.clock = find_step_clock(dataset)
        self.reset_state_own()

    def _expected_stamp(self) -> dict[str, Any]:
        return {
            "state_version": STATE_VERSION,
            "warmup": self.warmup.to_dict(),
            "overflow": self.overflow,
            "micro_batches_per_step": self.micro_batches_per_step,
        }

    def reset_state_own(self) -> None:
        self._stamp = self._expected_stamp()
        self._counts = new_counts()
        self._epoch = new_epoch_counts()

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def _step_cap(self, step: int) -> int | None:
        """The cap of ``step`` in tokens; None from the end of the warmup on (capping to
        ``full`` is the encoder's job)."""
        return None if step >= self.warmup.warmup_steps else self.warmup.max_seq_len(step)

    def current_step(self) -> int:
        """The optimizer step of the batch being built (in a loader worker only)."""
        return current_step(self.clock, self.worker_config, self.micro_batches_per_step)

    def __iter__(self) -> Iterator[T_sample]:
        self.cutter.reset_streak()
        for sample in self.dataset:
            step = self.current_step()
            out = self.cutter.cut(
                sample, self._step_cap(step), step=step, counts=self._counts, epoch=self._epoch
            )
            if out is not None:
                yield add_sample_restore_key(out[0], step, src=self)
        self.cutter.end_epoch(
            self._epoch, worker=f"rank {self.worker_config.rank} worker {self.worker_config.rank_worker_id()}"
        )

    def restore_sample(self, restore_key: tuple[str | int | tuple, ...]) -> T_sample:
        name, step = restore_key[:2]
        if name != type(self).__name__:
            raise ValueError(f"SeqLenWarmupDataset: restore key {show(restore_key)} is not ours.")
        inner = self.dataset.restore_sample(restore_key[2:])
        cap = self._step_cap(int(step))
        out = inner if cap is None else self.cutter.recut(inner, cap)
        if out is None:
            raise ValueError(f"SeqLenWarmupDataset: restore key {show(restore_key)} names a dropped sample.")
        return add_sample_restore_key(out, step, src=self)

    def restore_state(self, state: FlexState) -> None:
        check_stamp(
            "SeqLenWarmupDataset",
            state,
            self._expected_stamp(),
            "Restore with the original seq_length_warmup settings.",
        )
        check_saved_counts(type(self).__name__, "_counts", state.get("_counts"), new_counts().keys())
        check_saved_counts(type(self).__name__, "_epoch", state.get("_epoch"),
                           new_epoch_counts().keys())
        super().restore_state(state)

    def counts(self) -> dict[str, int]:
        """This worker's counters: seen, truncated, truncated_tokens, kept_over_cap, dropped."""
        return dict(self._counts)

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "dataset": self.dataset.config(),
            "warmup": self.warmup.to_dict(),
            "overflow": self.overflow,
            "micro_batches_per_step": self.micro_batches_per_step,
            "layout": {
                "token_field": self.layout.token_field,
                "sequence_fields": list(self.layout.sequence_fields),
                "length_field": self.layout.length_field,
                "media_token_id": self.layout.media_token_id,
                "media_mask_field": self.layout.media_mask_field,
            },
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        return (
            f"SeqLenWarmupDataset(warmup={self.warmup}, overflow={show(self.overflow)}, "
            f"micro_batches_per_step={self.micro_batches_per_step}, dataset={self.dataset})"
        )
