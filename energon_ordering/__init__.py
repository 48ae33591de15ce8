"""energon_ordering: the order in which training samples reach a Megatron-LM model.

Energon-native stages (each a ``BaseWrapperDataset`` that checkpoints restore keys, never
samples) and the pure ordering functions behind them, grouped by concern:

- ``pool/``: :class:`LengthPoolSortDataset` and the lean :class:`KeyPoolSortDataset` pool, sort
  by length and permute with a rank-independent seed, so every data-parallel rank processes
  similar lengths at the same step.
- ``mixture/``: :class:`MixtureSchedule` (weights as a pure function of the step) and
  :class:`ScheduledBlendDataset`.
- ``warmup/``: :class:`SeqLenWarmup` and :class:`SeqLenWarmupDataset` (length caps at batch time),
  :class:`PackCapDataset` (the cap of a pack with Energon's sequence packing).
- packing: :class:`PackPoolSortDataset` (a pool of packs sorted by attention cost), the default
  packer :func:`first_fit_decreasing` and its :class:`SequencePack`.
- ``length_index/``: per-sample lengths next to a prepared dataset, for the lean pool, and
  exact lengths without decoding: :func:`image_size` (from the image header) and the media
  token rules :class:`FixedImageTokens` (LLaVA-1.5), :class:`LlavaNextTokens`,
  :class:`InternVLTokens`, :class:`Qwen2VLTokens`, composed with text by :func:`header_length`.
- :class:`OrderingTaskEncoder` wires the stages into Energon's training pipeline from one
  :class:`OrderingConfig`; ``integrations/`` adapts it to host frameworks (Megatron-LM,
  Megatron-Bridge; imported on their own, so the package imports without the hosts) and
  ``inspect/`` measures the result.
- :func:`resolve_recipe` finds a recipe shipped with the package by name (``recipe_names()``).

Everything a user names imports from here. The names load on first use (PEP 562), so
``import energon_ordering`` (and the CLI's ``--help``) does not import torch or Energon.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Each public name and the module that defines it, imported on first access.
_EXPORTS: dict[str, str] = {
    "OrderingConfig": "energon_ordering.config",
    "LengthIndexError": "energon_ordering.errors",
    "NotRestorableError": "energon_ordering.errors",
    "OrderingConfigError": "energon_ordering.errors",
    "OrderingError": "energon_ordering.errors",
    "OrderingTypeError": "energon_ordering.errors",
    "SampleLengthError": "energon_ordering.errors",
    "SeqLenOverflowError": "energon_ordering.errors",
    "ShardReadError": "energon_ordering.errors",
    "StateMismatchError": "energon_ordering.errors",
    "build_length_index": "energon_ordering.length_index.build",
    "header_length": "energon_ordering.length_index.header_length",
    "image_size": "energon_ordering.length_index.image_header",
    "FixedImageTokens": "energon_ordering.length_index.media_tokens",
    "InternVLTokens": "energon_ordering.length_index.media_tokens",
    "LlavaNextTokens": "energon_ordering.length_index.media_tokens",
    "Qwen2VLTokens": "energon_ordering.length_index.media_tokens",
    "MixtureSchedule": "energon_ordering.mixture.schedule",
    "implied_epochs": "energon_ordering.mixture.schedule",
    "ScheduledBlendDataset": "energon_ordering.mixture.scheduled_blend",
    "recipe_names": "energon_ordering.packaged_recipes",
    "resolve_recipe": "energon_ordering.packaged_recipes",
    "KeyPoolSortDataset": "energon_ordering.pool.key_pool_sort",
    "LengthPoolSortDataset": "energon_ordering.pool.length_pool_sort",
    "first_fit_decreasing": "energon_ordering.pool.ffd_pack",
    "PackPoolSortDataset": "energon_ordering.pool.pack_pool_sort",
    "SequencePack": "energon_ordering.pool.sequence_pack",
    "check_loader_state": "energon_ordering.state_stamp",
    "restore_state_rank": "energon_ordering.state_stamp",
    "OrderingTaskEncoder": "energon_ordering.task_encoder",
    "SeqLenWarmup": "energon_ordering.warmup.schedule",
    "PackCapDataset": "energon_ordering.warmup.pack_cap",
    "SeqLenWarmupDataset": "energon_ordering.warmup.seq_warmup",
    "TokenLayout": "energon_ordering.warmup.token_layout",
}

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from energon_ordering.config import OrderingConfig
    from energon_ordering.errors import (
        LengthIndexError,
        NotRestorableError,
        OrderingConfigError,
        OrderingError,
        OrderingTypeError,
        SampleLengthError,
        SeqLenOverflowError,
        ShardReadError,
        StateMismatchError,
    )
    from energon_ordering.length_index.build import build_length_index
    from energon_ordering.length_index.header_length import header_length
    from energon_ordering.length_index.image_header import image_size
    from energon_ordering.length_index.media_tokens import (
        FixedImageTokens,
        InternVLTokens,
        LlavaNextTokens,
        Qwen2VLTokens,
    )
    from energon_ordering.mixture.schedule import MixtureSchedule, implied_epochs
    from energon_ordering.mixture.scheduled_blend import ScheduledBlendDataset
    from energon_ordering.packaged_recipes import recipe_names, resolve_recipe
    from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset
    from energon_ordering.pool.length_pool_sort import LengthPoolSortDataset
    from energon_ordering.pool.ffd_pack import first_fit_decreasing
    from energon_ordering.pool.pack_pool_sort import PackPoolSortDataset
    from energon_ordering.pool.sequence_pack import SequencePack
    from energon_ordering.state_stamp import check_loader_state, restore_state_rank
    from energon_ordering.task_encoder import OrderingTaskEncoder
    from energon_ordering.warmup.schedule import SeqLenWarmup
    from energon_ordering.warmup.pack_cap import PackCapDataset
    from energon_ordering.warmup.seq_warmup import SeqLenWarmupDataset
    from energon_ordering.warmup.token_layout import TokenLayout


__all__ = [
    "FixedImageTokens",
    "InternVLTokens",
    "KeyPoolSortDataset",
    "LengthIndexError",
    "LengthPoolSortDataset",
    "LlavaNextTokens",
    "MixtureSchedule",
    "NotRestorableError",
    "OrderingConfig",
    "OrderingConfigError",
    "OrderingError",
    "OrderingTaskEncoder",
    "OrderingTypeError",
    "PackCapDataset",
    "PackPoolSortDataset",
    "Qwen2VLTokens",
    "SampleLengthError",
    "ScheduledBlendDataset",
    "SeqLenOverflowError",
    "SeqLenWarmup",
    "SeqLenWarmupDataset",
    "SequencePack",
    "ShardReadError",
    "StateMismatchError",
    "TokenLayout",
    "__version__",
    "build_length_index",
    "check_loader_state",
    "first_fit_decreasing",
    "header_length",
    "image_size",
    "implied_epochs",
    "recipe_names",
    "resolve_recipe",
    "restore_state_rank",
]


def __getattr__(name: str) -> Any:
    """Imports a public name from its module on first access and caches it (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
