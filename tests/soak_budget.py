"""The time a soak may take: its cycles, cut short at ``SOAK_DEADLINE``.

A soak's chunks each run their share of ``SOAK_CYCLES`` (``ELASTIC_SOAK_CYCLES``) random
cycles. ``SOAK_DEADLINE`` (seconds since the epoch; unset: none) stops a chunk's loop once that
time has passed, after at least one cycle, so that a CI run with a fixed budget soaks for
whatever time its other legs leave (``.ci/run`` runs the soaks last and sets it) instead of
overrunning it on a slow machine. Each chunk appends what it ran to ``SOAK_REPORT`` (a file;
unset: nowhere), which ``.ci/run`` prints: a soak cut short says so, with its seed.
"""

from __future__ import annotations

import math
import os
import time

__all__ = ["out_of_time", "report"]

_DEADLINE = float(os.environ.get("SOAK_DEADLINE", "inf") or "inf")


def out_of_time(done: int) -> bool:
    """Whether a chunk that has run ``done`` cycles stops now: never before its first cycle."""
    return done > 0 and time.time() >= _DEADLINE


def report(soak: str, chunk: int, done: int, planned: int, seed: int) -> None:
    """Appends ``soak chunk N: done of planned cycles (SOAK_SEED=...)`` to ``SOAK_REPORT``."""
    path = os.environ.get("SOAK_REPORT")
    if not path:
        return
    cut = "" if done >= planned or math.isinf(_DEADLINE) else ", cut short at SOAK_DEADLINE"
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{soak} chunk {chunk}: {done} of {planned} cycles (SOAK_SEED={seed}{cut})\n")
