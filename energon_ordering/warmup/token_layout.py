"""How to shorten a sample: which fields are per-token sequences and which positions are media.

The sequence-length warmup cuts samples to ``max_seq_len(step)`` tokens. For a multimodal sample
only TEXT tokens may be cut, from the end; media placeholder tokens (the positions an image's
embeddings are scattered into) are never cut, or the model would get an image with missing
patches. :class:`TokenLayout` is the small protocol that tells the cutter about the user's
sample type; the default fits samples with ``tokens`` (+ optional ``labels``, ``loss_mask``,
``attention_mask``, ``position_ids``) and ``total_len``.

Media positions come from, in this order: a boolean per-token field ``media_mask_field`` on the
sample, else ``tokens == media_token_id``, else there are none (everything is text).

Lengths are counted in MODEL tokens, the positions the language model sees: a media placeholder
weighs the number of embeddings it expands to (``media_embeddings``, times its tile count from
``media_tiles_field`` if set), text tokens weigh one. The cap applies to that count, and after a
cut ``length_field`` is lowered by the number of text tokens removed (never reset to
``len(tokens)``). :meth:`TokenLayout.megatron` describes Megatron-LM's ``examples/multimodal``
samples (one ``<image>`` placeholder per image, ``num_tiles`` x embeddings per tile).

Length-only samples (no token sequence, e.g. for measuring an order): ``token_field=None``; the
cut then lowers ``length_field`` to the cap, and ``media_count_field`` names the media tokens
that may not be cut.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from energon_ordering.errors import OrderingTypeError
from energon_ordering.sample_fields import sample_field, sample_key
from energon_ordering.errors import show
from energon_ordering.warmup.overflow import OVERFLOW_POLICIES

__all__ = ["OVERFLOW_POLICIES", "TokenLayout", "TruncationResult", "truncate_sample"]



@dataclass(frozen=True)
class TokenLayout:
    """Describes the token sequences of an encoded sample.

    Attributes:
        token_field: The token-id sequence; its length is the sample's length. None for
            length-only samples (see the module docstring).
        sequence_fields: Per-token sequences cut together with the tokens (missing ones are
            skipped; present ones must have the token sequence's length).
        length_field: A field holding the length in tokens, updated after a cut (None: none).
        media_token_id: Token id of media placeholders (None: use ``media_mask_field`` only).
        media_mask_field: Boolean per-token field marking media positions, if the sample has it.
        media_count_field: With ``token_field=None``: the field holding the media tokens.
        media_embeddings: Model positions one media placeholder expands to (per tile when
            ``media_tiles_field`` is set); 1 = the placeholder is itself one model token.
        media_tiles_field: A per-media sequence of tile counts (Megatron's ``num_tiles``), in
            placeholder order; placeholder i then weighs ``tiles[i] * media_embeddings``.
    """

    token_field: str | None = "tokens"
    sequence_fields: tuple[str, ...] = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    length_field: str | None = "total_len"
    media_token_id: int | None = None
    media_mask_field: str | None = "media_mask"
    media_count_field: str | None = None
    media_embeddings: int = 1
    media_tiles_field: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.media_embeddings, bool) or not isinstance(self.media_embeddings, int) or self.media_embeddings < 1:
            raise OrderingTypeError(
                f"TokenLayout: media_embeddings = {show(self.media_embeddings)} must be an int >= 1 "
                "(model positions one media placeholder expands to)."
            )

    @classmethod
    def megatron(cls, media_token_id: int, embeddings_per_tile: int) -> TokenLayout:
        """The layout of Megatron-LM ``examples/multimodal`` samples (``ImageTaskSample``).

        ``tokens`` and ``labels`` are per-token; each image is one ``media_token_id`` placeholder
        that the model expands to ``num_tiles[i] x embeddings_per_tile`` embeddings;
        ``total_len`` is the model length (``len(tokens) + sum(num_tiles) x embeddings - images``).

        Args:
            media_token_id: The tokenizer's id of ``<image>`` (the task encoder's ``img_token_id``).
            embeddings_per_tile: Image embeddings per tile (``num_image_embeddings_per_tile``).
        """
        return cls(token_field="tokens", sequence_fields=("tokens", "labels"), length_field="total_len",
                   media_token_id=int(media_token_id), media_mask_field=None,
                   media_embeddings=int(embeddings_per_tile), media_tiles_field="num_tiles")


@dataclass(frozen=True)
class TruncationResult:
    """What :func:`truncate_sample` did.

    Attributes:
        sample: The (possibly new) sample; the input sample if nothing was cut.
        cut_tokens: Text tokens removed (each is one model token).
        media_tokens: Model tokens of the sample's media (placeholders x what they expand to);
            -1 if the sample was within the cap before its media were counted.
        overflow: The media tokens alone exceed ``max_len`` (nothing was cut).
    """

    sample: Any
    cut_tokens: int
    media_tokens: int
    overflow: bool


def _as_bool_array(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().astype(bool)
    return np.asarray(x, dtype=bool)


def _select(seq: Any, keep: np.ndarray) -> Any:
    if isinstance(seq, torch.Tensor):
        return seq[torch.from_numpy(keep)]
    if isinstance(seq, np.ndarray):
        return seq[keep]
    if isinstance(seq, (list, tuple)):
        return type(seq)(v for v, k in zip(seq, keep) if k)
    raise OrderingTypeError(f"cannot cut a {type(seq).__name__}; use a tensor, array or list.")


def truncate_sample(sample: Any, max_len: int, layout: TokenLayout) -> TruncationResult:
    """Cuts text tokens from the end of ``sample`` until it has at most ``max_len`` tokens.

    Media tokens are never cut: the kept positions are every media position plus the first
    ``max_len - n_media`` text positions, in their original order, applied to every sequence
    field. If the media alone exceed ``max_len`` nothing is cut and ``overflow`` is set.
    """
    if layout.token_field is None:
        return _truncate_length_only(sample, max_len, layout)
    tokens = sample_field(sample, layout.token_field)
    if tokens is None:
        raise OrderingTypeError(
            f"Sequence-length warmup: sample {show(sample_key(sample))} ({type(sample).__name__}) has no "
            f"`{layout.token_field}`; set TokenLayout(token_field=...) on the task encoder "
            "(`ordering_token_layout`)."
        )
    n = len(tokens)
    weighted = layout.media_embeddings != 1 or layout.media_tiles_field is not None
    if n <= max_len and not weighted:
        return TruncationResult(sample, 0, -1, False)
    media = None
    if layout.media_mask_field is not None:
        mask = sample_field(sample, layout.media_mask_field)
        if mask is not None:
            media = _as_bool_array(mask)
    if media is None and layout.media_token_id is not None:
        ids = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
        media = ids == layout.media_token_id
    if media is None:
        media = np.zeros(n, dtype=bool)
    if len(media) != n:
        raise OrderingTypeError(
            f"Sequence-length warmup: sample {show(sample_key(sample))}: `{layout.media_mask_field}` has "
            f"{len(media)} entries but `{layout.token_field}` has {n}."
        )
    n_placeholders = int(media.sum())
    n_media = _media_model_tokens(sample, n_placeholders, layout)
    if n - n_placeholders + n_media <= max_len:
        return TruncationResult(sample, 0, n_media, False)
    if n_media > max_len:
        return TruncationResult(sample, 0, n_media, True)
    text_rank = np.cumsum(~media) - 1
    keep = media | (text_rank < max_len - n_media)
    changes: dict[str, Any] = {}
    fields = list(layout.sequence_fields)
    if layout.token_field not in fields:
        fields.insert(0, layout.token_field)
    if layout.media_mask_field is not None and sample_field(sample, layout.media_mask_field) is not None:
        fields.append(layout.media_mask_field)
    for name in fields:
        seq = sample_field(sample, name)
        if seq is None:
            continue
        if len(seq) != n:
            raise OrderingTypeError(
                f"Sequence-length warmup: sample {show(sample_key(sample))}: `{name}` has {len(seq)} "
                f"entries but `{layout.token_field}` has {n}; list only per-token fields in "
                "TokenLayout.sequence_fields."
            )
        changes[name] = _select(seq, keep)
    cut = n - int(keep.sum())
    old_len = None if layout.length_field is None else sample_field(sample, layout.length_field)
    if old_len is not None:  # the model length loses exactly the text tokens cut
        changes[layout.length_field] = int(old_len) - cut
    return TruncationResult(_rebuild(sample, changes), cut, n_media, False)


def _media_model_tokens(sample: Any, n_placeholders: int, layout: TokenLayout) -> int:
    """Model tokens the sample's ``n_placeholders`` media placeholders expand to."""
    if layout.media_tiles_field is None:
        return n_placeholders * layout.media_embeddings
    tiles = sample_field(sample, layout.media_tiles_field)
    if tiles is None:
        raise OrderingTypeError(
            f"Sequence-length warmup: sample {show(sample_key(sample))} has no `{layout.media_tiles_field}` "
            "(TokenLayout.media_tiles_field); set it to None if media have no tiles."
        )
    tiles = [int(t) for t in (tiles.tolist() if hasattr(tiles, "tolist") else tiles)]
    if len(tiles) != n_placeholders:
        raise OrderingTypeError(
            f"Sequence-length warmup: sample {show(sample_key(sample))}: `{layout.media_tiles_field}` has "
            f"{len(tiles)} entries but the tokens hold {n_placeholders} media placeholders "
            f"(media_token_id = {layout.media_token_id})."
        )
    return sum(tiles) * layout.media_embeddings


def _rebuild(sample: Any, changes: dict[str, Any]) -> Any:
    if isinstance(sample, dict):
        return {**sample, **changes}
    if dataclasses.is_dataclass(sample):
        return dataclasses.replace(sample, **changes)
    raise OrderingTypeError(
        f"Sequence-length warmup: cannot rebuild a {type(sample).__name__}; use a dataclass "
        "(Energon Sample) or a dict sample."
    )


def _truncate_length_only(sample: Any, max_len: int, layout: TokenLayout) -> TruncationResult:
    if layout.length_field is None or sample_field(sample, layout.length_field) is None:
        raise OrderingTypeError(
            f"Sequence-length warmup: sample {show(sample_key(sample))} has no length field "
            f"`{layout.length_field}` (TokenLayout with token_field=None cuts the length only)."
        )
    n = int(sample_field(sample, layout.length_field))
    if n <= max_len:
        return TruncationResult(sample, 0, -1, False)
    n_media = int(sample_field(sample, layout.media_count_field) or 0) if layout.media_count_field else 0
    if n_media > max_len:
        return TruncationResult(sample, 0, n_media, True)
    return TruncationResult(_rebuild(sample, {layout.length_field: max_len}), n - max_len, n_media, False)
