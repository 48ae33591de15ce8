"""A small LLaVA-style task encoder for the synthetic datasets (tests, benchmarks, demo).

``encode_sample`` turns a ``CaptioningSample`` into a :class:`TokenizedSample`: the image is
represented by ``image_tokens`` placeholder tokens followed by the caption's whitespace tokens,
so ``total_len = image_tokens + len(caption.split())``. Stateless (a pure function of the
sample), as the length pool requires.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import torch
from megatron.energon import Batch, CaptioningSample, DefaultTaskEncoder, Sample, stateless

from energon_ordering.pool.sequence_pack import SequencePack
from energon_ordering.task_encoder import OrderingTaskEncoder
from energon_ordering.warmup.token_layout import TokenLayout

__all__ = [
    "IMAGE_TOKEN_ID",
    "IndexedSyntheticTaskEncoder",
    "PackedSyntheticBatch",
    "SyntheticBatch",
    "SyntheticTaskEncoder",
    "TokenizedSample",
]

#: Token id of the image placeholder.
IMAGE_TOKEN_ID = 1


@dataclasses.dataclass
class TokenizedSample(Sample):
    """An encoded multimodal sample.

    Attributes:
        tokens: Token ids, ``image_tokens`` placeholders first, then the caption.
        total_len: ``len(tokens)``, in tokens.
        num_media_tokens: How many leading tokens are image placeholders.
        source: Source name (from the metadataset subflavor ``source``, else the key prefix).
        image: The decoded image tensor (C, H, W).
    """

    tokens: torch.Tensor
    total_len: int
    num_media_tokens: int
    source: str
    image: torch.Tensor


@dataclasses.dataclass
class SyntheticBatch(Batch):
    """A padded batch: ``tokens`` is (B, max_len), ``lengths`` the unpadded lengths."""

    keys: list[str]
    sources: list[str]
    lengths: list[int]
    tokens: torch.Tensor
    images: torch.Tensor


@dataclasses.dataclass
class PackedSyntheticBatch(Batch):
    """A padded batch of packs: ``tokens`` is (B, longest pack); per document (flattened over
    the packs, in order) ``keys``, ``sources`` and ``lengths``; per pack ``pack_lengths`` and
    ``pack_sources`` (its documents' lengths and sources)."""

    keys: list[str]
    sources: list[str]
    lengths: list[int]
    pack_lengths: list[list[int]]
    pack_sources: list[list[str]]
    tokens: torch.Tensor
    images: torch.Tensor


_VOCAB_SIZE = 32000


def _token_id(word: str) -> int:
    return 2 + zlib.crc32(word.encode()) % _VOCAB_SIZE


class _Vocab(dict):
    """Word -> token id, filled on first use (a pure function of the word)."""

    def __missing__(self, word: str) -> int:
        self[word] = tok = _token_id(word)
        return tok


_VOCAB = _Vocab()


class SyntheticTaskEncoder(
    OrderingTaskEncoder,
    DefaultTaskEncoder[CaptioningSample, TokenizedSample, SyntheticBatch, SyntheticBatch],
):
    """Tokenizes synthetic captioning samples; the ordering stages come from the mixin.

    Args:
        image_tokens: Placeholder tokens per image.
    """

    ordering_token_layout = TokenLayout(media_token_id=IMAGE_TOKEN_ID)

    def __init__(self, image_tokens: int = 64, **kwargs: Any):
        super().__init__(**kwargs)
        self.image_tokens = image_tokens

    def media_tokens(self, sample: CaptioningSample) -> int:
        """Image placeholder tokens for ``sample`` (a pure function of the sample)."""
        return self.image_tokens

    def ordering_raw_sample_length(self, raw: dict[str, Any]) -> int:
        """Exact ``total_len`` from the raw files, without decoding the image."""
        return self.image_tokens + len(raw["txt"].split())

    @stateless
    def encode_sample(self, sample: CaptioningSample) -> TokenizedSample:
        words = sample.caption.split()
        n_media = self.media_tokens(sample)
        ids = [IMAGE_TOKEN_ID] * n_media + [_VOCAB[w] for w in words]
        source = (sample.__subflavors__ or {}).get("source") or sample.__key__.rsplit("-", 1)[0]
        return TokenizedSample.derive_from(
            sample,
            tokens=torch.tensor(ids, dtype=torch.int32),
            total_len=len(ids),
            num_media_tokens=n_media,
            source=source,
            image=sample.image,
        )

    @stateless
    def batch(self, samples: list[TokenizedSample] | list[SequencePack]) -> SyntheticBatch | PackedSyntheticBatch:
        if samples and isinstance(samples[0], SequencePack):
            return self._batch_packs(samples)
        max_len = max(s.total_len for s in samples)
        tokens = torch.zeros((len(samples), max_len), dtype=torch.int32)
        for i, s in enumerate(samples):
            tokens[i, : s.total_len] = s.tokens
        return SyntheticBatch.from_samples(
            samples,
            keys=[s.__key__ for s in samples],
            sources=[s.source for s in samples],
            lengths=[s.total_len for s in samples],
            tokens=tokens,
            images=torch.stack([s.image for s in samples]),
        )

    def _batch_packs(self, packs: list[SequencePack]) -> PackedSyntheticBatch:
        """Each pack's documents concatenated into one row (the default packer's packs)."""
        width = max(p.total_len for p in packs)
        tokens = torch.zeros((len(packs), width), dtype=torch.int32)
        for i, p in enumerate(packs):
            if p.samples:
                row = torch.cat([s.tokens for s in p.samples])
                tokens[i, : len(row)] = row
        docs = [s for p in packs for s in p.samples]
        return PackedSyntheticBatch.from_samples(
            packs,
            keys=[s.__key__ for s in docs],
            sources=[s.source for s in docs],
            lengths=[s.total_len for s in docs],
            pack_lengths=[list(p.lengths) for p in packs],
            pack_sources=[[s.source for s in p.samples] for p in packs],
            tokens=tokens,
            images=torch.stack([s.image for s in docs]),
        )


class IndexedSyntheticTaskEncoder(SyntheticTaskEncoder):
    """:class:`SyntheticTaskEncoder` without a raw length function: with the pre-encode pool its
    lengths must come from the dataset's length index (tests and benchmarks of that path)."""

    ordering_raw_sample_length = OrderingTaskEncoder.ordering_raw_sample_length

