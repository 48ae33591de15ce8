"""The exception types of the package.

Every error a user can cause derives from :class:`OrderingError` and also from the builtin type
that fits (``ValueError`` or ``TypeError``), so ``except ValueError`` keeps working. Messages name
the parameter, the bad value and the fix; a value a user gave is quoted with :func:`show`, which
bounds its length (a recipe or a state can hold values of any size).
"""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = [
    "OrderingError",
    "OrderingConfigError",
    "OrderingTypeError",
    "LengthIndexError",
    "NotRestorableError",
    "SampleLengthError",
    "SeqLenOverflowError",
    "ShardReadError",
    "StateMismatchError",
    "show",
]

#: Characters of a quoted value that an error message shows at most (see :func:`show`).
SHOW_LIMIT = 200


class _BoundedRepr(reprlib.Repr):
    """``repr`` that stops early in long or deep containers; dicts keep their order."""

    def __init__(self, limit: int):
        super().__init__()
        self.maxlevel = 4
        self.maxtuple = self.maxlist = self.maxset = self.maxfrozenset = self.maxdeque = 16
        self.maxarray = self.maxdict = 16
        self.maxstring = self.maxlong = self.maxother = max(limit, 8)

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [
            f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
            for k, v in list(x.items())[: self.maxdict]
        ]
        if len(x) > self.maxdict:
            pieces.append("...")
        return "{" + ", ".join(pieces) + "}"


def show(value: Any, limit: int = SHOW_LIMIT) -> str:
    """``repr(value)`` for an error message, at most about ``limit`` characters.

    Equal to ``repr(value)`` for a short value. A long one is cut (``...`` marks where), and
    containers are walked only as far as shown, so a value that is huge in memory or by
    reference (a YAML alias bomb) costs no more than a small one.
    """
    text = _BoundedRepr(limit).repr(value)
    return text if len(text) <= limit else text[: max(limit - 3, 1)] + "..."


class OrderingError(Exception):
    """Base class of all errors raised by ``energon_ordering``."""


class OrderingConfigError(OrderingError, ValueError):
    """A configuration value is invalid (raised at construction)."""


class OrderingTypeError(OrderingError, TypeError):
    """A value has the wrong type (raised at construction)."""


class NotRestorableError(OrderingConfigError):
    """The pipeline below a buffering wrapper cannot re-create samples from restore keys."""


class SampleLengthError(OrderingError, ValueError):
    """The length of a sample cannot be determined, or is not a finite number."""


class ShardReadError(OrderingError, ValueError):
    """A shard does not hold what Energon's ``index.sqlite`` says it holds at a byte range (the
    shard was truncated, replaced or rewritten after ``energon prepare``), or that index is
    unreadable. Raised, never skipped: the sample read would be wrong."""


class StateMismatchError(OrderingError, ValueError):
    """A saved state was written by a different configuration or version of the logic."""


class SeqLenOverflowError(OrderingError, ValueError):
    """A sample's uncuttable (media) tokens alone exceed the warmup's sequence-length cap."""


class LengthIndexError(OrderingError, ValueError):
    """A dataset's length index is missing, stale (built for another ``index.uuid``), lacks a
    sample, or was replaced or damaged under a running job."""

    @classmethod
    def check_unchanged(cls, path: object, found: str | None, started: str | None) -> None:
        """Raises if the index at ``path`` now has content digest ``found`` where the job
        started with ``started`` (either None: nothing to compare)."""
        if found is not None and started is not None and found != started:
            raise cls(
                f"length index: {path} was replaced while this job reads it (content digest "
                f"{show(found)}, the job started with {show(started)}); keep indexes of other "
                "length functions side by side (`energon-ordering index --name NAME`) instead "
                "of rebuilding one under a running job, and restart the job."
            )

    @classmethod
    def corrupt(cls, path: object, dataset: object, error: BaseException) -> LengthIndexError:
        """The error for a length index that became unreadable after the job opened and
        checked it (overwritten or damaged under a running loader)."""
        return cls(
            f"length index: {path} is unreadable or corrupt ({error}); it was sound when this "
            "job opened it, so it was overwritten or damaged since. Rebuild it with "
            f"`energon-ordering index {dataset}` (keep indexes of other length functions side "
            "by side with --name) and restart the job."
        )
