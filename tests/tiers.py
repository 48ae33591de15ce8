"""Which tier a table-driven test case runs in (see tests/conftest.py for the rule)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest


def _has_workers(value: Any) -> bool:
    if isinstance(value, Mapping):
        workers = value.get("num_workers")
        return (isinstance(workers, int) and workers > 0) or any(
            _has_workers(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return any(_has_workers(v) for v in value)
    return False


def cases(table: Mapping[str, Any]) -> list:
    """The keys of a table of cases as parameters; a case whose loaders start worker processes
    (a ``num_workers`` above 0 anywhere in its row) goes to the slow tier, like a test with a
    ``num_workers`` parameter above 0."""
    return [pytest.param(key, marks=pytest.mark.slow, id=key) if _has_workers(row) else key
            for key, row in table.items()]
