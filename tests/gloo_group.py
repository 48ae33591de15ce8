"""A one-process gloo group inside the pytest process, for tests of code that asks
``torch.distributed`` (rank, world size, an all-reduce) without spawning ranks.

Ending it takes more than ``destroy_process_group``: that drops torch's references, but the
group's Python object sits in a reference cycle until a full collection. A loader worker forked
before that collection inherits the cycle, and its own first ``gc.collect`` (Energon's
``GcDataset`` runs one at the start of each worker) destroys the inherited C++ group there, which
waits on the condition variables of gloo threads that do not exist in the fork: the worker hangs
or dies with a segmentation fault, in whichever test forks next. So the group is collected here,
in the process that made it.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def gloo_group_of_one(init_file: Path) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        gc.collect()
