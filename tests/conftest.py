"""Shared fixtures: real prepared Energon datasets written once per test session."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

# planned runs share window plans through a node-local folder (/dev/shm by default): the tests
# keep theirs in a folder of their own (inherited by loader workers and spawned processes),
# removed when the session's process exits
if "ENERGON_ORDERING_PLAN_DIR" not in os.environ:
    _PLANS = tempfile.mkdtemp(prefix="energon-ordering-plans-")
    os.environ["ENERGON_ORDERING_PLAN_DIR"] = _PLANS
    atexit.register(lambda pid=os.getpid(): os.getpid() == pid and shutil.rmtree(_PLANS, True))


@pytest.fixture(autouse=True)
def _frozen_heap():
    """Before each test: collect what earlier tests left, then ``gc.freeze()`` what survives.

    After hundreds of tests the pytest process holds millions of long-lived objects (torch,
    Energon, Megatron, fixtures). Unfrozen, every full collection walks them all (our
    ``close_loader`` runs one after worker processes; Energon's loader one per iteration start),
    and every loader worker forked from the process writes to their pages when its own collector
    walks them, copying the parent's heap page by page: a 2-worker loader's epoch took 5.5-6.8 s
    with 3 million objects in the parent and 0.4-0.7 s with them frozen. Frozen objects are never
    collected, so only garbage that outlives its test (a destroyed module-scoped process group)
    stays, never finalised in any process; anything a test makes and drops is collected at the
    next test's start, as before.
    """
    gc.collect()
    gc.freeze()
    yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Unfreezes the heap, so that the interpreter's shutdown frees what the tests left as it
    would have (frozen objects are never freed: nanobind then reports triton's as leaked)."""
    gc.unfreeze()
    gc.collect()


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """640 trimodal samples in 20 shards of 32: resume and loss tests."""
    root = tmp_path_factory.mktemp("small")
    make_synthetic_dataset(root, [SourceSpec("web", 640, "trimodal")], shard_size=32)
    return root / "web"


@pytest.fixture(scope="session")
def align_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4,096 trimodal samples in 64 shards: cross-rank alignment tests with 8 ranks."""
    root = tmp_path_factory.mktemp("align")
    make_synthetic_dataset(root, [SourceSpec("web", 4096, "trimodal")], shard_size=64)
    return root / "web"


@pytest.fixture(scope="session")
def three_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A metadataset over web (2,000), code (2,000) and curated (500) samples."""
    root = tmp_path_factory.mktemp("three")
    return make_synthetic_dataset(
        root,
        [SourceSpec("web", 2000, "short"), SourceSpec("code", 2000, "medium"),
         SourceSpec("curated", 500, "short")],
        shard_size=50,
    )


#: Parameters that give a test loader worker processes.
_WORKER_PARAMS = ("num_workers", "workers")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The two tiers. A variant of a test with loader worker processes (a ``num_workers`` or
    ``workers`` parameter above 0) runs in the slow tier: each such loader starts processes and
    takes seconds to build. Its in-process variant (0 workers) stays in the fast tier, so the
    fast tier covers every test's logic and the slow tier (``-m slow``, run by .ci/run after the
    fast tier) every worker count."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(params.get(p), int) and params.get(p) > 0 for p in _WORKER_PARAMS):
            item.add_marker(pytest.mark.slow)
