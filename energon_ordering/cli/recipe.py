"""The ``RECIPE`` argument: a recipe file or a packaged recipe's name, and loading it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from energon_ordering.cli.user_error import user_errors
from energon_ordering.errors import OrderingError
from energon_ordering.packaged_recipes import resolve_recipe

if TYPE_CHECKING:
    from energon_ordering.config import OrderingConfig


class RecipeType(click.ParamType):
    """A recipe file's path, or the name of a packaged recipe (``demo``, ``slm_350m_20b``)."""

    name = "recipe"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return str(resolve_recipe(value))
        except OrderingError as e:
            self.fail(str(e), param, ctx)


RECIPE = RecipeType()


def load_recipe(path: str, *, total_steps: int | None = None) -> OrderingConfig:
    """Loads a recipe; ``total_steps`` overrides the recipe's (and its schedule's) before the
    schedule's fractional phase ends are resolved."""
    from collections.abc import Mapping

    from energon_ordering.config import OrderingConfig
    from energon_ordering.yaml_file import load_yaml

    with user_errors():
        if total_steps is None:
            return OrderingConfig.from_yaml(path)
        data = load_yaml(path, "OrderingConfig.from_yaml")
        if not isinstance(data, Mapping):
            return OrderingConfig.from_yaml(path)  # raises its own error
        sched = data.get("mixture_schedule")
        if isinstance(sched, str):
            sched_path = Path(sched) if Path(sched).is_absolute() else Path(path).parent / sched
            sched = load_yaml(sched_path, "MixtureSchedule.from_yaml")
        if isinstance(sched, Mapping) and "total_steps" in sched:
            sched = {**sched, "total_steps": total_steps}
        data = {**data, "total_steps": total_steps,
                **({"mixture_schedule": sched} if "mixture_schedule" in data else {})}
        try:
            return OrderingConfig.from_dict(data)
        except OrderingError as e:
            raise type(e)(f"{path}: {e}") from e
