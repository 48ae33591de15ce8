"""SequencePack: the packed sample the default packer emits, and how to read a pack's documents.

Energon's packing (``select_samples_to_pack`` / ``pack_selected_samples``) leaves the packed
sample type to the task encoder. For encoders without their own packing functions,
:class:`~energon_ordering.task_encoder.OrderingTaskEncoder` packs into a :class:`SequencePack`:
the documents, unchanged and in pack order, plus their lengths (``cu_seqlens`` is their
cumulative sum). The pool of packs and the diagnostics need the per-document lengths of any
pack: :func:`pack_doc_lengths` reads them from a ``SequencePack``, or from the ``cu_lengths`` /
``cu_seqlens`` field of a packed sample (Megatron-LM's ``examples/multimodal`` packs carry
``cu_lengths``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.energon import Sample

from energon_ordering.errors import SampleLengthError
from energon_ordering.sample_fields import sample_field, sample_key
from energon_ordering.errors import show

__all__ = ["SequencePack", "pack_doc_lengths"]


@dataclasses.dataclass
class SequencePack(Sample):
    """A pack of documents that share one sequence.

    Attributes:
        samples: The packed documents (encoded samples, cut to the pack target if needed), in
            pack order.
        lengths: Length of each document, in tokens; ``sum(lengths) <= target`` unless a
            document alone exceeds it (media are never cut).
    """

    samples: list[Any]
    lengths: list[int]

    @property
    def total_len(self) -> int:
        """Tokens in the pack."""
        return int(sum(self.lengths))


def pack_doc_lengths(pack: Any) -> list[int]:
    """Per-document lengths of a packed sample, in tokens.

    Reads ``SequencePack.lengths``, else the differences of a ``cu_lengths`` or ``cu_seqlens``
    field (cumulative lengths starting at 0).

    Raises:
        SampleLengthError: The pack has none of these; override
            ``OrderingTaskEncoder.ordering_pack_lengths`` for your pack type.
    """
    if isinstance(pack, SequencePack):
        return [int(x) for x in pack.lengths]
    for name in ("cu_lengths", "cu_seqlens"):
        cu = sample_field(pack, name)
        if cu is not None:
            values = cu.tolist() if hasattr(cu, "tolist") else list(cu)
            values = [int(v) for v in (values[0] if values and isinstance(values[0], list) else values)]
            return [b - a for a, b in zip(values, values[1:])]
    raise SampleLengthError(
        f"Cannot tell the document lengths of pack {show(sample_key(pack))} ({type(pack).__name__}): "
        "it is not a SequencePack and has no `cu_lengths` / `cu_seqlens`. Override "
        "`ordering_pack_lengths(self, pack) -> list[int]` in your task encoder."
    )
