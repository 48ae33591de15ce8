"""Checks of the counters, flags and counter tables inside a saved state.

A stage's stamp (:func:`energon_ordering.state_stamp.check_stamp`) says which configuration a
state belongs to; these checks say whether the values next to it can be the stage's own: a pool
index, a flag, a table of diagnostic counters. A state edited by hand or damaged (a negative
pool index, a count that is a string, a flag that is None) is refused at ``restore_state`` with
one :class:`~energon_ordering.errors.StateMismatchError` line naming the stage, the field, the
value and the fix, instead of an untyped error (or a silently wrong continuation) later.

Pure functions of the saved values; every restore that reads such values calls them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from energon_ordering.errors import StateMismatchError, show

__all__ = [
    "EDITED",
    "check_saved_bool",
    "check_saved_counts",
    "check_saved_float",
    "check_saved_int",
    "check_saved_list",
    "is_saved_int",
    "saved_value_error",
]

#: The fix every refusal of an edited or damaged value ends with.
EDITED = ("The state was edited or damaged: restore the state exactly as save_state_rank() "
          "wrote it, or start the data stream fresh.")


def saved_value_error(owner: str, field: str, value: Any, should: str) -> StateMismatchError:
    """The one-line refusal of ``value`` saved as ``field`` by ``owner``.

    Args:
        owner: The restoring stage's name (e.g. ``"LengthPoolSortDataset"``).
        field: Where the value sits in the stage's state (e.g. ``"_counts['seen']"``).
        value: The saved value.
        should: What it must be (e.g. ``"an int >= 0"``).
    """
    return StateMismatchError(
        f"{owner}: the saved {field} = {show(value)} ({type(value).__name__}) must be {should}. "
        f"{EDITED}"
    )


def is_saved_int(value: Any) -> bool:
    """True for an int (a numpy integer too), never a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_saved_int(owner: str, field: str, value: Any, *, minimum: int = 0,
                    maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (``maximum`` None: unbounded), or raises
    :class:`StateMismatchError` (:func:`saved_value_error`)."""
    if not is_saved_int(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f"an int >= {minimum}" if maximum is None else \
            f"an int in [{minimum}, {maximum}]"
        raise saved_value_error(owner, field, value, bound)
    return int(value)


def check_saved_float(owner: str, field: str, value: Any) -> float:
    """``value`` as a finite float (an int is one too), or raises :class:`StateMismatchError`."""
    if not (is_saved_int(value) or isinstance(value, (float, np.floating))) \
            or not math.isfinite(float(value)):
        raise saved_value_error(owner, field, value, "a finite number")
    return float(value)


def check_saved_bool(owner: str, field: str, value: Any) -> bool:
    """``value`` as a bool, or raises :class:`StateMismatchError`."""
    if not isinstance(value, (bool, np.bool_)):
        raise saved_value_error(owner, field, value, "True or False")
    return bool(value)


def check_saved_counts(owner: str, field: str, value: Any, names: Collection[str]) -> None:
    """Raises :class:`StateMismatchError` unless ``value`` is a dict holding exactly the
    counters ``names``, each an int >= 0."""
    if not isinstance(value, Mapping) or set(value) != set(names):
        raise saved_value_error(owner, field, value,
                                f"a dict of the counters {sorted(names)}, each an int >= 0")
    for name in names:
        check_saved_int(owner, f"{field}['{name}']", value[name])


def check_saved_list(owner: str, field: str, value: Any, *, length: int | None = None) -> list[Any]:
    """``value`` as a list (a tuple too) of ``length`` items (None: any), or raises
    :class:`StateMismatchError`."""
    if not isinstance(value, (list, tuple)) or (length is not None and len(value) != length):
        raise saved_value_error(owner, field, value, "a list" if length is None else
                                f"a list of {length} items")
    return list(value)
