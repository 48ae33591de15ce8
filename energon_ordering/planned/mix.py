"""The planned order's mix granularity (``OrderingConfig.planned_mix``): where the blend's
weights hold exactly.

- ``"step"``: every optimizer step holds each source within one sample of ``weight x G``
  (G: the global batch in samples); a step's samples span every source's lengths, so at one or
  two micro-batches per step it cannot be both padding-free and balanced across ranks.
- ``"window"``: every plan window of K steps holds each source within one sample of the sum of
  its weights over the window ``x G``, and the window's samples move freely between its steps:
  each step holds one band of lengths (as a pool's step does), balanced across ranks and
  padding-free within each micro-batch. The schedule and the warmup still hold per step
  (:mod:`.window_mix`).
"""

from __future__ import annotations

from typing import Literal, get_args

from energon_ordering.errors import OrderingConfigError, show

__all__ = ["PLANNED_MIXES", "PlannedMix", "check_planned_mix"]

PlannedMix = Literal["step", "window"]

#: The accepted values of ``planned_mix``, the default first.
PLANNED_MIXES: tuple[PlannedMix, ...] = get_args(PlannedMix)


def check_planned_mix(value: object) -> PlannedMix:
    """``value`` as a :data:`PlannedMix`, or an :class:`OrderingConfigError` naming
    ``planned_mix``, the value and the allowed values."""
    if isinstance(value, str) and value in PLANNED_MIXES:
        return value  # type: ignore[return-value]
    allowed = ", ".join(repr(m) for m in PLANNED_MIXES)
    raise OrderingConfigError(
        f"planned_mix = {show(value)}: give one of {allowed} ('step': every optimizer step holds "
        "each source's share; 'window': every plan window does, its steps banded by length).")
