"""A cheap length estimate for any sample: whitespace tokens of its text plus a fixed number of
tokens per image or video. Pure functions of a decoded sample's fields; the task encoder that
applies them to any Energon dataset is
:class:`~energon_ordering.inspect.length_estimate.LengthEstimateTaskEncoder`."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["count_text_and_media", "estimate_tokens"]


def count_text_and_media(value: Any) -> tuple[int, int]:
    """(whitespace tokens of text, number of images/videos) in ``value``, recursively."""
    if isinstance(value, str):
        return len(value.split()), 0
    if isinstance(value, torch.Tensor):
        return 0, int(value.ndim >= 3)
    if hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return 0, 1
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        counts = [count_text_and_media(v) for v in value]
        return sum(t for t, _ in counts), sum(m for _, m in counts)
    return 0, 0


def estimate_tokens(value: Any, tokens_per_media: int) -> int:
    """Whitespace tokens of text plus ``tokens_per_media`` per image/video, recursively."""
    text, media = count_text_and_media(value)
    return text + media * tokens_per_media
