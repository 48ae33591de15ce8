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
- ``"auto"`` (the setting's default, :data:`PLANNED_MIX_SETTINGS`): ``"step"`` where a
  ``mixture_schedule`` changes the weights over training (they must hold at each step: an
  anneal), else ``"window"``, which loses the least compute at every shape
  ``tools/bench_planned.py`` measures from 2 to 1,024 ranks. A pure function of the configuration
  (:func:`resolve_planned_mix`), so every rank, and every resume, resolves it alike; the state
  records the granularity it resolved to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

from energon_ordering.errors import OrderingConfigError, show

if TYPE_CHECKING:
    from energon_ordering.mixture.schedule import MixtureSchedule

__all__ = ["AUTO", "PLANNED_MIXES", "PLANNED_MIX_SETTINGS", "PlannedMix", "check_planned_mix",
           "resolve_planned_mix"]

PlannedMix = Literal["step", "window"]

#: The granularities a plan is computed at.
PLANNED_MIXES: tuple[PlannedMix, ...] = get_args(PlannedMix)
#: ``planned_mix`` resolved from the schedule (:func:`resolve_planned_mix`).
AUTO = "auto"
#: The accepted values of ``OrderingConfig.planned_mix``, the default first.
PLANNED_MIX_SETTINGS: tuple[str, ...] = (AUTO, *PLANNED_MIXES)


def check_planned_mix(value: object) -> PlannedMix:
    """``value`` as a :data:`PlannedMix`, or an :class:`OrderingConfigError` naming
    ``planned_mix``, the value and the allowed values."""
    if isinstance(value, str) and value in PLANNED_MIXES:
        return value  # type: ignore[return-value]
    allowed = ", ".join(repr(m) for m in PLANNED_MIXES)
    raise OrderingConfigError(
        f"planned_mix = {show(value)}: give one of {allowed} ('step': every optimizer step holds "
        "each source's share; 'window': every plan window does, its steps banded by length).")


def resolve_planned_mix(setting: str, schedule: MixtureSchedule | None) -> PlannedMix:
    """The granularity of the setting ``setting`` (:data:`PLANNED_MIX_SETTINGS`): ``"auto"``
    is ``"step"`` where ``schedule`` changes the weights over training, else ``"window"``;
    ``"step"`` and ``"window"`` are themselves."""
    if setting == AUTO:
        return "step" if schedule is not None and schedule.changes_weights else "window"
    return check_planned_mix(setting)
