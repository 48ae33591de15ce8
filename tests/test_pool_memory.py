"""pool_memory: resident bytes of pooled objects, tensors counted by storage, once."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from energon_ordering.inspect.pool_memory import find_stage, pool_holdings, resident_bytes


def test_tensor_storage_is_counted_once():
    t = torch.zeros(3, 448, 448, dtype=torch.float32)
    one = resident_bytes([t])
    assert one >= t.numel() * 4
    # A view shares the storage: not counted again.
    assert resident_bytes([t, t[0], t.view(-1)]) < one + 1_000
    assert resident_bytes([t, t.clone()]) >= 2 * t.numel() * 4


def test_python_objects_numpy_and_dataclasses():
    import dataclasses

    @dataclasses.dataclass
    class S:
        key: str
        data: bytes
        arr: np.ndarray

    s = S("k", b"x" * 10_000, np.zeros(1000, dtype=np.float64))
    assert resident_bytes(s) >= 10_000 + 8_000
    keys = [("MapDataset", i, "Webdataset", i) for i in range(100)]
    assert resident_bytes(keys) >= sys.getsizeof(keys) + 100 * sys.getsizeof(keys[0])


def test_find_stage_and_holdings_reject_other_stages():
    class A:
        dataset = None

    class B:
        def __init__(self):
            self.dataset = A()

    assert isinstance(find_stage(B(), A), A) and find_stage(A(), B) is None

    class Blend:  # a stage over several inner datasets (Energon's ``datasets``)
        def __init__(self):
            self.datasets = (A(), B())

    class Target:
        dataset = None

    blend = Blend()
    blend.datasets[1].dataset = Target()
    assert isinstance(find_stage(blend, Target), Target)
    with pytest.raises(TypeError, match="not a length pool"):
        pool_holdings(A())
