"""Stretching a mixture schedule written for one run length to another (pure).

A recipe's schedule is written for ``total_steps`` optimizer steps; a host run may be longer or
shorter (Bridge's ``train.train_iters``). :func:`rescale_schedule` maps every step of the
definition (``linear``/``step`` knots, phase ends, ramp lengths) by ``new_total / total_steps``,
rounded to the nearest step, so each phase keeps its share of the run. It is applied only when a
user asks for it (``scale_schedule_to_run``); otherwise a length mismatch is refused. Rounding can
merge two knots or empty a phase on a much shorter run: that is refused by name, never dropped.
"""

from __future__ import annotations

from typing import Any

from energon_ordering.errors import OrderingConfigError, show
from energon_ordering.mixture.schedule import MixtureSchedule

__all__ = ["rescale_schedule"]


def _scaled(step: int, ratio: float) -> int:
    return int(round(step * ratio))


def rescale_schedule(schedule: MixtureSchedule, total_steps: int) -> MixtureSchedule:
    """``schedule`` stretched from its ``total_steps`` to ``total_steps`` steps.

    Args:
        schedule: A schedule with ``total_steps`` set (the run length it was written for).
        total_steps: The run's length in optimizer steps (>= 1).

    Returns:
        A new schedule with ``total_steps`` = ``total_steps``; the same schedule if the lengths
        already agree.

    Raises:
        OrderingConfigError: ``schedule.total_steps`` is unset, ``total_steps`` < 1, or rounding
            merges two knots of a source or empties a phase.
    """
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise OrderingConfigError(f"rescale_schedule: total_steps = {show(total_steps)} must be an int >= 1.")
    if schedule.total_steps is None:
        raise OrderingConfigError(
            "rescale_schedule: the mixture schedule has no total_steps, so there is no run length "
            "to stretch from; add `total_steps: N` (the length it was written for) to the schedule "
            "or the recipe."
        )
    if schedule.total_steps == total_steps:
        return schedule
    ratio = total_steps / schedule.total_steps
    d: dict[str, Any] = schedule.to_dict()
    d["total_steps"] = total_steps
    if "sources" in d:
        for name, spec in d["sources"].items():
            weight = spec["weight"]
            if not isinstance(weight, dict):
                continue  # a constant
            (kind, knots), = weight.items()
            scaled = {_scaled(s, ratio): v for s, v in knots.items()}
            if len(scaled) != len(knots):
                raise OrderingConfigError(
                    f"rescale_schedule: source {show(name)}'s {kind} knots at steps {list(knots)} "
                    f"merge when the schedule is stretched from {schedule.total_steps} to "
                    f"{total_steps} steps; write the schedule for this run length instead."
                )
            spec["weight"] = {kind: scaled}
    else:
        for phase in d["phases"]:
            phase["until"] = max(1, _scaled(phase["until"], ratio))
            if phase.get("ramp_steps"):
                phase["ramp_steps"] = max(1, _scaled(phase["ramp_steps"], ratio))
    try:
        return MixtureSchedule.from_dict(d)
    except OrderingConfigError as e:
        raise OrderingConfigError(
            f"rescale_schedule: stretching the schedule from {schedule.total_steps} to {total_steps} "
            f"steps leaves it invalid ({e}); write the schedule for this run length instead."
        ) from e
