"""SeqLenWarmupDataset: caps sample lengths at batch time, keyed to the emission step."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from megatron.energon.flavors.base_dataset import SavableDataset, add_sample_restore_key
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset

from energon_ordering.errors import (
    OrderingConfigError,
    OrderingTypeError,
    SeqLenOverflowError,
)
from energon_ordering.sample_fields import sample_key
from energon_ordering.warmup.schedule import SeqLenWarmup
from energon_ordering.state_stamp import check_stamp
from energon_ordering.warmup.token_layout import OVERFLOW_POLICIES, TokenLayout, truncate_sample

__all__ = ["OVERFLOW_POLICIES", "SeqLenWarmupDataset"]

logger = logging.getLogger(__name__)

T_sample = TypeVar("T_sample")


#: Version of the stage's saved-state layout and logic.
STATE_VERSION = 1

_LOG_FIRST = 10

#: With ``overflow="drop"``, this many samples dropped in a row is an error, not a hang: the cap
#: is below the media tokens of (nearly) every sample, so no batch could ever fill.
MAX_CONSECUTIVE_DROPS = 1000


class SeqLenWarmupDataset(BaseWrapperDataset[T_sample, T_sample], Generic[T_sample]):
    """Cuts each sample to ``warmup.max_seq_len(step)`` tokens, where step is the EMISSION step.

    Sits directly before batching (``OrderingTaskEncoder`` puts it after the length pool), so the
    active batch index while a sample passes is the index of the batch it lands in:
    ``step = worker_config.active_worker_batch_index // micro_batches_per_step``. Applying the
    cap in ``encode_sample`` instead would key it to the index at which the sample was *pulled*
    into a pool or buffer, and a sample restored from such a buffer after a resume is re-encoded
    under another index: the resumed run would diverge.

    From ``warmup.warmup_steps`` on the stage passes samples through untouched: limiting
    samples to the full length stays the task encoder's job, as without warmup.

    Only text tokens are cut, from the end; media placeholder tokens never (see
    :mod:`energon_ordering.warmup.token_layout`). A sample whose media alone exceed the cap follows
    ``overflow``: ``keep`` (emitted uncut), ``drop`` (skipped) or ``error``
    (:class:`SeqLenOverflowError`). Cut, kept and dropped samples are counted in the saved state
    (``_counts``; :func:`energon_ordering.inspect.diagnostics.warmup_counts` sums them over workers) and
    logged (the first ten, then every thousandth).

    Deterministic: the cap is a pure function of the batch index. The warmup changes shapes,
    never the order of the samples (with ``keep``). Finite if the inner dataset is.
    """

    warmup: SeqLenWarmup
    overflow: str
    micro_batches_per_step: int
    layout: TokenLayout

    _stamp: dict[str, Any]
    _counts: dict[str, int]

    _savable_fields = ("_stamp", "_counts")

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
            raise OrderingTypeError(f"SeqLenWarmupDataset: warmup = {warmup!r} must be a SeqLenWarmup.")
        if overflow not in OVERFLOW_POLICIES:
            raise OrderingConfigError(
                f"SeqLenWarmupDataset: overflow = {overflow!r} is unknown; use one of "
                f"{list(OVERFLOW_POLICIES)}."
            )
        if isinstance(micro_batches_per_step, bool) or not isinstance(micro_batches_per_step, int) or micro_batches_per_step < 1:
            raise OrderingConfigError(
                f"SeqLenWarmupDataset: micro_batches_per_step = {micro_batches_per_step!r} must be an int >= 1."
            )
        layout = TokenLayout() if layout is None else layout
        if not isinstance(layout, TokenLayout):
            raise OrderingTypeError(f"SeqLenWarmupDataset: layout = {layout!r} must be a TokenLayout.")
        super().__init__(dataset, worker_config=worker_config)
        self.warmup = warmup
        self.overflow = overflow
        self.micro_batches_per_step = micro_batches_per_step
        self.layout = layout
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
        self._counts = {"seen": 0, "truncated": 0, "truncated_tokens": 0, "kept_over_cap": 0, "dropped": 0}

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def _cap(self, sample: T_sample, step: int, *, count: bool) -> T_sample | None:
        if step >= self.warmup.warmup_steps:
            return sample  # warmup over: untouched (capping to `full` is the encoder's job)
        cap = self.warmup.max_seq_len(step)
        result = truncate_sample(sample, cap, self.layout)
        if not result.overflow:
            if count and result.cut_tokens:
                self._counts["truncated"] += 1
                self._counts["truncated_tokens"] += result.cut_tokens
            return result.sample
        what = (
            f"sample {sample_key(sample)!r} has {result.media_tokens} media tokens, more than the "
            f"warmup cap of {cap} tokens at step {step}"
        )
        if self.overflow == "error":
            raise SeqLenOverflowError(
                f"Sequence-length warmup: {what}. Media tokens are never cut; raise "
                "seq_length_warmup.start, or set the overflow policy to 'keep' (emit uncut) or "
                "'drop' (skip, counted)."
            )
        key = "kept_over_cap" if self.overflow == "keep" else "dropped"
        if count:
            self._counts[key] += 1
            n = self._counts[key]
            if n <= _LOG_FIRST or n % 1000 == 0:
                logger.warning(
                    "Sequence-length warmup: %s; %s (%d so far on this worker).",
                    what, "emitted uncut" if self.overflow == "keep" else "dropped", n,
                )
        return sample if self.overflow == "keep" else None

    def current_step(self) -> int:
        """The optimizer step of the batch being built (in a loader worker only)."""
        return self.worker_config.active_worker_batch_index // self.micro_batches_per_step

    def __iter__(self) -> Iterator[T_sample]:
        dropped_in_a_row = 0
        for sample in self.dataset:
            step = self.current_step()
            self._counts["seen"] += 1
            out = self._cap(sample, step, count=True)
            if out is None:
                dropped_in_a_row += 1
                if dropped_in_a_row >= MAX_CONSECUTIVE_DROPS:
                    raise SeqLenOverflowError(
                        f"Sequence-length warmup: {dropped_in_a_row} samples in a row were dropped "
                        f"at step {step} (cap {self.warmup.max_seq_len(step)} tokens): their media "
                        "tokens alone exceed the cap, so no batch can fill. Raise "
                        "seq_length_warmup.start above the media tokens per sample, or use "
                        "overflow 'keep'."
                    )
                continue
            dropped_in_a_row = 0
            yield add_sample_restore_key(out, step, src=self)

    def restore_sample(self, restore_key: tuple[str | int | tuple, ...]) -> T_sample:
        name, step = restore_key[:2]
        if name != type(self).__name__:
            raise ValueError(f"SeqLenWarmupDataset: restore key {restore_key!r} is not ours.")
        inner = self.dataset.restore_sample(restore_key[2:])
        out = self._cap(inner, int(step), count=False)
        if out is None:
            raise ValueError(f"SeqLenWarmupDataset: restore key {restore_key!r} names a dropped sample.")
        return add_sample_restore_key(out, step, src=self)

    def restore_state(self, state: FlexState) -> None:
        check_stamp(
            "SeqLenWarmupDataset",
            state,
            self._expected_stamp(),
            "Restore with the original seq_length_warmup settings.",
        )
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
            f"SeqLenWarmupDataset(warmup={self.warmup}, overflow={self.overflow!r}, "
            f"micro_batches_per_step={self.micro_batches_per_step}, dataset={self.dataset})"
        )
