"""Shared fixtures: real prepared Energon datasets written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset


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
