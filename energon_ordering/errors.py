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
