"""The length estimate used to inspect datasets of any sample type."""

from __future__ import annotations

import torch
from megatron.energon import CaptioningSample, VQASample

from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder
from energon_ordering.length_index.estimate import count_text_and_media, estimate_tokens


def test_counts_text_tokens_and_media_recursively():
    value = {"caption": "a b c", "image": torch.zeros(3, 8, 8), "extra": [torch.zeros(3, 2, 2), "d e"]}
    assert count_text_and_media(value) == (5, 2)
    assert estimate_tokens(value, 100) == 205
    assert count_text_and_media(torch.zeros(10)) == (0, 0)  # a 1-d tensor is not an image


def test_encoder_estimates_any_sample_type():
    te = LengthEstimateTaskEncoder(tokens_per_media=64)
    cap = CaptioningSample(__key__="k1", __restore_key__=(), __subflavors__={"source": "web"},
                           image=torch.zeros(3, 4, 4), caption="one two three")
    out = te.encode_sample(cap)
    assert (out.total_len, out.media_tokens, out.source, out.__key__) == (67, 64, "web", "k1")
    vqa = VQASample(__key__="k2", __restore_key__=(), image=torch.zeros(3, 4, 4),
                    context="what is it", answers=["a cat"], answer_weights=None)
    out = te.encode_sample(vqa)
    assert (out.total_len, out.media_tokens, out.source) == (64 + 5, 64, "-")
    batch = te.batch([te.encode_sample(cap), out])
    assert batch.keys == ["k1", "k2"] and batch.lengths == [67, 69] and batch.sources == ["web", "-"]
