"""Deprecated: import from :mod:`energon_ordering` (or ``energon_ordering.mixture.schedule`` /
``energon_ordering.warmup.schedule``) instead.

The schedules moved into the rooms of their concern: :class:`MixtureSchedule`, :class:`Knots`,
:class:`Phase`, :func:`implied_epochs` to ``energon_ordering.mixture.schedule``, and
:class:`SeqLenWarmup` to ``energon_ordering.warmup.schedule``. This thin re-export is kept for
one release (0.2) and will then be removed.
"""

from __future__ import annotations

from energon_ordering.mixture.schedule import (
    SCHEDULE_VERSION,
    Knots,
    MixtureSchedule,
    Phase,
    RepetitionWarning,
    implied_epochs,
)
from energon_ordering.warmup.schedule import WARMUP_KINDS, SeqLenWarmup

__all__ = [
    "SCHEDULE_VERSION",
    "WARMUP_KINDS",
    "Knots",
    "MixtureSchedule",
    "Phase",
    "RepetitionWarning",
    "SeqLenWarmup",
    "implied_epochs",
]
