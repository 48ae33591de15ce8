"""The one cut-and-overflow implementation (warmup/cap_cut.py), without a dataset."""

from __future__ import annotations

import warnings

import pytest
import torch

from energon_ordering.errors import OrderingConfigError, OrderingTypeError, SeqLenOverflowError
from energon_ordering.warmup.cap_cut import (
    COUNTERS,
    MAX_CONSECUTIVE_DROPS,
    CapCutter,
    CapWording,
    EverySampleDroppedWarning,
    new_counts,
    new_epoch_counts,
)
from energon_ordering.warmup.token_layout import TokenLayout

MEDIA = 7
WORDS = CapWording(stage="Test stage", cap="test cap", kept="kept whole", unit="nothing fits",
                   fix="raise the test cap")


def _sample(key, n_media, n_text):
    tokens = torch.tensor([MEDIA] * n_media + list(range(100, 100 + n_text)))
    return {"__key__": key, "tokens": tokens, "total_len": len(tokens)}


def _cutter(overflow="keep"):
    return CapCutter(overflow=overflow, layout=TokenLayout(media_token_id=MEDIA), wording=WORDS, owner="Test")


def test_within_the_cap_passes_unchanged_and_is_counted_as_seen():
    counts, epoch = new_counts(), new_epoch_counts()
    s = _sample("a", 2, 5)
    out, cut = _cutter().cut(s, 10, step=0, counts=counts, epoch=epoch)
    assert out is s and not cut
    assert counts == {**dict.fromkeys(COUNTERS, 0), "seen": 1} and epoch == {"passed": 1, "dropped": 0}
    out, cut = _cutter().cut(s, None, step=0, counts=counts)  # no cap: passed, seen
    assert out is s and not cut and counts["seen"] == 2


def test_text_is_cut_from_the_end_and_media_never():
    counts = new_counts()
    s = _sample("a", 3, 10)
    out, cut = _cutter().cut(s, 8, step=2, counts=counts)
    assert cut and out["total_len"] == 8
    assert out["tokens"].tolist() == [MEDIA] * 3 + [100, 101, 102, 103, 104]
    assert counts["truncated"] == 1 and counts["truncated_tokens"] == 5


@pytest.mark.parametrize("overflow", ["keep", "drop"])
def test_media_above_the_cap_follow_the_policy_and_are_counted(overflow, caplog):
    counts, epoch = new_counts(), new_epoch_counts()
    s = _sample("big", 12, 4)
    out = _cutter(overflow).cut(s, 8, step=3, counts=counts, epoch=epoch)
    if overflow == "keep":
        assert out == (s, False) and counts["kept_over_cap"] == 1 and epoch["passed"] == 1
    else:
        assert out is None and counts["dropped"] == 1 and epoch == {"passed": 0, "dropped": 1}
    assert "sample 'big' has 12 media tokens, more than the test cap of 8 tokens at step 3" in caplog.text


def test_overflow_error_names_the_sample_the_cap_and_the_fix():
    with pytest.raises(SeqLenOverflowError, match=r"Test stage: sample 'big' has 12 media tokens, more than the "
                       r"test cap of 8 tokens at step 3\. Media tokens are never cut; raise the test cap, or "
                       r"set the overflow policy to 'keep' \(kept whole\) or 'drop'"):
        _cutter("error").cut(_sample("big", 12, 4), 8, step=3, counts=new_counts())


def test_media_limit_applies_the_policy_below_the_cut():
    # cut to 20, but a sample whose media exceed 8 follows the policy (the pack it opens has 8)
    counts = new_counts()
    assert _cutter("drop").cut(_sample("m", 10, 2), 20, step=0, counts=counts, media_limit=8) is None
    assert counts["dropped"] == 1
    out, cut = _cutter("drop").cut(_sample("t", 4, 30), 20, step=0, counts=counts, media_limit=8)
    assert cut and out["total_len"] == 20


def test_a_streak_of_drops_is_an_error_and_a_kept_sample_ends_it():
    cutter, counts = _cutter("drop"), new_counts()
    big, small = _sample("big", 12, 0), _sample("s", 1, 1)
    for _ in range(MAX_CONSECUTIVE_DROPS - 1):
        assert cutter.cut(big, 8, step=0, counts=counts) is None
    cutter.cut(small, 8, step=0, counts=counts)  # resets the streak
    assert cutter.dropped_in_a_row == 0
    for _ in range(MAX_CONSECUTIVE_DROPS - 1):
        cutter.cut(big, 8, step=0, counts=counts)
    with pytest.raises(SeqLenOverflowError, match=rf"{MAX_CONSECUTIVE_DROPS} samples in a row were dropped at step 0 "
                       r"\(test cap 8 tokens\).*so nothing fits"):
        cutter.cut(big, 8, step=0, counts=counts)


def test_recut_repeats_a_cut_without_counting():
    cutter = _cutter("drop")
    s = _sample("a", 2, 10)
    assert cutter.recut(s, 6)["tokens"].tolist() == [MEDIA, MEDIA, 100, 101, 102, 103]
    assert cutter.recut(_sample("big", 12, 0), 8) is None  # a dropped sample
    assert _cutter("keep").recut(_sample("big", 12, 0), 8)["total_len"] == 12
    # cutting twice equals cutting once to the smaller cap (nested restore keys rely on it)
    twice = cutter.recut(cutter.recut(s, 9), 6)
    assert torch.equal(twice["tokens"], cutter.recut(s, 6)["tokens"]) and twice["total_len"] == 6


def test_an_epoch_that_dropped_every_sample_warns_once_with_the_count():
    cutter, counts, epoch = _cutter("drop"), new_counts(), new_epoch_counts()
    for i in range(5):
        cutter.cut(_sample(f"b{i}", 12, 0), 8, step=0, counts=counts, epoch=epoch)
    with pytest.warns(EverySampleDroppedWarning, match=r"all 5 samples of this epoch on rank 0 worker 1 were dropped"):
        cutter.end_epoch(epoch, worker="rank 0 worker 1")
    assert epoch == new_epoch_counts()
    # an epoch that passed one sample, or an empty one, does not warn
    cutter.cut(_sample("b", 12, 0), 8, step=0, counts=counts, epoch=epoch)
    cutter.cut(_sample("s", 1, 1), 8, step=0, counts=counts, epoch=epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cutter.end_epoch(epoch, worker="w")
        cutter.end_epoch(new_epoch_counts(), worker="w")


def test_bad_settings_are_refused():
    with pytest.raises(OrderingConfigError, match=r"Test: overflow = 'skip' is unknown; use one of \['keep', 'drop', 'error'\]"):
        CapCutter(overflow="skip", layout=TokenLayout(), wording=WORDS, owner="Test")
    with pytest.raises(OrderingTypeError, match=r"Test: layout = 3 must be a TokenLayout"):
        CapCutter(overflow="keep", layout=3, wording=WORDS, owner="Test")
