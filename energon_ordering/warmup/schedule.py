"""The sequence-length warmup: the maximum sequence length as a pure function of the step.

:class:`SeqLenWarmup` is frozen, validated and plottable before a run; the stage that applies it
at batch time is :class:`~energon_ordering.warmup.seq_warmup.SeqLenWarmupDataset`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from energon_ordering.errors import OrderingConfigError, OrderingTypeError
from energon_ordering.errors import show

__all__ = ["WARMUP_KINDS", "SeqLenWarmup"]


#: Sequence-length warmup kinds.
WARMUP_KINDS = ("linear", "step")


@dataclass(frozen=True)
class SeqLenWarmup:
    """Sequence-length warmup: the maximum sequence length as a pure function of the step.

    ``max_seq_len(step)`` grows from ``start`` to ``full`` tokens over ``warmup_steps`` optimizer
    steps, rounded down to a multiple of ``multiple_of`` (tensor cores want multiples of 8), and
    is exactly ``full`` from ``warmup_steps`` on (``full`` need not be a multiple).

    Kinds:
        ``linear``: ``start + (full - start) * step / warmup_steps``, rounded down.
        ``step``: discrete doubling stages, ``start * 2**k`` for ``k = floor(step * n /
        warmup_steps)`` with ``n = ceil(log2(full / start))`` equal stages, capped at ``full``.

    Args:
        start: Length at step 0, in tokens (>= ``multiple_of``; rounded down to a multiple).
        full: Length from ``warmup_steps`` on, in tokens; in Megatron-LM ``--seq-length``.
        warmup_steps: Optimizer steps of the warmup (>= 1).
        multiple_of: Lengths during the warmup are rounded down to a multiple of this.
        kind: ``"linear"`` or ``"step"``.
    """

    start: int
    full: int
    warmup_steps: int
    multiple_of: int = 8
    kind: str = "linear"

    def __post_init__(self) -> None:
        for name in ("start", "full", "warmup_steps", "multiple_of"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise OrderingConfigError(
                    f"SeqLenWarmup.{name} = {show(value)} must be a positive int."
                )
        if self.start > self.full:
            raise OrderingConfigError(
                f"SeqLenWarmup: start = {self.start} > full = {self.full}; the warmup grows the "
                "sequence length, so start must be <= full."
            )
        if self.multiple_of > self.start:
            raise OrderingConfigError(
                f"SeqLenWarmup: multiple_of = {self.multiple_of} > start = {self.start}; lengths "
                f"are rounded down to a multiple of multiple_of, so start must be at least "
                f"{self.multiple_of} (or use a smaller multiple_of)."
            )
        if self.kind not in WARMUP_KINDS:
            raise OrderingConfigError(
                f"SeqLenWarmup.kind = {show(self.kind)} is unknown; use one of {list(WARMUP_KINDS)}."
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SeqLenWarmup:
        """Builds a warmup from ``{start, full, warmup_steps[, multiple_of, kind]}``."""
        if not isinstance(d, Mapping):
            raise OrderingTypeError(f"SeqLenWarmup.from_dict: expected a mapping, got {type(d).__name__}.")
        known = {"start", "full", "warmup_steps", "multiple_of", "kind"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise OrderingConfigError(
                f"SeqLenWarmup: unknown setting(s) {unknown}; known settings are {sorted(known)}."
            )
        missing = sorted({"start", "full", "warmup_steps"} - set(d))
        if missing:
            raise OrderingConfigError(f"SeqLenWarmup: missing setting(s) {missing}.")
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        return {"start": self.start, "full": self.full, "warmup_steps": self.warmup_steps,
                "multiple_of": self.multiple_of, "kind": self.kind}

    def max_seq_len(self, step: int) -> int:
        """Maximum sequence length at optimizer ``step`` (an int >= 0), in tokens."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise OrderingConfigError(f"SeqLenWarmup.max_seq_len: step = {show(step)} must be an int >= 0.")
        if step >= self.warmup_steps:
            return self.full
        if self.kind == "linear":
            length = self.start + (self.full - self.start) * step // self.warmup_steps
        else:
            stages = max(1, math.ceil(math.log2(self.full / self.start)))
            length = min(self.full, self.start * 2 ** (step * stages // self.warmup_steps))
        return length // self.multiple_of * self.multiple_of
