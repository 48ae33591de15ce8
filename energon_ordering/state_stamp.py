"""State stamps: what configuration and version of the logic wrote a wrapper's saved state.

Each ordering wrapper saves a small dict (``_stamp``) of the settings that decide its order plus
a state version. On restore the saved stamp is compared with the configured one, so that a state
is never silently replayed under other settings.
"""

from __future__ import annotations

from typing import Any

from energon_ordering.errors import StateMismatchError

__all__ = ["check_stamp", "check_writer", "stamp_differences"]


def stamp_differences(saved: Any, expected: dict[str, Any]) -> str | None:
    """Describes how ``saved`` differs from ``expected`` (None if equal)."""
    if saved == expected:
        return None
    if not isinstance(saved, dict):
        return f"saved stamp {saved!r}"
    return ", ".join(
        f"{k}: saved {saved.get(k)!r} != configured {expected.get(k)!r}"
        for k in [*expected, *(k for k in saved if k not in expected)]
        if saved.get(k) != expected.get(k)
    )


def check_stamp(owner: str, state: Any, expected: dict[str, Any], fix: str) -> None:
    """Raises :class:`StateMismatchError` if ``state["_stamp"]`` differs from ``expected``.

    Args:
        owner: The wrapper's name, for the message.
        state: The wrapper's saved state (a mapping with ``_stamp``).
        expected: The stamp of the configured wrapper.
        fix: What the user can do, appended to the message.
    """
    saved = state.get("_stamp") if state is not None else None
    diff = stamp_differences(saved, expected)
    if diff is not None:
        raise StateMismatchError(
            f"{owner}: cannot restore a state written by a different configuration ({diff}). {fix}"
        )


def check_writer(owner: str, state: Any, hint: str) -> None:
    """Raises :class:`StateMismatchError` if ``state`` was saved by another wrapper class.

    Args:
        owner: The restoring wrapper's class name.
        state: The saved state at the wrapper's position in the pipeline.
        hint: Which setting makes the pipeline differ, and how to fix it.
    """
    writer = state.get("__class__") if state is not None else None
    if writer != owner:
        raise StateMismatchError(
            f"{owner}: the checkpoint holds a {writer} state at this position of the pipeline, "
            f"so it was written by a differently built pipeline. {hint}"
        )
