#!/usr/bin/env python
"""The planned order with sequence packing beside packing without the plan (every rank packing
its own draws) and the free-dealing bound: now the packed tables of ``tools/bench_planned.py``
(issue 32), which this runs. Arguments are passed on (``--cap``, ``--ranks``, ``--quick``, ...).

    python tools/bench_planned_packing.py --quick --cap 8192
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_planned import main  # noqa: E402

if __name__ == "__main__":
    main(["--only", "packed", *sys.argv[1:]])
