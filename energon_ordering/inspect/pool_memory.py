"""How much memory a length pool holds: the resident bytes of the pooled objects.

``tracemalloc`` does not see tensor storage (torch allocates it outside Python's allocator), so
the pool's memory is measured from the objects themselves: every tensor storage and numpy buffer
once, plus ``sys.getsizeof`` of every Python object (samples, fields, keys, floats) reached from
the pool's holdings, each object counted once.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import torch

from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset
from energon_ordering.pool.length_pool_sort import LengthPoolSortDataset

__all__ = ["find_stage", "pool_holdings", "resident_bytes"]


def resident_bytes(obj: Any) -> int:
    """Bytes held by ``obj`` and everything it references (tensor storages, numpy buffers,
    Python objects), each counted once."""
    seen: set[int] = set()
    storages: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, torch.Tensor):
            storage = o.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(o, np.ndarray):
            if o.base is None:
                total += o.nbytes
            else:
                stack.append(o.base)
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            stack.extend(getattr(o, f.name) for f in dataclasses.fields(o))
    return total


def find_stage(dataset: Any, cls: type) -> Any:
    """The first stage of type ``cls`` in a pipeline, walking inwards through every inner
    dataset (``.datasets`` of Energon wrappers, including blends, else ``.dataset``); or None."""
    stack = [dataset]
    while stack:
        stage = stack.pop()
        if isinstance(stage, cls):
            return stage
        inner = getattr(stage, "datasets", None)
        if inner is None:
            inner = (getattr(stage, "dataset", None),)
        stack.extend(d for d in reversed(tuple(inner)) if d is not None)
    return None


def pool_holdings(pool: Any) -> tuple[int, list[Any]]:
    """(number of pooled samples, the objects the pool holds for them) of either pool."""
    if isinstance(pool, LengthPoolSortDataset):
        bufs = (pool._collecting, pool._emitting)
        held = [x for b in bufs for x in (b._buffer, b._restore_keys)]
        return sum(len(b._buffer) for b in bufs), held
    if isinstance(pool, KeyPoolSortDataset):
        held = [pool._emit_keys, pool._collect_keys, pool._collect_lengths, pool._emit_packed,
                pool._collect_packed]
        return len(pool._emit_keys) + len(pool._collect_keys), held
    raise TypeError(f"pool_holdings: {type(pool).__name__} is not a length pool.")
