"""Sequence-length warmup: the pure schedule, the cutter, and the batch-time stage on real data."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from megatron.energon import WorkerConfig, get_train_dataset, get_val_dataset

from energon_ordering import OrderingConfig, OrderingConfigError, OrderingTypeError, StateMismatchError
from energon_ordering.inspect.diagnostics import warmup_counts
from energon_ordering.errors import SeqLenOverflowError
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, resume, run_with_cuts
from energon_ordering.warmup.schedule import SeqLenWarmup
from energon_ordering.warmup.seq_warmup import SeqLenWarmupDataset
from energon_ordering.inspect.synthetic_task import IMAGE_TOKEN_ID, SyntheticTaskEncoder, TokenizedSample
from energon_ordering.warmup.token_layout import TokenLayout, truncate_sample


# ---- the schedule ---------------------------------------------------------------------------


def test_linear_warmup_values():
    w = SeqLenWarmup(512, 2048, 2000)
    assert w.max_seq_len(0) == 512
    assert w.max_seq_len(1000) == 1280
    assert w.max_seq_len(13) == 520  # 512 + 1536 * 13 / 2000 = 521.98 -> rounded down to 8
    assert w.max_seq_len(1999) == 2040
    assert w.max_seq_len(2000) == 2048  # full reached exactly at warmup_steps
    assert w.max_seq_len(10**9) == 2048
    lens = [w.max_seq_len(s) for s in range(2001)]
    assert all(a <= b for a, b in zip(lens, lens[1:]))
    assert all(x % 8 == 0 for x in lens)


def test_step_warmup_doubles_in_equal_stages():
    w = SeqLenWarmup(256, 2048, 3000, kind="step")
    assert [w.max_seq_len(s) for s in (0, 999, 1000, 1999, 2000, 2999, 3000)] == [
        256, 256, 512, 512, 1024, 1024, 2048]


def test_multiple_of():
    w = SeqLenWarmup(64, 4096, 100, multiple_of=64)
    assert all(w.max_seq_len(s) % 64 == 0 for s in range(101))
    # start and full need not be multiples: lengths round down, full is reached exactly
    w = SeqLenWarmup(100, 1000, 10)
    assert w.max_seq_len(0) == 96 and w.max_seq_len(9) == 904 and w.max_seq_len(10) == 1000


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(start=4096, full=2048, warmup_steps=10), r"start = 4096 > full = 2048"),
        (dict(start=0, full=2048, warmup_steps=10), r"start = 0 must be a positive int"),
        (dict(start=512, full=2048, warmup_steps=0), r"warmup_steps = 0"),
        (dict(start=4, full=2048, warmup_steps=10), r"multiple_of = 8 > start = 4.*at least 8"),
        (dict(start=512, full=2048, warmup_steps=10, kind="cosine"), r"kind = 'cosine' is unknown"),
        (dict(start=512.0, full=2048, warmup_steps=10), r"start = 512.0 must be a positive int"),
    ],
)
def test_bad_warmups(kwargs, match):
    with pytest.raises(OrderingConfigError, match=match):
        SeqLenWarmup(**kwargs)


def test_negative_step():
    with pytest.raises(OrderingConfigError, match=r"step = -1"):
        SeqLenWarmup(512, 2048, 10).max_seq_len(-1)


# ---- the cutter -----------------------------------------------------------------------------


def _sample(tokens, **extra):
    return TokenizedSample(
        __key__="k", __restore_key__=(), tokens=torch.tensor(tokens), total_len=len(tokens),
        num_media_tokens=0, source="web", image=torch.zeros(1), **extra)


LAYOUT = TokenLayout(media_token_id=IMAGE_TOKEN_ID)


@pytest.mark.parametrize(
    "tokens,cap,expected",
    [
        ([1, 1, 1, 5, 6, 7, 8], 5, [1, 1, 1, 5, 6]),          # media first (LLaVA)
        ([5, 1, 1, 6, 7, 8], 4, [5, 1, 1, 6]),                # media in the middle
        ([5, 6, 7, 8, 1, 1], 3, [5, 1, 1]),                   # media at the end: text from the end
        ([5, 1, 6, 1, 7, 1], 3, [1, 1, 1]),                   # only media fits
        ([5, 6, 7], 3, [5, 6, 7]),                            # fits: untouched
    ],
)
def test_media_tokens_are_never_cut(tokens, cap, expected):
    res = truncate_sample(_sample(tokens), cap, LAYOUT)
    assert res.sample.tokens.tolist() == expected
    assert res.sample.total_len == len(expected)
    assert (res.sample.tokens == IMAGE_TOKEN_ID).sum() == tokens.count(IMAGE_TOKEN_ID)
    assert res.cut_tokens == len(tokens) - len(expected) and not res.overflow


def test_overflow_when_media_alone_exceed_the_cap():
    s = _sample([1, 1, 1, 1, 5])
    res = truncate_sample(s, 3, LAYOUT)
    assert res.overflow and res.sample is s and res.media_tokens == 4


@dataclasses.dataclass
class Labeled:
    __key__: str
    tokens: list
    labels: list
    loss_mask: np.ndarray
    media_mask: list
    total_len: int


def test_labels_masks_and_lists_are_cut_together():
    s = Labeled("x", tokens=[9, 8, 7, 6, 5], labels=[8, 7, 6, 5, -1],
                loss_mask=np.array([0, 1, 1, 1, 1]), media_mask=[True, True, False, False, False],
                total_len=5)
    out = truncate_sample(s, 3, TokenLayout()).sample  # media from the sample's media_mask
    assert out.tokens == [9, 8, 7]
    assert out.labels == [8, 7, 6]
    assert out.loss_mask.tolist() == [0, 1, 1]
    assert out.media_mask == [True, True, False]
    assert out.total_len == 3


def test_length_only_samples():
    layout = TokenLayout(token_field=None, sequence_fields=(), length_field="total_len",
                         media_count_field="media")
    out = truncate_sample({"__key__": "l", "total_len": 900, "media": 256}, 512, layout)
    assert out.sample["total_len"] == 512 and out.cut_tokens == 388
    assert truncate_sample({"__key__": "l", "total_len": 900, "media": 600}, 512, layout).overflow
    with pytest.raises(OrderingTypeError, match="no length field"):
        truncate_sample({"__key__": "m"}, 5, layout)


def test_dict_samples_and_layout_errors():
    d = {"__key__": "d", "tokens": [1, 2, 3, 4], "labels": [2, 3, 4, 5]}
    out = truncate_sample(d, 2, TokenLayout()).sample
    assert out["tokens"] == [1, 2] and out["labels"] == [2, 3] and d["tokens"] == [1, 2, 3, 4]
    with pytest.raises(OrderingTypeError, match=r"`labels` has 3 entries but `tokens` has 4"):
        truncate_sample({"__key__": "e", "tokens": [1, 2, 3, 4], "labels": [1, 2, 3]}, 2, TokenLayout())
    with pytest.raises(OrderingTypeError, match=r"sample 'f' .* has no `ids`"):
        truncate_sample({"__key__": "f", "tokens": [1]}, 2, TokenLayout(token_field="ids"))


# ---- the stage on real pipelines -------------------------------------------------------------

WARMUP = dict(start=128, full=4096, warmup_steps=24)


def _cfg(warmup=True, pool=32, overflow="keep", mbps=2):
    return OrderingConfig(
        length_sort_pool_size=pool, length_sort_mode="batch", micro_batches_per_step=mbps,
        seq_length_warmup=WARMUP if warmup else None, seq_length_overflow=overflow)


def _batches(loader, n):
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    del it
    return out


def _run(path, cfg, n=64, num_workers=0, te=SyntheticTaskEncoder):
    loader = build_train_loader(path, ordering=cfg, num_workers=num_workers, task_encoder_factory=te)
    out = _batches(loader, n)
    state = loader.save_state_rank()
    close_loader(loader)
    return out, state


def test_lengths_follow_the_warmup_and_order_is_unchanged(small_dataset):
    warm, state = _run(small_dataset, _cfg())
    cold, _ = _run(small_dataset, _cfg(warmup=False))
    w = SeqLenWarmup(**WARMUP)
    for b, (a, c) in enumerate(zip(warm, cold)):
        step = b // 2  # two micro-batches per step
        assert a.keys == c.keys, "the warmup must never change the order of samples"
        if step < w.warmup_steps:
            assert max(a.lengths) <= w.max_seq_len(step)
            for la, lc, ta, tc in zip(a.lengths, c.lengths, a.tokens, c.tokens):
                assert la == min(lc, w.max_seq_len(step))
                assert torch.equal(ta[:la], tc[:la])  # text cut from the end, prefix kept
                assert (ta[:la] == IMAGE_TOKEN_ID).sum() == 64  # all image tokens kept
        else:
            assert a.lengths == c.lengths and torch.equal(a.tokens, c.tokens)  # untouched
    counts = warmup_counts(state)
    assert counts["seen"] == 256 and counts["truncated"] > 0 and counts["dropped"] == 0
    assert counts["truncated_tokens"] == sum(
        lc - la for a, c in zip(warm, cold) for la, lc in zip(a.lengths, c.lengths))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_inside_and_after_the_warmup(small_dataset, num_workers):
    cfg = _cfg()
    total, cuts = 64, (0, 9, 30, 47, 50)  # warmup ends at micro-batch 48

    def make():
        return build_train_loader(small_dataset, ordering=cfg, num_workers=num_workers)

    full, states = run_with_cuts(make, total, cuts, record=lambda b: b)
    for cut, state in states.items():
        resumed = resume(make, state, total - cut, record=lambda b: b)
        for b, (want, got) in enumerate(zip(full[cut:], resumed), start=cut):
            assert got.keys == want.keys, f"cut {cut}: keys differ at batch {b}"
            assert torch.equal(got.tokens, want.tokens), f"cut {cut}: tokens differ at batch {b}"


class BigImages(SyntheticTaskEncoder):
    def __init__(self):
        super().__init__(image_tokens=200)  # more media tokens than the first caps (128..)


class SomeBigImages(SyntheticTaskEncoder):
    # every third sample has a 200-token image, the others 64 tokens
    def media_tokens(self, sample):
        return 200 if int(sample.__key__.rsplit("-", 1)[1]) % 3 == 0 else 64


def test_overflow_keep_emits_uncut_and_counts(small_dataset):
    batches, state = _run(small_dataset, _cfg(pool=0), n=8, te=BigImages)
    assert all(L >= 200 for b in batches for L in b.lengths)
    assert all((b.tokens == IMAGE_TOKEN_ID).sum() == 200 * 4 for b in batches)
    assert warmup_counts(state)["kept_over_cap"] > 0


def test_overflow_drop_skips_and_counts(small_dataset):
    cfg = _cfg(pool=0, overflow="drop")
    dropped, state = _run(small_dataset, cfg, n=8, te=SomeBigImages)
    plain, _ = _run(small_dataset, _cfg(pool=0, warmup=False), n=16, te=SomeBigImages)
    kept = [k for b in dropped for k in b.keys]
    all_keys = [k for b in plain for k in b.keys]
    counts = warmup_counts(state)
    assert counts["dropped"] > 0 and counts["kept_over_cap"] == 0
    # the kept samples are the non-dropped ones, in their original order
    assert kept == [k for k in all_keys if k in set(kept)][: len(kept)]
    assert len(kept) + counts["dropped"] == counts["seen"]
    w = SeqLenWarmup(**WARMUP)
    for b, batch in enumerate(dropped):
        assert max(batch.lengths) <= w.max_seq_len(b // 2)  # nothing over the cap was kept
        if w.max_seq_len(b // 2) < 200:  # 200-token images cannot fit: none was kept
            assert all(int(k.rsplit("-", 1)[1]) % 3 != 0 for k in batch.keys)


def test_overflow_drop_of_every_sample_raises_instead_of_hanging(small_dataset):
    loader = build_train_loader(small_dataset, ordering=_cfg(pool=0, overflow="drop"),
                                task_encoder_factory=BigImages)
    with pytest.raises(SeqLenOverflowError, match=r"1000 samples in a row were dropped at step 0"):
        next(iter(loader))
    close_loader(loader)


def test_overflow_error_names_the_sample_and_the_fix(small_dataset):
    loader = build_train_loader(small_dataset, ordering=_cfg(pool=0, overflow="error"),
                                task_encoder_factory=BigImages)
    with pytest.raises(SeqLenOverflowError, match=r"sample 'web-\d+' has 200 media tokens, more than the warmup cap of 128 tokens at step 0.*'keep'.*'drop'"):
        next(iter(loader))
    close_loader(loader)


def test_warmup_only_in_training(small_dataset):
    te = SyntheticTaskEncoder()
    te.ordering = _cfg()
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    from energon_ordering.pool.length_pool_sort import LengthPoolSortDataset

    def chain(ds):
        out = [ds]
        while hasattr(ds, "datasets") and len(ds.datasets) == 1:
            ds = ds.dataset
            out.append(ds)
        return out

    train = chain(get_train_dataset(small_dataset, batch_size=4, worker_config=wc, task_encoder=te,
                                    shuffle_buffer_size=8, max_samples_per_sequence=8))
    types = [type(d) for d in train]
    assert types.index(SeqLenWarmupDataset) + 1 == types.index(LengthPoolSortDataset)
    val = chain(get_val_dataset(small_dataset, split_part="train", batch_size=4, worker_config=wc,
                                task_encoder=te))
    assert not any(isinstance(d, SeqLenWarmupDataset) for d in val)


def test_restoring_with_another_warmup_raises(small_dataset):
    _, state = _run(small_dataset, _cfg(), n=4)
    other = OrderingConfig(length_sort_pool_size=32, length_sort_mode="batch", micro_batches_per_step=2,
                           seq_length_warmup={**WARMUP, "start": 256})
    loader = build_train_loader(small_dataset, ordering=other)
    with pytest.raises(StateMismatchError, match=r"warmup: saved .*'start': 128.* != configured .*'start': 256"):
        loader.restore_state_rank(state)
    close_loader(loader)


def test_config_accepts_overflow_inside_the_warmup_block():
    cfg = OrderingConfig.from_dict({"seq_length_warmup": {**WARMUP, "overflow": "drop"}})
    assert cfg.seq_length_overflow == "drop"
    assert cfg.seq_length_warmup == SeqLenWarmup(**WARMUP)
    assert OrderingConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(OrderingConfigError, match=r"seq_length_overflow = 'skip' is unknown"):
        OrderingConfig(seq_length_overflow="skip")
    with pytest.raises(OrderingConfigError, match=r"unknown setting\(s\) \['length'\]"):
        OrderingConfig(seq_length_warmup={**WARMUP, "length": 3})
    with pytest.raises(OrderingTypeError, match=r"seq_length_warmup = 5 must be"):
        OrderingConfig(seq_length_warmup=5)
