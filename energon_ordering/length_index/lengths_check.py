"""Checking a split's flat lengths file before the planned order maps it.

The planned order reads every sample's length from a ``.npy`` file beside the length index
(:mod:`energon_ordering.length_index.lengths_file`), named after a digest of what its content
depends on, so it is never stale; but nothing in its name says it is whole or unedited. A file
with fewer lengths than the split has samples silently shortened every epoch (half the file:
half the epoch); more lengths made the plan draw samples the split does not have (an untyped
``IndexError`` at the first batch); a truncated file was numpy's untyped ``mmap length is
greater than file size``; a NaN or negative length planned silently. :func:`check_lengths_file`
refuses each with one line naming the file, the value and the fix: the file is derived data,
so delete it and the next start rebuilds it from the length index.

Cost: mapping the file is O(1); the value check reads it once (about 0.1 s per 10^8 samples
from the page cache), once per rank at the pipeline's build.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from energon_ordering.errors import LengthIndexError, show

__all__ = ["check_lengths", "check_lengths_file"]

#: Lengths read per slice of the value check (bounded memory on a memory map).
_CHUNK = 1 << 22


def _rebuild(path: Path) -> str:
    return (f"delete {path} (derived data) and start again: it is rebuilt from the length "
            "index")


def check_lengths_file(path: str | Path, *, samples: int, dataset: object) -> None:
    """Refuses the split's lengths file at ``path`` (if there is one) unless it holds exactly
    ``samples`` finite lengths >= 0.

    Args:
        path: The split's flat lengths file
            (:func:`~energon_ordering.length_index.lengths_file.lengths_file_path`).
        samples: The split's sample count (Energon's index).
        dataset: The dataset, for the message.

    Raises:
        LengthIndexError: The file is truncated or not a ``.npy``, holds another number of
            lengths than the split has samples, or a length that is NaN, infinite or negative.
    """
    path = Path(path)
    if not path.is_file():
        return
    try:
        values = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise LengthIndexError(
            f"planned order: the lengths file {path} of {dataset} is truncated or damaged "
            f"({e}); {_rebuild(path)}."
        ) from None
    check_lengths(values, path=path, samples=samples, dataset=dataset)


def check_lengths(values: np.ndarray, *, path: str | Path, samples: int,
                  dataset: object) -> np.ndarray:
    """``values`` (the lengths read from ``path``) if they are ``samples`` finite lengths
    >= 0, else a :class:`LengthIndexError` naming the file, the value and the fix."""
    if values.ndim != 1 or values.dtype.kind not in "fiu":
        raise LengthIndexError(
            f"planned order: the lengths file {path} of {dataset} holds a {values.dtype} array "
            f"of shape {values.shape}, not one length per sample; {_rebuild(path)}."
        )
    if len(values) != samples:
        effect = ("every epoch would silently skip the samples it lacks" if len(values) < samples
                  else "the plan would draw samples the split does not have")
        raise LengthIndexError(
            f"planned order: the lengths file {path} holds {len(values):,} lengths, but the "
            f"split of {dataset} has {samples:,} samples ({effect}); it was edited or written "
            f"for other data: {_rebuild(path)}."
        )
    for start in range(0, len(values), _CHUNK):
        part = np.asarray(values[start:start + _CHUNK])
        bad = ~(np.isfinite(part) & (part >= 0))
        if bad.any():
            at = start + int(np.flatnonzero(bad)[0])
            raise LengthIndexError(
                f"planned order: the lengths file {path} of {dataset} holds length "
                f"{show(float(values[at]))} for sample {at:,} (Energon's sample index); a "
                f"length is a finite number >= 0 (tokens): {_rebuild(path)}."
            )
    return values
