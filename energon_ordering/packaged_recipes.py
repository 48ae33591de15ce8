"""The recipes shipped with the package, found by name from any working directory.

The repository keeps its recipes in the top-level ``recipes/`` folder. The wheel ships that
folder as package data at ``energon_ordering/recipes/`` (``pyproject.toml``:
``[tool.hatch.build.targets.wheel] sources``), so an installed package finds them without the
checkout. Run from a checkout (editable install, ``PYTHONPATH``), there is no such folder inside
the package and the checkout's ``recipes/`` is used instead.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from energon_ordering.errors import OrderingConfigError
from energon_ordering.errors import show

__all__ = ["recipe_dir", "recipe_names", "resolve_recipe"]

_SUFFIX = ".yaml"


def recipe_dir() -> Path | None:
    """The folder holding the packaged recipes, or None if there is none.

    ``energon_ordering/recipes/`` of an installed wheel first, else ``recipes/`` next to the
    package in a source checkout.
    """
    package = Path(__file__).resolve().parent
    installed = package / "recipes"
    if installed.is_dir():
        return installed
    checkout = package.parent / "recipes"
    return checkout if checkout.is_dir() else None


def recipe_names() -> list[str]:
    """Names of the packaged recipes (file names without ``.yaml``), sorted."""
    folder = recipe_dir()
    return [] if folder is None else sorted(p.stem for p in folder.glob(f"*{_SUFFIX}"))


def resolve_recipe(name_or_path: str | os.PathLike) -> Path:
    """The recipe file a user means by ``name_or_path``.

    An existing file wins (a path keeps working, relative to the working directory); otherwise a
    bare name (``demo`` or ``demo.yaml``) names a packaged recipe.

    Raises:
        OrderingConfigError: Neither a file nor a packaged recipe's name; the message suggests
            the closest packaged names of a mistyped name and lists all of them.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    text = str(name_or_path)
    name = text[: -len(_SUFFIX)] if text.endswith(_SUFFIX) else text
    folder = recipe_dir()
    if folder is not None and path.name == text and name in recipe_names():
        return folder / f"{name}{_SUFFIX}"
    if path.exists():
        raise OrderingConfigError(f"recipe {show(text)} is a directory; give a recipe file or a name.")
    names = ", ".join(recipe_names()) or "(none found: the package has no recipes folder)"
    close = difflib.get_close_matches(name, recipe_names()) if path.name == text else []
    suggest = f"Did you mean {_one_of(close)}? " if close else ""
    raise OrderingConfigError(
        f"recipe {show(text)} does not exist: no such file (from {os.getcwd()}) and no packaged "
        f"recipe of that name. {suggest}"
        f"Give a path to a YAML recipe or one of the packaged names: {names}."
    )


def _one_of(names: list[str]) -> str:
    """``'a'``, or ``'a', 'b' or 'c'``."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
