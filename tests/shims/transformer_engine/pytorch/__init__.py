"""Placeholder classes for every name (see ``transformer_engine/__init__.py`` for why)."""

from __future__ import annotations

from typing import Any


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(qualname: str) -> type:
    def _refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"transformer_engine.pytorch.{qualname} is a CPU test stand-in; "
                           "Transformer Engine is not installed.")

    return _PlaceholderMeta(qualname, (), {"__init__": _refuse, "__qualname__": qualname,
                                           "__module__": __name__})


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(name)
