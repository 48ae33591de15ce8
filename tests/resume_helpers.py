"""Cut-and-resume helpers shared by the exact-resume tests."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from typing import Any

from energon_ordering.rank_simulation import close_loader, record_batch


def run_with_cuts(
    make_loader: Callable[[], Any],
    total: int,
    cuts: Iterable[int],
    record: Callable[[Any], Any] = record_batch,
) -> tuple[list[Any], dict[int, Any]]:
    """Uninterrupted run of ``total`` batches; the records and the (pickled and reloaded)
    ``save_state_rank()`` taken before batch ``cut`` for every cut."""
    cuts = set(cuts)
    loader = make_loader()
    records, states, it = [], {}, None
    for step in range(total):
        if step in cuts:
            states[step] = pickle.loads(pickle.dumps(loader.save_state_rank()))
        if it is None:
            # Energon's save_state_rank() hangs if called between iter() and the first next()
            # with worker processes, so the iterator is created after the cut-0 save.
            it = iter(loader)
        records.append(record(next(it)))
    del it
    close_loader(loader)
    return records, states


def resume(
    make_loader: Callable[[], Any],
    state: Any,
    steps: int,
    record: Callable[[Any], Any] = record_batch,
) -> list[Any]:
    """A fresh loader restored from ``state``, run for ``steps`` batches."""
    loader = make_loader()
    loader.restore_state_rank(state)
    it = iter(loader)
    records = [record(next(it)) for _ in range(steps)]
    del it
    close_loader(loader)
    return records
