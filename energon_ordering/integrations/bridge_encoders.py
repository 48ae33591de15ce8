r"""Bridge's built-in Energon task encoders (Hugging Face processor, Qwen-VL) under the ordering.

Bridge 0.6.2 configures its built-in encoders declaratively: ``HFEnergonTaskEncoderConfig`` and
``QwenVLEnergonTaskEncoderConfig`` (``megatron/bridge/data/builders/energon.py``), built at run
time by ``build_energon_task_encoder`` from an ``EnergonDatasetConfig``. That config cannot carry
the ordering (its builder returns ``iter(loader)``, which Bridge's saver cannot save, and its
``validate()`` admits only the built-in configs), and Bridge has no task-encoder hook yet. So
:class:`~energon_ordering.integrations.bridge.OrderingDatasetProvider` accepts the declarative
config as its ``task_encoder`` and calls :func:`build_builtin_encoder`, which

1. builds the encoder with Bridge's own ``build_energon_task_encoder`` (its processor loading,
   ``trust_remote_code`` rule and argument mapping; ``pad_to_max_length``, ``pad_to_multiple_of``,
   ``enable_in_batch_packing``, ``defer_in_batch_packing_to_step`` and
   ``in_batch_packing_pad_to_multiple_of`` passed through as in Bridge), then
2. gives it the ordering: an instance of :class:`OrderingHFTaskEncoder` or
   :class:`OrderingQwenVLTaskEncoder` (subclasses that put :class:`OrderingTaskEncoder` first and
   add only methods: no state, no constructor) takes over every attribute Bridge set.

What the subclasses add:

- ``encode_sample`` is declared ``@stateless``. Both built-in ``encode_sample`` are pure functions
  of the sample: they normalise the ChatML conversation and convert decoded images to PIL
  (Qwen-VL also counts visual tokens with its processor to skip over-budget samples, which is
  deterministic too); tokenization and vision preprocessing happen in ``batch`` (the collate). No
  random numbers, no state. ``tests/test_bridge_encoders.py`` checks the claim by re-encoding
  samples from their restore keys and comparing the collated tensors. Bridge's encoded samples
  carry no ``__restore_key__``; the subclass copies the input sample's one onto its output, so
  Energon can find the sample again (without it a pool cannot save the samples it holds).
- :meth:`ordering_sample_length`: the exact length the model computes on (DESIGN contract 9):
  the encoder's own collate applied to the one sample without padding or packing, so image
  placeholders weigh the visual embeddings they expand to. It costs one processor call per
  sample in the loader worker, on top of the collate's.

What the ordering does with them: the post-encode length pool (``length_sort_pool_size``),
mixture schedules, cross-rank seeds and exact resume. Refused with a built-in encoder (its samples
are conversations, not token sequences, so the package's cutters and packers have nothing to cut
or pack): ``seq_length_warmup``, ``packing_buffer_size`` (use Bridge's
``enable_in_batch_packing``) and ``length_sort_placement = "pre-encode"`` (only the post-encode
pool is supported with them; their length index, built from Python with
:func:`build_builtin_encoder` and ``build_length_index``, serves ``advise`` and ``inspect``).

With loader workers (``num_workers > 0``), set ``TOKENIZERS_PARALLELISM=false`` if the processor's
tokenizer runs in the training process before the workers start: Hugging Face tokenizers' thread
pool can deadlock a forked worker (a limitation of ``tokenizers`` with fork, not of the ordering).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.bridge.data.builders.energon import (
    EnergonDatasetConfig,
    HFEnergonTaskEncoderConfig,
    QwenVLEnergonTaskEncoderConfig,
    build_energon_task_encoder,
)
from megatron.bridge.data.energon.hf_task_encoder import HFTaskEncoder
from megatron.bridge.models.qwen_vl.data.collate_fn import qwen2_5_collate_fn
from megatron.bridge.models.qwen_vl.data.energon import QwenVLTaskEncoder
from megatron.energon import stateless

from energon_ordering.config import OrderingConfig
from energon_ordering.errors import OrderingConfigError, OrderingTypeError, show
from energon_ordering.task_encoder import OrderingTaskEncoder

__all__ = [
    "BUILTIN_ENCODER_CONFIGS",
    "BuiltinEncoderSettings",
    "OrderingHFTaskEncoder",
    "OrderingQwenVLTaskEncoder",
    "build_builtin_encoder",
    "check_builtin_ordering",
]

#: Bridge's declarative encoder configs the provider accepts as ``task_encoder``.
BUILTIN_ENCODER_CONFIGS = (HFEnergonTaskEncoderConfig, QwenVLEnergonTaskEncoderConfig)

#: Collate settings that make the one-sample collate of :meth:`ordering_sample_length` return the
#: sample's own tokens: no padding, no packing, no truncation.
_UNPADDED = dict(sequence_length=None, pad_to_max_length=False, pad_to_multiple_of=1,
                 enable_in_batch_packing=False, in_batch_packing_pad_to_multiple_of=1)


class _RestorableBuiltin(OrderingTaskEncoder):
    """What the ordering adds to a Bridge built-in encoder (see the module docstring)."""

    @stateless
    def encode_sample(self, sample: Any) -> Any:
        """Bridge's ``encode_sample`` (pure normalisation of the ChatML sample), with the input
        sample's restore key carried to the encoded sample."""
        encoded = super().encode_sample(sample)  # type: ignore[misc]
        encoded.__restore_key__ = sample.__restore_key__
        encoded.__sources__ = getattr(sample, "__sources__", None)
        return encoded

    def ordering_sample_length(self, sample: Any) -> float:
        """Tokens the model computes on for this encoded sample: text tokens plus the visual
        embeddings its media expand to, from the encoder's own collate without padding."""
        return float(self._ordering_collate_one(sample.example)["input_ids"].shape[1])

    def _ordering_collate_one(self, example: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


class OrderingHFTaskEncoder(_RestorableBuiltin, HFTaskEncoder):
    """Bridge's ``HFTaskEncoder`` (processor-based) with the ordering; built by
    :func:`build_builtin_encoder`."""

    def _ordering_collate_one(self, example: dict[str, Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(_UNPADDED, visual_keys=self.visual_keys)
        if self.min_pixels is not None:
            kwargs["min_pixels"] = self.min_pixels
        if self.max_pixels is not None:
            kwargs["max_pixels"] = self.max_pixels
        return self._collate_impl([example], self.processor, **kwargs)


class OrderingQwenVLTaskEncoder(_RestorableBuiltin, QwenVLTaskEncoder):
    """Bridge's ``QwenVLTaskEncoder`` with the ordering; built by :func:`build_builtin_encoder`."""

    def _ordering_collate_one(self, example: dict[str, Any]) -> dict[str, Any]:
        # the arguments of QwenVLTaskEncoder.collate_fn, unpadded
        return qwen2_5_collate_fn([example], self.image_processor, min_pixels=self.min_pixels,
                                  max_pixels=self.max_pixels, require_assistant_matches=True,
                                  **_UNPADDED)


_ORDERING_CLASS = {HFTaskEncoder: OrderingHFTaskEncoder, QwenVLTaskEncoder: OrderingQwenVLTaskEncoder}


@dataclasses.dataclass(frozen=True)
class BuiltinEncoderSettings:
    """The ``EnergonDatasetConfig`` fields Bridge's builder reads besides the encoder config;
    the provider fills them from its own fields of the same names."""

    seq_length: int
    pad_to_max_length: bool = False
    pad_to_multiple_of: int = 128
    enable_in_batch_packing: bool = False
    defer_in_batch_packing_to_step: bool = False
    in_batch_packing_pad_to_multiple_of: int = 1
    trust_remote_code: bool | None = None


def build_builtin_encoder(task_config: Any, settings: BuiltinEncoderSettings, *, path: str,
                          micro_batch_size: int) -> OrderingTaskEncoder:
    """Builds Bridge's encoder for ``task_config`` with Bridge's ``build_energon_task_encoder``
    and gives it the ordering (:class:`OrderingHFTaskEncoder` / :class:`OrderingQwenVLTaskEncoder`).

    Args:
        task_config: An ``HFEnergonTaskEncoderConfig`` or ``QwenVLEnergonTaskEncoderConfig``.
        settings: The padding / packing / ``trust_remote_code`` settings, as in Bridge's
            ``EnergonDatasetConfig``.
        path: The dataset path (Bridge's config requires one; the builder does not read it).
        micro_batch_size: Samples per micro-batch (likewise required, not read).
    """
    if not isinstance(task_config, BUILTIN_ENCODER_CONFIGS):
        raise OrderingTypeError(
            f"OrderingDatasetProvider.task_encoder = {type(task_config).__name__}: of Bridge's "
            "declarative encoder configs the ordering supports HFEnergonTaskEncoderConfig and "
            "QwenVLEnergonTaskEncoderConfig; for another encoder define class "
            f"MyTE(OrderingTaskEncoder, ItsEncoderClass) and pass MyTE(...)."
        )
    config = EnergonDatasetConfig(
        path=path, micro_batch_size=micro_batch_size, task_encoder=task_config,
        **dataclasses.asdict(settings),
    )
    encoder = build_energon_task_encoder(config)
    ordering_class = _ORDERING_CLASS.get(type(encoder))
    if ordering_class is None:  # pragma: no cover - a Bridge release that builds another class
        raise OrderingTypeError(
            f"Bridge's build_energon_task_encoder returned {type(encoder).__qualname__} for "
            f"{type(task_config).__name__}; the ordering knows {sorted(c.__name__ for c in _ORDERING_CLASS)}. "
            "Pass your own OrderingTaskEncoder subclass of it instead."
        )
    # Bridge built and configured the object; the ordering class adds methods only, no state, so
    # an instance of it with the built object's attributes is that encoder with the ordering.
    # (No __slots__ anywhere in these classes: __dict__ holds all of it.)
    ordered = ordering_class.__new__(ordering_class)
    ordered.__dict__.update(vars(encoder))
    return ordered


def check_builtin_ordering(config: OrderingConfig, task_config: Any) -> None:
    """Refuses the ordering settings a built-in encoder cannot serve, naming the field and fix."""
    name = type(task_config).__name__
    refusals = [
        ("seq_length_warmup", config.seq_length_warmup is not None,
         "the warmup cuts token sequences, and a built-in encoder's samples are conversations "
         "tokenized only in its collate; remove seq_length_warmup (warm up with Bridge's "
         "model.seq_length per stage) or use your own OrderingTaskEncoder"),
        ("packing_buffer_size", config.packing_buffer_size is not None,
         "Energon's packing needs the encoder's select_samples_to_pack / pack_selected_samples, "
         "which the built-in encoders do not have; use the provider's "
         "enable_in_batch_packing=True (Bridge's in-batch packing) instead"),
        ("length_sort_placement", config.length_sort_placement != "post-encode",
         "only the post-encode pool is supported with Bridge's built-in encoders (their length "
         "index, from build_builtin_encoder + build_length_index, serves advise and inspect); use "
         "length_sort_placement: post-encode"),
    ]
    for field, refused, why in refusals:
        if refused:
            raise OrderingConfigError(
                f"OrderingConfig.{field} = {show(getattr(config, field))} with Bridge's built-in "
                f"encoder ({name}): {why}."
            )
