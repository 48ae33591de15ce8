"""cli/heap.py: the index command keeps a task encoder's large per-sample buffers on glibc's heap
instead of mapping and faulting them in again at every sample."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# 40 MB buffers (above glibc's dynamic mmap ceiling of 32 MiB), allocated, written and freed 20
# times; prints the minor page faults of the last 19 rounds and what the call returned.
_ROUNDS = textwrap.dedent("""
    import os, resource, sys
    from energon_ordering.cli.heap import keep_large_buffers_on_heap
    kept = keep_large_buffers_on_heap() if sys.argv[1] == "kept" else None
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = bytearray(40 << 20); del buffer
    before = faults()
    for _ in range(19):
        buffer = bytearray(40 << 20)  # zero-filled: every page written
        del buffer
    print(faults() - before, kept, os.environ.get("MALLOC_MMAP_THRESHOLD_"))
""")


def _run(mode: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], env={**clean, **env},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return out.split()


def test_large_buffers_are_not_faulted_in_again_at_every_round():
    default, kept = _run("default"), _run("kept")
    pages = 19 * (40 << 20) // 4096
    assert int(default[0]) > pages // 2  # mapped and faulted in anew at every round
    assert int(kept[0]) < pages // 20 and kept[1:] == ["True", str(64 << 20)]


def test_a_users_malloc_settings_are_left_as_they_are():
    faults, kept, threshold = _run("kept", MALLOC_MMAP_THRESHOLD_="131072")
    assert (kept, threshold) == ("False", "131072")
    assert int(faults) > 19 * (40 << 20) // 4096 // 2
