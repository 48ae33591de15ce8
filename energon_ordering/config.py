"""OrderingConfig: the one validated configuration of the package (from Python, YAML or flags)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from energon_ordering.errors import OrderingConfigError, OrderingTypeError
from energon_ordering.pool_order import POOL_ORDERS

__all__ = ["OrderingConfig"]


@dataclasses.dataclass(frozen=True)
class OrderingConfig:
    """What decides the order of training samples.

    Args:
        length_sort_pool_size: Samples per length pool, per loader worker; 0 turns the pool off.
        length_sort_mode: ``"sample"`` (reference: permute sorted samples) or ``"batch"``
            (permute sorted micro-batch-sized chunks; near padding-free). See
            :mod:`energon_ordering.pool_order`.
        seed: Ordering seed, identical on every data-parallel rank.
    """

    length_sort_pool_size: int = 0
    length_sort_mode: str = "sample"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("length_sort_pool_size", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise OrderingTypeError(
                    f"OrderingConfig.{name} = {value!r} ({type(value).__name__}) must be an int."
                )
        if self.length_sort_pool_size < 0:
            raise OrderingConfigError(
                f"OrderingConfig.length_sort_pool_size = {self.length_sort_pool_size} must be "
                ">= 0 (0 turns the length pool off)."
            )
        if self.length_sort_mode not in POOL_ORDERS:
            raise OrderingConfigError(
                f"OrderingConfig.length_sort_mode = {self.length_sort_mode!r} is unknown; use "
                f"one of {sorted(POOL_ORDERS)}."
            )

    @property
    def length_sort_enabled(self) -> bool:
        """True if the length pool is on."""
        return self.length_sort_pool_size > 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OrderingConfig:
        """Builds a config from a mapping of field names; unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise OrderingTypeError(
                f"OrderingConfig.from_dict: expected a mapping of settings, got "
                f"{type(d).__name__}."
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise OrderingConfigError(
                f"OrderingConfig: unknown setting(s) {unknown}; known settings are "
                f"{sorted(known)}."
            )
        return cls(**dict(d))

    @classmethod
    def from_yaml(cls, path: str | Path) -> OrderingConfig:
        """Loads a recipe file (a YAML mapping of settings, see ``recipes/``)."""
        path = Path(path)
        if not path.is_file():
            raise OrderingConfigError(f"OrderingConfig.from_yaml: no file at {str(path)!r}.")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise OrderingConfigError(f"OrderingConfig.from_yaml: {path} is not valid YAML: {e}") from e
        try:
            return cls.from_dict(data if data is not None else {})
        except (OrderingConfigError, OrderingTypeError) as e:
            raise type(e)(f"{path}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (round-trips through :meth:`from_dict`)."""
        return dataclasses.asdict(self)
