"""Loaders timed side by side: live loaders in one process, stepped in turn."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from energon_ordering.inspect.rank_simulation import close_loader

__all__ = ["time_in_turns"]


def time_in_turns(loaders: dict[str, Any], batches_per_turn: int, rounds: int,
                  after_warmup: Callable[[], None] | None = None,
                  ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds of each turn of each loader, the loaders stepped in turn.

    Each loader first emits one turn untimed (start-up and first fills are not throughput);
    then every round gives each loader one turn of ``batches_per_turn`` micro-batches, the order
    rotated by one each round (for two loaders: AB BA AB ...). Turns of about a second expose
    every loader to the same load from other processes, where whole runs one after the other
    swung 0.30-1.22 on a shared machine. CPU time is this process's (``time.process_time``: for
    in-process loaders, what other processes cannot inflate). ``after_warmup`` is called once
    between the untimed turns and the first round (e.g. to reset a counter that the timed turns
    are compared with). The loaders are closed afterwards.

    Returns:
        ``(wall, cpu)``: per loader name, the seconds of each of its ``rounds`` turns.
    """
    its = {name: iter(loader) for name, loader in loaders.items()}
    for it in its.values():
        for _ in range(batches_per_turn):
            next(it)
    if after_warmup is not None:
        after_warmup()
    wall: dict[str, list[float]] = {name: [] for name in its}
    cpu: dict[str, list[float]] = {name: [] for name in its}
    names = list(its)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            gc.collect()
            t, c = time.perf_counter(), time.process_time()
            for _ in range(batches_per_turn):
                next(its[name])
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    del its
    for loader in loaders.values():
        close_loader(loader)
    gc.collect()
    return wall, cpu
