"""The package's imports run down only (DESIGN.md, "Layout").

Rooms, from the top: ``cli/``; ``integrations/`` and ``inspect/``; ``task_encoder``;
``pipeline/`` (which stages a configuration gets); ``config``; ``pool/``, ``mixture/``,
``warmup/``, ``length_index/``, ``planned/``; the shared base (``errors``, ``state_stamp``, ``yaml_file``,
``sqlite_file``, ``sample_fields``, ``source_tag``, ``worker_checkpoint``, ``step_clock``). A room may import rooms below it and itself.
Within the middle level, ``length_index`` may use ``pool`` (building an index reads samples with
the pool's deferred loading and measures them with its length key), and ``planned`` may use
``mixture`` (per-step counts), ``length_index`` (the lengths it plans from) and ``pool`` (the cost
of a sample, the byte-range reader); no other sideways import is allowed. ``cli/`` is at the top: it may import every other room (and the package's
``__version__``), and no room imports it. Every import counts, including lazy ones inside
functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import energon_ordering

PACKAGE = Path(energon_ordering.__file__).parent

BASE = {
    "errors", "state_stamp", "yaml_file", "sqlite_file", "sample_fields", "source_tag",
    "packaged_recipes", "worker_checkpoint", "step_clock", "saved_counters", "failed_epoch",
}
MIDDLE = {"pool", "mixture", "warmup", "length_index", "planned"}

#: The rooms each room may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "sample_fields": set(),
    "state_stamp": {"errors", "worker_checkpoint", "saved_counters", "failed_epoch"},
    "failed_epoch": {"errors"},
    "worker_checkpoint": set(),
    "step_clock": set(),
    "saved_counters": {"errors"},
    "yaml_file": {"errors"},
    "sqlite_file": set(),
    "packaged_recipes": {"errors"},
    "source_tag": {"sample_fields"},
    "pool": BASE,
    "mixture": BASE,
    "warmup": BASE,
    "length_index": BASE | {"pool"},
    "planned": BASE | {"mixture", "length_index", "pool"},
    "schedules": BASE | {"mixture", "warmup"},  # deprecated re-export
    "config": BASE | MIDDLE,
    "pipeline": BASE | MIDDLE | {"config"},
    "task_encoder": BASE | MIDDLE | {"config", "pipeline"},
    "inspect": BASE | MIDDLE | {"config", "pipeline", "task_encoder"},
    "integrations": BASE | MIDDLE | {"config", "pipeline", "task_encoder"},
}
#: The command line is at the top: it may import everything below it.
ALLOWED["cli"] = set(ALLOWED) | {"__init__"}


def _room(module: str) -> str:
    """``energon_ordering.pool.order`` -> ``pool``; ``energon_ordering`` -> ``__init__``."""
    parts = module.split(".")
    assert parts[0] == "energon_ordering", module
    if len(parts) > 1 and ((PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file()):
        return parts[1]
    return "__init__"  # the package itself, or a name it defines (``__version__``)


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of ``energon_ordering`` in ``source``."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or target == "energon_ordering":
                out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, target))
    return [(line, m) for line, m in out if m.split(".")[0] == "energon_ordering"]


def _violations(source: str, module: str, is_package: bool) -> list[str]:
    own = _room(module)
    return [
        f"line {line}: {target} (room {_room(target)!r})"
        for line, target in _imports(source, module, is_package)
        if _room(target) != own and _room(target) not in ALLOWED[own]
    ]


FILES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_down(path: Path) -> None:
    module = _module_name(path)
    assert _room(module) in ALLOWED, f"{path}: room {_room(module)!r} is not in the layout"
    bad = _violations(path.read_text(), module, path.name == "__init__.py")
    assert not bad, f"{path.relative_to(PACKAGE)} imports upward or sideways: {bad}"


def test_nothing_imports_the_cli() -> None:
    assert [room for room, allowed in ALLOWED.items() if "cli" in allowed] == []
    assert (PACKAGE / "cli").is_dir() and not (PACKAGE / "cli.py").exists()
    bad = _violations("from energon_ordering.cli.tables import table\n",
                      "energon_ordering.inspect.plots", is_package=False)
    assert bad == ["line 1: energon_ordering.cli.tables (room 'cli')"]


def test_the_rule_catches_upward_imports() -> None:
    """Lazy imports inside functions and relative imports count too."""
    source = (PACKAGE / "pool" / "order.py").read_text() + (
        "\n\ndef _f():\n    from ..inspect import plots\n"
        "    from energon_ordering.mixture.policy import BLEND_POLICIES\n"
        "    import energon_ordering.task_encoder\n"
    )
    bad = _violations(source, "energon_ordering.pool.order", is_package=False)
    assert [b.split("(room ")[1] for b in bad] == ["'inspect')", "'mixture')", "'task_encoder')"]
    assert _violations("from . import settings\nfrom ..errors import OrderingError\n",
                       "energon_ordering.pool.order", is_package=False) == []


def test_public_api() -> None:
    names = {
        "OrderingConfig", "OrderingTaskEncoder", "LengthPoolSortDataset", "KeyPoolSortDataset",
        "ScheduledBlendDataset", "SeqLenWarmupDataset", "MixtureSchedule", "SeqLenWarmup",
        "implied_epochs", "TokenLayout", "OrderingError", "OrderingConfigError",
        "OrderingTypeError", "NotRestorableError", "SampleLengthError", "StateMismatchError",
        "SeqLenOverflowError", "LengthIndexError", "ShardReadError",
    }
    missing = sorted(n for n in names if not hasattr(energon_ordering, n))
    assert not missing
    assert names <= set(energon_ordering.__all__)


def test_deprecated_schedules_module_reexports() -> None:
    from energon_ordering import schedules

    assert "deprecated" in schedules.__doc__.lower()
    assert schedules.MixtureSchedule is energon_ordering.MixtureSchedule
    assert schedules.SeqLenWarmup is energon_ordering.SeqLenWarmup
    assert schedules.implied_epochs is energon_ordering.implied_epochs
