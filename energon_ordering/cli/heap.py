"""The index command's heap: a task encoder's per-sample buffers stay on glibc's heap.

glibc serves an allocation above ``M_MMAP_THRESHOLD`` with a fresh ``mmap`` and unmaps it when
it is freed. The threshold starts at 128 KiB and rises, by itself, to the size of each mapped
block freed, so whether a task encoder's per-sample arrays (a 448 px RGB image in float32 is
2.4 MB, several per sample in an image processor) are mapped, faulted in page by page and
unmapped again at every sample depends on what the process allocated before. Measured with
``tools/bench_index.py``'s LLaVA-like encoder (2,000 samples): one process took 11.8 s (1.83 s of
it in the kernel) with glibc's defaults and 10.1 s (0.41 s) with the thresholds fixed; under
torchrun the second of two processes spent 20% more CPU per sample than the first, and as much
as the first with them fixed.

:func:`keep_large_buffers_on_heap` fixes the thresholds for the command's process (``mallopt``)
and for the measuring processes it starts (``--workers``: glibc reads ``MALLOC_*_`` variables
at start). It changes nothing where the user set those variables, on another C library, or in
a training script calling :func:`~energon_ordering.length_index.build.build_length_index`
(the allocator of a training process is not this package's to tune: a script that builds its
index in process can start with ``MALLOC_MMAP_THRESHOLD_=67108864`` and
``MALLOC_TRIM_THRESHOLD_=134217728`` in its environment for the same effect).
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["MMAP_THRESHOLD", "keep_large_buffers_on_heap"]

#: Bytes: allocations up to this size come from the heap (glibc's dynamic ceiling is 32 MiB).
MMAP_THRESHOLD = 64 << 20

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_VARIABLES = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "MALLOC_TRIM_THRESHOLD_": 2 * MMAP_THRESHOLD}


def keep_large_buffers_on_heap() -> bool:
    """Fixes glibc's mmap threshold at :data:`MMAP_THRESHOLD` (and the trim threshold at twice
    it) in this process and the processes it starts; False where nothing was changed."""
    if not sys.platform.startswith("linux") or any(v in os.environ for v in _VARIABLES):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has mallopt, a no-op)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return False
    mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD)
    os.environ.update({name: str(value) for name, value in _VARIABLES.items()})
    return True
