"""What a cap does with a sample whose media tokens alone exceed it (no torch: the config and
the command line check it before the pipeline is imported)."""

from __future__ import annotations

__all__ = ["OVERFLOW_POLICIES"]

#: What to do with a sample whose media tokens alone exceed the cap: emit it uncut (``keep``),
#: skip it (``drop``) or raise (``error``).
OVERFLOW_POLICIES = ("keep", "drop", "error")
