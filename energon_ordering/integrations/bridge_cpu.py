"""A CPU stand-in for NVIDIA Transformer Engine, so Megatron-Bridge's data path imports on CPU.

Megatron-Bridge 0.6.2 imports ``transformer_engine`` at import time (for example
``megatron/bridge/peft/lora_layers.py`` names ``transformer_engine.pytorch`` classes in
annotations and ``isinstance`` checks), even on code paths that never run it. On a GPU image
(NVIDIA's NGC PyTorch container, or ``pip install "transformer-engine[pytorch]"`` beside a CUDA
toolkit) Transformer Engine is there and this module is not needed. On a CPU machine it cannot be
installed from the package index, and ``energon_ordering.integrations.bridge`` then fails to
import, naming ``transformer_engine``.

For CPU development and CI only (building datasets, the dataset provider, dataloader-state save
and load, config overrides and the YAML round trip), call :func:`install` once, before anything
imports Bridge::

    from energon_ordering.integrations import bridge_cpu

    bridge_cpu.install()
    from energon_ordering.integrations.bridge import OrderingDatasetProvider

What :func:`install` does, and nothing more:

1. imports ``megatron.core`` first, so megatron-core decides that Transformer Engine is absent and
   keeps its non-TE code paths;
2. puts two placeholder modules, ``transformer_engine`` and ``transformer_engine.pytorch``, into
   ``sys.modules``, where every attribute is a placeholder class (annotations and ``isinstance``
   checks work; constructing one raises :class:`RuntimeError` naming it);
3. imports the Bridge modules in ``modules`` (by default the ones this package's Bridge
   integration and its tests use) and removes the placeholders again, so anything imported later
   sees Transformer Engine absent, as it is.

Nothing is written to site-packages and nothing happens on import of this module: the stand-in
is never activated silently. With a real Transformer Engine installed, :func:`install` does
nothing and returns False. Model code that really uses Transformer Engine (TE layer specs, FP8,
``pretrain`` on a GPU model) does not work with the stand-in.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["BRIDGE_MODULES", "TE_STAND_IN_VERSION", "__version__", "install"]

#: Revision of this stand-in (bumped when what :func:`install` does changes).
__version__ = "1"

#: ``transformer_engine.__version__`` of the placeholder module while it is installed.
TE_STAND_IN_VERSION = "0.0.0+energon_ordering.cpu.stand.in"

#: Bridge modules imported under the stand-in by default: what
#: ``energon_ordering.integrations.bridge`` imports, plus Bridge's dataset-provider dispatch,
#: dataloader-state checkpointing, config container and its override/YAML utilities.
BRIDGE_MODULES: tuple[str, ...] = (
    "megatron.bridge.data.base",
    "megatron.bridge.data.utils",
    "megatron.bridge.data.energon.base_energon_datamodule",
    "megatron.bridge.training.callbacks",
    "megatron.bridge.training.checkpointing",
    "megatron.bridge.training.config",
    "megatron.bridge.training.utils.omegaconf_utils",
)


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(qualname: str) -> type:
    def _refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"transformer_engine.pytorch.{qualname} is energon_ordering's CPU stand-in "
            "(energon_ordering.integrations.bridge_cpu); Transformer Engine is not installed. "
            "Run on a GPU image with Transformer Engine (NGC PyTorch container, or "
            "pip install \"transformer-engine[pytorch]\")."
        )

    return _PlaceholderMeta(qualname, (), {"__init__": _refuse, "__qualname__": qualname,
                                           "__module__": "transformer_engine.pytorch"})


def _module_getattr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(name)


def _stand_in_modules() -> dict[str, types.ModuleType]:
    te = types.ModuleType("transformer_engine", "energon_ordering's CPU stand-in for Transformer Engine.")
    te.__version__ = TE_STAND_IN_VERSION
    te.__path__ = []  # a package, so `import transformer_engine.pytorch` resolves from sys.modules
    pytorch = types.ModuleType("transformer_engine.pytorch", "Placeholder classes for every name.")
    pytorch.__getattr__ = _module_getattr  # type: ignore[attr-defined]
    te.pytorch = pytorch  # type: ignore[attr-defined]
    return {"transformer_engine": te, "transformer_engine.pytorch": pytorch}


def install(modules: Sequence[str] = BRIDGE_MODULES) -> bool:
    """Imports Bridge's ``modules`` with the Transformer Engine stand-in, then removes it.

    Call before anything imports Bridge. Idempotent.

    Args:
        modules: Bridge modules to import under the stand-in (default :data:`BRIDGE_MODULES`).
            Bridge modules imported later, outside this call, see Transformer Engine absent.

    Returns:
        True if the stand-in was used; False if a real Transformer Engine is installed (then
        nothing is done).
    """
    import megatron.core  # noqa: F401  (first: megatron-core decides that TE is absent)

    if "transformer_engine" not in sys.modules and importlib.util.find_spec("transformer_engine") is not None:
        return False  # a real Transformer Engine: nothing to stand in for
    stand_in = _stand_in_modules()
    previous = {name: sys.modules.get(name) for name in stand_in}
    sys.modules.update(stand_in)
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        for name, module in previous.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return True
