"""Where a sample's source name lives: ``__subflavors__["source"]``.

Energon samples carry the metadataset's ``subflavors`` in ``__subflavors__``; the scheduled blend
sets ``source`` there (a new dict, never mutating one shared with other samples), so the task
encoder, batches and diagnostics can read it. Works for ``Sample`` dataclasses and dict samples.
"""

from __future__ import annotations

from typing import Any, TypeVar

from energon_ordering.sample_fields import sample_field

__all__ = ["SOURCE_KEY", "sample_source", "tag_source"]

T = TypeVar("T")

#: The subflavor key that names a sample's source.
SOURCE_KEY = "source"


def sample_source(sample: Any) -> str | None:
    """The source name of a sample, or None if it has none."""
    sub = sample_field(sample, "__subflavors__")
    return None if not sub else sub.get(SOURCE_KEY)


def tag_source(sample: T, name: str) -> T:
    """Returns ``sample`` with ``__subflavors__["source"] == name``."""
    sub = sample_field(sample, "__subflavors__") or {}
    if sub.get(SOURCE_KEY) == name:
        return sample
    if isinstance(sample, dict):
        sample["__subflavors__"] = {**sub, SOURCE_KEY: name}
    else:
        sample.__subflavors__ = {**sub, SOURCE_KEY: name}
    return sample
