"""Loading the package's YAML files (recipes, schedules) with errors that name the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from energon_ordering.errors import OrderingConfigError

__all__ = ["load_yaml"]


def load_yaml(path: str | Path, what: str) -> Any:
    """Parses the YAML file at ``path``; an empty file is ``{}``.

    Raises:
        OrderingConfigError: No such file, or not valid YAML (``what`` names the caller).
    """
    path = Path(path)
    if not path.is_file():
        raise OrderingConfigError(f"{what}: no file at {str(path)!r}.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise OrderingConfigError(f"{what}: {path} is not valid YAML: {e}") from e
    return {} if data is None else data
