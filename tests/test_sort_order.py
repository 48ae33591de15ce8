"""stable_ascending: exactly numpy's stable argsort, by composite keys where lengths are whole."""

import numpy as np
import pytest

from energon_ordering.planned import sort_order
from energon_ordering.planned.sort_order import (
    scatter_by_length,
    stable_argsort,
    stable_argsort_rows,
    stable_ascending,
    stable_by_int,
)


@pytest.mark.parametrize("make", [
    lambda r: r.integers(0, 8, 5000),                       # many ties
    lambda r: r.integers(0, 1 << 30, 5000),                 # long lengths (beyond uint16)
    lambda r: r.integers(0, 300, 5000).astype(np.float64),  # whole floats
    lambda r: r.integers(0, 300, 5000).astype(np.uint16),
    lambda r: r.random(5000) * 100,                         # fractions: the fallback
    lambda r: r.integers(-5, 5, 5000),                      # negative: the fallback
    lambda r: np.full(5000, 2.0**45),                       # too long for the key: fallback
    lambda r: np.zeros(0, dtype=np.int64),
])
def test_it_is_numpys_stable_order(make):
    v = make(np.random.default_rng(0))
    got = stable_ascending(v)
    assert np.array_equal(got, np.argsort(v, kind="stable"))
    assert got.dtype.kind == "i"


def test_nan_falls_back():
    v = np.array([3.0, np.nan, 1.0, 1.0])
    assert np.array_equal(stable_ascending(v), np.argsort(v, kind="stable"))


@pytest.mark.parametrize("n", [0, 1, 5000, (1 << 17) * 2 + 123])  # empty, one, one chunk, three
@pytest.mark.parametrize("spread", [8, 300, (1 << 16) - 1])  # many ties .. the widest lengths
def test_scatter_by_length_is_the_stable_order_of_its_keys(n, spread):
    """The keys land in numpy's stable order of the lengths, ties in index order, across
    chunks (a length's samples in several chunks keep their order)."""
    r = np.random.default_rng(n + spread)
    lengths = r.integers(0, spread, n, endpoint=True).astype(np.uint16)
    ids = r.permutation(1 << 22)[:n] if n <= 1 << 22 else None
    order = np.argsort(lengths, kind="stable")
    for low, bits in ((ids, 22), (None, 24)):
        out = np.full(n, -1, dtype=np.int64)
        scatter_by_length(lengths, low, bits, out)
        want_low = order if low is None else low[order]
        assert np.array_equal(out >> bits, lengths[order].astype(np.int64))
        assert np.array_equal(out & ((1 << bits) - 1), want_low)


def test_scatter_by_length_refuses_what_it_cannot_count():
    out = np.empty(3, dtype=np.int64)
    with pytest.raises(ValueError, match="uint16"):
        scatter_by_length(np.array([1, 2, 3]), None, 8, out)
    with pytest.raises(ValueError, match="bits=48"):
        scatter_by_length(np.array([1, 2, 3], dtype=np.uint16), None, 48, out)
    with pytest.raises(ValueError, match="as many"):
        scatter_by_length(np.array([1, 2, 3], dtype=np.uint16), np.arange(2), 8, out)


@pytest.mark.parametrize("make", [
    lambda r: r.integers(0, 8, 5000),                        # one digit, many ties
    lambda r: r.integers(0, 1 << 19, 40_000).astype(np.int32),  # two digits (a window's packs)
    lambda r: r.integers(0, 1 << 40, 5000),                  # three digits
    lambda r: np.zeros(7, dtype=np.uint8),
    lambda r: np.zeros(0, dtype=np.int64),
])
def test_stable_by_int_is_the_stable_argsort(make):
    keys = make(np.random.default_rng(2))
    got = stable_by_int(keys)
    assert got.dtype == (np.int32 if len(keys) else np.int64)
    assert np.array_equal(got, np.argsort(keys, kind="stable"))


def test_stable_by_int_refuses_what_it_cannot_sort():
    with pytest.raises(TypeError, match="integer keys"):
        stable_by_int(np.array([1.5, 0.5]))
    with pytest.raises(ValueError, match=">= 0"):
        stable_by_int(np.array([3, -1]))


@pytest.mark.parametrize("make", [
    lambda r: r.random(8192) * 1e5,                          # no ties: the default sort
    lambda r: r.integers(0, 50, 8192).astype(np.float64),   # many ties: distinct keys
    lambda r: np.array([0.0, -0.0, 1.0, -0.0, 0.0]),        # equal, differently signed
    lambda r: np.array([2.0, np.nan, 1.0, np.nan, 1.0]),    # NaNs sort last, by index
    lambda r: np.array([3.0]),
    lambda r: np.zeros(0),
    lambda r: np.array([1.0, 2.0, np.nan]),                 # no ties, one NaN
    lambda r: r.integers(0, 9, 400),                         # integers
])
def test_stable_argsort_is_the_stable_argsort(make):
    v = make(np.random.default_rng(4))
    assert np.array_equal(stable_argsort(v), np.argsort(v, kind="stable"))


def test_stable_argsort_takes_one_dimension():
    with pytest.raises(ValueError, match="1-D"):
        stable_argsort(np.zeros((2, 3)))


def _costs(r, shape, high):
    """Sums of ``L + L^2 / 4096`` of whole lengths: multiples of 1/4096, with ties."""
    L = r.integers(0, high, shape + (3,)).astype(np.float64)
    return (L + L * L / 4096).sum(axis=-1)


@pytest.mark.parametrize("make", [
    lambda r: _costs(r, (3, 1024), 9000),                   # the keyed sort
    lambda r: _costs(r, (2, 300), 4),                       # ties everywhere
    lambda r: np.zeros((2, 500)),                           # all tied
    lambda r: _costs(r, (4, 16), 9000),                     # short rows: the stable sort
    lambda r: r.random((2, 200)) * 100,                     # fractions: the fallback
    lambda r: np.full((2, 100), 2.0**60),                   # too large for the key: fallback
    lambda r: np.where(r.random((2, 100)) < 0.1, np.nan, 1.0),  # NaN: the fallback
    lambda r: np.zeros((0, 100)),
])
@pytest.mark.parametrize("kind", [None, "stable"])  # either machine's sort of the keys
def test_stable_argsort_rows_is_the_stable_argsort_of_each_row(make, kind, monkeypatch):
    monkeypatch.setattr(sort_order, "runs_sort_kind", lambda: kind)
    v = make(np.random.default_rng(5))
    assert np.array_equal(stable_argsort_rows(v), np.argsort(v, axis=1, kind="stable"))


def test_the_runs_sort_kind_is_decided_once_and_is_a_sort_numpy_has():
    kind = sort_order.runs_sort_kind()
    assert kind in (None, "stable")
    assert sort_order.runs_sort_kind() is kind  # cached: one timing per process
    np.sort(np.arange(5), kind=kind)


def test_stable_argsort_rows_takes_two_dimensions():
    with pytest.raises(ValueError, match="2-D"):
        stable_argsort_rows(np.zeros(3))
