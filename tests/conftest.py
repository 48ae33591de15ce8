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
