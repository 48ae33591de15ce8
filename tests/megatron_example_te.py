"""Megatron-LM's examples/multimodal TaskEncoder with the mixin, importable as MODULE:CLASS.

Import only after ``megatron_lm_sources.use_megatron_lm(..., multimodal_example=True)`` and
Megatron's ``set_global_variables`` (the example's encoder reads ``get_args()`` and
``get_tokenizer()`` when constructed).
"""

from __future__ import annotations

from dataset_helpers import TaskEncoder  # Megatron-LM's own, unmodified
from megatron.energon import SampleDecoder

from energon_ordering import OrderingTaskEncoder


class TE(OrderingTaskEncoder, TaskEncoder):
    """The drop-in composition the README shows."""


class TEForCheckResume(TE):
    """For ``check-resume --task-encoder``: it builds its loaders with Energon's default decoder
    (torch tensors); the example's provider passes ``image_decode="pil"``, here set on the
    encoder the way Energon recommends."""

    decoder = SampleDecoder(image_decode="pil")
