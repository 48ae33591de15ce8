"""Cutting a sample to a token cap under the overflow policy: the one implementation.

Two stages cut samples to a cap: the batch-time warmup
(:class:`~energon_ordering.warmup.seq_warmup.SeqLenWarmupDataset`, cap = the warmup's
``max_seq_len`` of the emission step) and the pack-time cut
(:class:`~energon_ordering.warmup.pack_cap.PackCapDataset`, cap = the pack target). Both do the
same thing, here:

- a sample within the cap passes unchanged;
- a longer one loses TEXT tokens from its end (:func:`~energon_ordering.warmup.token_layout.truncate_sample`;
  media placeholder tokens are never cut);
- a sample whose media alone exceed the cap follows ``seq_length_overflow``: ``keep`` (emitted
  uncut), ``drop`` (skipped) or ``error`` (:class:`~energon_ordering.errors.SeqLenOverflowError`).

Every outcome is counted in the calling stage's saved counters (:data:`COUNTERS`, summed over
workers by :func:`energon_ordering.inspect.diagnostics.warmup_counts`) and logged (the first ten,
then every thousandth). Dropping :data:`MAX_CONSECUTIVE_DROPS` samples in a row is an error, not
an endless loop; an epoch in which every sample was dropped warns once, with the count, instead
of ending with no batch in silence (:meth:`CapCutter.end_epoch`).

:class:`CapCutter` holds only the policy and the wording of its messages; the counters are the
stage's saved state and are passed in, so a restored stage counts on from its checkpoint.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

from energon_ordering.errors import OrderingConfigError, OrderingTypeError, SeqLenOverflowError
from energon_ordering.sample_fields import sample_key
from energon_ordering.warmup.token_layout import OVERFLOW_POLICIES, TokenLayout, truncate_sample
from energon_ordering.errors import show

__all__ = [
    "COUNTERS",
    "MAX_CONSECUTIVE_DROPS",
    "CapCutter",
    "CapWording",
    "EverySampleDroppedWarning",
    "new_counts",
    "new_epoch_counts",
]

logger = logging.getLogger(__name__)

#: The counters of a cutting stage: samples seen, cut, text tokens cut, kept over the cap
#: (``keep``) and dropped (``drop``).
COUNTERS = ("seen", "truncated", "truncated_tokens", "kept_over_cap", "dropped")

#: With ``overflow="drop"``, this many samples dropped in a row is an error, not a hang: the cap
#: is below the media tokens of (nearly) every sample, so no batch could ever fill.
MAX_CONSECUTIVE_DROPS = 1000

#: Overflow warnings logged per worker before only every thousandth is.
LOG_FIRST = 10


class EverySampleDroppedWarning(UserWarning):
    """A finite epoch of a loader worker dropped every sample it read (``overflow: drop``)."""


def new_counts() -> dict[str, int]:
    """Fresh counters (:data:`COUNTERS`), all 0."""
    return dict.fromkeys(COUNTERS, 0)


def new_epoch_counts() -> dict[str, int]:
    """Fresh per-epoch counters: samples passed on and samples dropped in this epoch."""
    return {"passed": 0, "dropped": 0}


@dataclass(frozen=True)
class CapWording:
    """How a stage names itself and its cap in messages.

    Attributes:
        stage: What cuts, e.g. ``"Sequence-length warmup"``.
        cap: What the cap is called, e.g. ``"warmup cap"``.
        kept: What ``keep`` does with an over-long sample, e.g. ``"emitted uncut"``.
        unit: What a dropped streak prevents, e.g. ``"no batch can fill"``.
        fix: The settings to change when media exceed the cap (first sentence of the fix).
    """

    stage: str
    cap: str
    kept: str
    unit: str
    fix: str


class CapCutter:
    """Cuts samples to a cap and applies ``seq_length_overflow``; counts into the caller's counters.

    Deterministic and stateless apart from the streak of consecutive drops (not saved: a stage
    resets it where its iteration starts, see :meth:`reset_streak`).

    Args:
        overflow: ``"keep"``, ``"drop"`` or ``"error"`` for a sample whose media alone exceed
            the cap.
        layout: How to cut the sample type.
        wording: The calling stage's words for its messages.
        owner: The calling stage's name, for configuration errors.
    """

    def __init__(self, *, overflow: str, layout: TokenLayout, wording: CapWording, owner: str):
        if overflow not in OVERFLOW_POLICIES:
            raise OrderingConfigError(
                f"{owner}: overflow = {show(overflow)} is unknown; use one of {list(OVERFLOW_POLICIES)}."
            )
        if not isinstance(layout, TokenLayout):
            raise OrderingTypeError(f"{owner}: layout = {show(layout)} must be a TokenLayout.")
        self.overflow = overflow
        self.layout = layout
        self.wording = wording
        self.dropped_in_a_row = 0

    def reset_streak(self) -> None:
        """Forget the current streak of consecutive drops."""
        self.dropped_in_a_row = 0

    def cut(
        self,
        sample: Any,
        cap: int | None,
        *,
        step: int,
        counts: dict[str, int],
        epoch: dict[str, int] | None = None,
        media_limit: int | None = None,
    ) -> tuple[Any, bool] | None:
        """Cuts ``sample`` to ``cap`` tokens and applies the overflow policy, counting.

        Args:
            sample: An encoded sample.
            cap: Tokens the sample may hold; None: no cap (passed unchanged, counted as seen).
            step: The optimizer step the cap belongs to (for messages).
            counts: The stage's counters (:data:`COUNTERS`), updated in place.
            epoch: The stage's per-epoch counters (:func:`new_epoch_counts`), updated in place.
            media_limit: The overflow policy applies when the media exceed this many tokens
                (default: ``cap``; a smaller value when the sample may later be cut further).

        Returns:
            ``(sample, cut)``: the sample to pass on (cut, or unchanged) and whether it was cut;
            None if it is dropped.

        Raises:
            SeqLenOverflowError: ``overflow="error"`` and the media exceed the limit, or
                :data:`MAX_CONSECUTIVE_DROPS` samples in a row were dropped.
        """
        counts["seen"] += 1
        if cap is None:
            return self._passed(sample, False, epoch)
        limit = cap if media_limit is None else media_limit
        result = truncate_sample(sample, cap, self.layout)
        if not result.overflow and limit < cap:
            at_limit = truncate_sample(sample, limit, self.layout)
            if at_limit.overflow:
                result = at_limit
        if not result.overflow:
            if result.cut_tokens:
                counts["truncated"] += 1
                counts["truncated_tokens"] += result.cut_tokens
            return self._passed(result.sample, bool(result.cut_tokens), epoch)
        what = (
            f"sample {show(sample_key(sample))} has {result.media_tokens} media tokens, more than the "
            f"{self.wording.cap} of {limit} tokens at step {step}"
        )
        if self.overflow == "error":
            raise SeqLenOverflowError(
                f"{self.wording.stage}: {what}. Media tokens are never cut; {self.wording.fix}, or "
                f"set the overflow policy to 'keep' ({self.wording.kept}) or 'drop' (skip, counted)."
            )
        key = "kept_over_cap" if self.overflow == "keep" else "dropped"
        counts[key] += 1
        n = counts[key]
        if n <= LOG_FIRST or n % 1000 == 0:
            logger.warning(
                "%s: %s; %s (%d so far on this worker).",
                self.wording.stage, what, self.wording.kept if self.overflow == "keep" else "dropped", n,
            )
        if self.overflow == "keep":
            return self._passed(sample, False, epoch)
        if epoch is not None:
            epoch["dropped"] += 1
        self.dropped_in_a_row += 1
        if self.dropped_in_a_row >= MAX_CONSECUTIVE_DROPS:
            raise SeqLenOverflowError(
                f"{self.wording.stage}: {self.dropped_in_a_row} samples in a row were dropped at "
                f"step {step} ({self.wording.cap} {limit} tokens): their media tokens alone exceed "
                f"it, so {self.wording.unit}. Raise seq_length_warmup.start above the media tokens "
                "per sample, or use overflow 'keep'."
            )
        return None

    def _passed(self, sample: Any, cut: bool, epoch: dict[str, int] | None) -> tuple[Any, bool]:
        self.dropped_in_a_row = 0
        if epoch is not None:
            epoch["passed"] += 1
        return sample, cut

    def recut(self, sample: Any, cap: int) -> Any | None:
        """``sample`` cut to ``cap`` again, as :meth:`cut` did before a checkpoint, without
        counting (a restore re-creates a sample already counted). None: :meth:`cut` dropped it."""
        result = truncate_sample(sample, cap, self.layout)
        if result.overflow:
            return None if self.overflow == "drop" else sample
        return result.sample

    def end_epoch(self, epoch: dict[str, int], *, worker: str) -> None:
        """At the end of a finite epoch: warns once if every sample read in it was dropped, then
        resets ``epoch`` for the next one."""
        if epoch["dropped"] and not epoch["passed"]:
            warnings.warn(
                f"{self.wording.stage}: all {epoch['dropped']} samples of this epoch on {worker} "
                f"were dropped (overflow 'drop'): their media tokens alone exceed the "
                f"{self.wording.cap}, so the epoch yields no batch from them. {self.wording.fix[0].upper()}"
                f"{self.wording.fix[1:]}, or use overflow 'keep'.",
                EverySampleDroppedWarning,
                stacklevel=2,
            )
        epoch["passed"] = epoch["dropped"] = 0
