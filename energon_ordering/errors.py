"""The exception types of the package.

Every error a user can cause derives from :class:`OrderingError` and also from the builtin type
that fits (``ValueError`` or ``TypeError``), so ``except ValueError`` keeps working. Messages name
the parameter, the bad value and the fix.
"""

from __future__ import annotations

__all__ = [
    "OrderingError",
    "OrderingConfigError",
    "OrderingTypeError",
    "LengthIndexError",
    "NotRestorableError",
    "SampleLengthError",
    "SeqLenOverflowError",
    "StateMismatchError",
]


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


class StateMismatchError(OrderingError, ValueError):
    """A saved state was written by a different configuration or version of the logic."""


class SeqLenOverflowError(OrderingError, ValueError):
    """A sample's uncuttable (media) tokens alone exceed the warmup's sequence-length cap."""


class LengthIndexError(OrderingError, ValueError):
    """A dataset's length index is missing, stale (built for another ``index.uuid``) or
    lacks a sample."""

    @classmethod
    def check_unchanged(cls, path: object, found: str | None, started: str | None) -> None:
        """Raises if the index at ``path`` now has content digest ``found`` where the job
        started with ``started`` (either None: nothing to compare)."""
        if found is not None and started is not None and found != started:
            raise cls(
                f"length index: {path} was replaced while this job reads it (content digest "
                f"{found!r}, the job started with {started!r}); keep indexes of other length "
                "functions side by side (`energon-ordering index --name NAME`) instead of "
                "rebuilding one under a running job, and restart the job."
            )
