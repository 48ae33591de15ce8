"""How long a sample is: the default length key of the length pool."""

from __future__ import annotations

from typing import Any

from energon_ordering.errors import SampleLengthError
from energon_ordering.sample_fields import sample_field, sample_key
from energon_ordering.errors import show

__all__ = ["default_sample_length"]


def default_sample_length(sample: Any) -> int:
    """Length of an encoded sample in tokens: ``total_len`` if present, else ``len(tokens)``.

    Works for Energon ``Sample`` dataclasses, other objects with those attributes, and dicts.

    Raises:
        SampleLengthError: The sample has neither field; the message names the sample key.
    """
    total_len = sample_field(sample, "total_len")
    if total_len is not None:
        return total_len
    tokens = sample_field(sample, "tokens")
    if tokens is not None:
        return len(tokens)
    raise SampleLengthError(
        f"Cannot tell the length of sample {show(sample_key(sample))} "
        f"({type(sample).__name__}): it has neither `total_len` nor `tokens`. Set one of them in "
        "encode_sample, or pass key_fn=<function sample -> length in tokens> to "
        "LengthPoolSortDataset (with OrderingTaskEncoder: override "
        "`ordering_sample_length(self, sample)`)."
    )
