"""Reading fields of a sample, whatever its form: an Energon ``Sample`` dataclass, any object
with attributes, or a dict sample. Shared by the pool, the warmup and the source tag."""

from __future__ import annotations

from typing import Any

__all__ = ["sample_field", "sample_key"]


def sample_field(sample: Any, name: str) -> Any:
    """A field of an Energon ``Sample`` dataclass (or any object) or a dict sample; None if absent."""
    if isinstance(sample, dict):
        return sample.get(name)
    return getattr(sample, name, None)


def sample_key(sample: Any) -> str | None:
    """The sample's ``__key__`` (dataclass attribute or dict entry), or None."""
    return sample_field(sample, "__key__")
