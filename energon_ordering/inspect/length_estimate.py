"""A task encoder for measuring the order of ANY Energon dataset without the user's model code.

``inspect`` and ``check-resume`` must run on a user's own prepared data, whatever its sample type
(captioning, VQA, interleaved, ...). :class:`LengthEstimateTaskEncoder` turns every sample into a
:class:`LengthSample` holding only its key, source and an estimated length in tokens: the
whitespace tokens of every text field plus ``tokens_per_media`` per image/video tensor. It is
``@stateless``, so the length pool can restore its samples. With packing (a recipe with
``pack_seq_length``) the mixin packs these samples into
:class:`~energon_ordering.pool.sequence_pack.SequencePack` s, and :meth:`batch` turns a micro-batch
of packs into a :class:`LengthPackBatch`: the documents flattened in pack order, plus each pack's
lengths and sources. Pass your own task encoder (with the ``OrderingTaskEncoder`` mixin) instead
to measure exact lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.energon import Batch, DefaultTaskEncoder, Sample, stateless

from energon_ordering.length_index.estimate import count_text_and_media
from energon_ordering.pool.sequence_pack import SequencePack
from energon_ordering.source_tag import sample_source
from energon_ordering.task_encoder import OrderingTaskEncoder
from energon_ordering.warmup.token_layout import TokenLayout

__all__ = [
    "LengthBatch",
    "LengthPackBatch",
    "LengthEstimateTaskEncoder",
    "LengthSample",
]


@dataclasses.dataclass
class LengthSample(Sample):
    """Key, source and estimated length (tokens) of a sample, and how many are media tokens."""

    total_len: int
    media_tokens: int
    source: str


@dataclasses.dataclass
class LengthBatch(Batch):
    """Per-sample keys, sources and lengths of a micro-batch."""

    keys: list[str]
    sources: list[str]
    lengths: list[int]


@dataclasses.dataclass
class LengthPackBatch(Batch):
    """A micro-batch of packs: per document, flattened over the packs in order, ``keys``,
    ``sources`` and ``lengths``; per pack ``pack_lengths`` and ``pack_sources`` (its documents'
    lengths and sources, in pack order)."""

    keys: list[str]
    sources: list[str]
    lengths: list[int]
    pack_lengths: list[list[int]]
    pack_sources: list[list[str]]


class LengthEstimateTaskEncoder(OrderingTaskEncoder, DefaultTaskEncoder):
    """Encodes any sample to a :class:`LengthSample` (see the module docstring).

    Args:
        tokens_per_media: Tokens an image (or video) stands for in the model's sequence.
    """

    #: The warmup lowers ``total_len`` (there are no token sequences); media are never cut.
    ordering_token_layout = TokenLayout(token_field=None, sequence_fields=(),
                                        length_field="total_len", media_count_field="media_tokens")

    def __init__(self, tokens_per_media: int = 256, **kwargs: Any):
        super().__init__(**kwargs)
        self.tokens_per_media = tokens_per_media

    @stateless
    def encode_sample(self, sample: Any) -> LengthSample:
        fields = (
            {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
            if dataclasses.is_dataclass(sample)
            else dict(sample)
        )
        text, media = count_text_and_media([v for k, v in fields.items() if not k.startswith("__")])
        media_tokens = media * self.tokens_per_media
        length = text + media_tokens
        key = fields.get("__key__")
        return LengthSample(
            __key__=key,
            __restore_key__=fields.get("__restore_key__", ()),
            __subflavors__=fields.get("__subflavors__"),
            __sources__=fields.get("__sources__"),
            total_len=max(1, length),
            media_tokens=media_tokens,
            source=sample_source(sample) or "-",
        )

    @stateless
    def batch(self, samples: list[LengthSample] | list[SequencePack]) -> LengthBatch | LengthPackBatch:
        if samples and isinstance(samples[0], SequencePack):
            docs = [d for p in samples for d in p.samples]
            return LengthPackBatch.from_samples(
                samples,
                keys=[d.__key__ for d in docs],
                sources=[d.source for d in docs],
                lengths=[int(x) for p in samples for x in p.lengths],
                pack_lengths=[[int(x) for x in p.lengths] for p in samples],
                pack_sources=[[d.source for d in p.samples] for p in samples],
            )
        return LengthBatch.from_samples(
            samples,
            keys=[s.__key__ for s in samples],
            sources=[s.source for s in samples],
            lengths=[s.total_len for s in samples],
        )
