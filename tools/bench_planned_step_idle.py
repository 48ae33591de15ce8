#!/usr/bin/env python
"""Idle per micro-batch and per optimizer step of the planned order beside the free-dealing
bound: now columns of ``tools/bench_planned.py`` (issue 32), which this runs for padded
micro-batches. Arguments are passed on (``--ranks``, ``--micro-batches``, ``--mixes``, ...).

    python tools/bench_planned_step_idle.py --ranks 8,64,1024 --micro-batches 8
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_planned import main  # noqa: E402

if __name__ == "__main__":
    main(["--only", "padded", *sys.argv[1:]])
