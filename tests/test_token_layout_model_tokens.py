"""The warmup caps MODEL tokens: a media placeholder weighs the embeddings it expands to."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from energon_ordering import TokenLayout
from energon_ordering.errors import OrderingTypeError
from energon_ordering.warmup.token_layout import truncate_sample

IMG = 32000  # the tokenizer's <image> id


@dataclass
class ImageTaskSample:  # the fields of Megatron-LM examples/multimodal's ImageTaskSample
    __key__: str
    tokens: torch.Tensor
    labels: torch.Tensor
    num_tiles: list
    total_len: int


def _sample(text_before: int, text_after: int, tiles=(1,), emb=576) -> ImageTaskSample:
    ids = list(range(1, text_before + 1))
    for _ in tiles:
        ids.append(IMG)
    ids += list(range(1000, 1000 + text_after))
    tokens = torch.tensor(ids)
    total = len(ids) + sum(tiles) * emb - len(tiles)  # Megatron's _get_total_seq_length
    return ImageTaskSample("k", tokens, tokens.clone() + 1, list(tiles), total)


def test_the_issue_sample_is_cut_in_model_tokens():
    s = _sample(5, 132)  # 138 tokens, total_len 713 (137 text + 576 image embeddings)
    assert (len(s.tokens), s.total_len) == (138, 713)
    r = truncate_sample(s, 640, TokenLayout.megatron(IMG, 576))
    assert not r.overflow and r.media_tokens == 576 and r.cut_tokens == 73
    out = r.sample
    assert out.total_len == 640 == len(out.tokens) - 1 + 576  # never total_len = len(tokens)
    assert (out.tokens == IMG).sum() == 1 and len(out.labels) == len(out.tokens)
    assert out.tokens[:6].tolist() == [1, 2, 3, 4, 5, IMG]  # text cut from the end only


def test_within_the_cap_in_model_tokens_is_untouched_and_over_it_is_cut():
    s = _sample(5, 20)  # 26 tokens, 601 model tokens
    layout = TokenLayout.megatron(IMG, 576)
    assert truncate_sample(s, 601, layout).sample is s
    r = truncate_sample(s, 600, layout)  # 26 tokens < 600, but the model sees 601
    assert r.cut_tokens == 1 and r.sample.total_len == 600
    # the default layout (placeholder = one token) would not have cut it
    assert truncate_sample(s, 600, TokenLayout(media_token_id=IMG)).cut_tokens == 0


def test_tiles_multiply_the_embeddings_and_media_alone_over_the_cap_overflow():
    s = _sample(3, 10, tiles=(2, 1), emb=64)  # 2 placeholders, 3 tiles x 64 = 192 media tokens
    layout = TokenLayout.megatron(IMG, 64)
    r = truncate_sample(s, 100, layout)
    assert r.overflow and r.media_tokens == 192 and r.sample is s
    r = truncate_sample(s, 200, layout)
    assert r.cut_tokens == 5 and r.sample.total_len == 200 and len(r.sample.tokens) == 10


def test_bad_tiles_or_embeddings_are_typed_errors():
    s = _sample(3, 10, tiles=(2, 1))
    s.num_tiles = [2]
    with pytest.raises(OrderingTypeError, match=r"`num_tiles` has 1 entries but the tokens hold 2 media placeholders"):
        truncate_sample(s, 100, TokenLayout.megatron(IMG, 64))
    with pytest.raises(OrderingTypeError, match=r"media_embeddings = 0 must be an int >= 1"):
        TokenLayout(media_embeddings=0)
