"""Diagnostics on constructed inputs with known answers."""

from __future__ import annotations

import pytest

from energon_ordering.inspect.diagnostics import batch_cost, padding_waste, rank_overlap, straggler_idle


def test_batch_cost_has_linear_and_quadratic_terms():
    assert batch_cost([4096]) == 4096 + 4096
    assert batch_cost([100, 200]) == pytest.approx(300 + (100**2 + 200**2) / 4096)


def test_straggler_idle_known_values():
    assert straggler_idle([[[10], [10]], [[5, 5], [5, 5]]]) == 0.0
    # one rank costs c, the other 0: mean/max = 1/2 -> half the time idle
    assert straggler_idle([[[4096], []]]) == pytest.approx(0.5)
    # costs 1x and 3x: mean/max = 2/3
    c1 = batch_cost([100])
    step = [[100], [100, 100, 100]]
    assert batch_cost(step[1]) == pytest.approx(3 * c1)
    assert straggler_idle([step]) == pytest.approx(1 / 3)


def test_step_idle_per_step():
    from energon_ordering.inspect.diagnostics import step_idle

    assert step_idle([[[10], [10]], [[4096], []], [[100], [100, 100, 100]]]) == pytest.approx(
        [0.0, 0.5, 1 / 3])


def test_straggler_idle_rejects_empty_input():
    with pytest.raises(ValueError, match="no steps"):
        straggler_idle([])
    with pytest.raises(ValueError, match="step 0 has no ranks"):
        straggler_idle([[]])


def test_padding_waste_known_values():
    assert padding_waste([[5, 5, 5]]) == 0.0
    assert padding_waste([[1, 3]]) == pytest.approx(1 - 4 / 6)
    assert padding_waste([[2, 2], [1, 3]]) == pytest.approx((0 + 1 / 3) / 2)
    with pytest.raises(ValueError, match="no non-empty batches"):
        padding_waste([[]])


def test_rank_overlap():
    assert rank_overlap([["a", "b"], ["c"], ["d"]]) == set()
    assert rank_overlap([["a", "b"], ["b", "c"], ["a"]]) == {"a", "b"}
    assert rank_overlap([["a", "a"], ["b"]]) == set()  # repeats within a rank are not overlap


def test_switch_lag_of_a_delayed_step_is_the_delay():
    from energon_ordering.inspect.diagnostics import switch_lag

    target = [0.1] * 10 + [0.6] * 20
    late = [0.1] * 13 + [0.6] * 17
    assert switch_lag(late, target) == pytest.approx(3)
    assert switch_lag(target, target) == 0
    early = [0.1] * 8 + [0.6] * 22
    assert switch_lag(early, target) == pytest.approx(-2)
    smeared = [0.1] * 10 + [0.1 + 0.5 * k / 10 for k in range(1, 11)] + [0.6] * 10
    assert switch_lag(smeared, target) == pytest.approx(4.5)
    with pytest.raises(ValueError, match="does not change"):
        switch_lag([0.1, 0.1], [0.1, 0.1])


def _stream(order, batch=4):
    return [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]


def test_shard_by_shard_stream_is_flagged_and_shuffled_is_not():
    import random

    from energon_ordering.inspect.diagnostics import detect_sawtooth, histogram_dispersion

    sources = ["web", "code", "books"]
    shard = 40  # samples per shard; shards of the three sources read one after the other
    unshuffled = [s for _ in range(20) for s in sources for _ in range(shard)]
    shuffled = unshuffled[:]
    random.Random(0).shuffle(shuffled)
    cycle = 3 * shard // 4  # one cycle of three shards, in micro-batches of 4
    flagged, ac = detect_sawtooth(_stream(unshuffled), sources, cycle)
    assert flagged and min(ac.values()) > 0.9
    flagged, ac = detect_sawtooth(_stream(shuffled), sources, cycle)
    assert not flagged and max(abs(v) for v in ac.values()) < 0.2
    assert histogram_dispersion(_stream(unshuffled), sources) > 3
    assert 0.7 < histogram_dispersion(_stream(shuffled), sources) < 1.3


def test_low_discrepancy_blend_has_low_dispersion():
    from energon_ordering.inspect.diagnostics import histogram_dispersion

    round_robin = ["a", "b", "a", "b"] * 100
    assert histogram_dispersion(_stream(round_robin), ["a", "b"]) == 0.0


def test_sources_by_step_groups_every_rank_and_micro_batch_of_a_step():
    from types import SimpleNamespace as B

    from energon_ordering.inspect.diagnostics import sources_by_step

    records = [[B(sources=("a", "a")), B(sources=("b",)), B(sources=("c",))],
               [B(sources=("x",)), B(sources=("y",)), B(sources=("z",)), B(sources=("w",))]]
    records = [[b.sources for b in rank] for rank in records]
    assert sources_by_step(records) == [["a", "a", "x"], ["b", "y"], ["c", "z"]]
    # two micro-batches per step: only whole steps that every rank ran
    assert sources_by_step(records, 2) == [["a", "a", "b", "x", "y"]]
    with pytest.raises(ValueError, match="micro_batches_per_step = 0"):
        sources_by_step(records, 0)


def test_dispersion_against_a_changing_target():
    import numpy as np

    from energon_ordering.inspect.diagnostics import histogram_dispersion

    # Exactly the target at every step: no dispersion against it, but a lot against the
    # overall share, which the change of the target inflates.
    groups = [["a"] * 8 + ["b"] * 2] * 10 + [["a"] * 2 + ["b"] * 8] * 10
    target = np.array([[0.8, 0.2]] * 10 + [[0.2, 0.8]] * 10)
    assert histogram_dispersion(groups, ["a", "b"], target) == 0.0
    assert histogram_dispersion(groups, ["a", "b"]) == pytest.approx(3.6)  # 9 / (10 * .25)
    # Independent draws from the target: about 1.
    rng = np.random.default_rng(0)
    drawn = [["a" if rng.random() < w[0] else "b" for _ in range(10)] for w in target for _ in range(50)]
    assert 0.8 < histogram_dispersion(drawn, ["a", "b"], np.repeat(target, 50, axis=0)) < 1.2
    with pytest.raises(ValueError, match=r"expected has shape \(1, 2\), need \(20, 2\)"):
        histogram_dispersion(groups, ["a", "b"], target[:1])


def test_histogram_errors():
    from energon_ordering.inspect.diagnostics import autocorrelation, source_histograms

    with pytest.raises(ValueError, match=r"source 'x', not in"):
        source_histograms([["x"]], ["a"])
    with pytest.raises(ValueError, match="lag 5"):
        autocorrelation([1, 2, 3], 5)
    assert autocorrelation([1, 1, 1, 1], 1) == 0.0


def test_periodic_low_discrepancy_blend_is_not_a_sawtooth():
    from energon_ordering.inspect.diagnostics import detect_sawtooth

    pattern = ["a", "a", "b", "a", "c"] * 200  # periodic but smoother than random draws
    flagged, ac = detect_sawtooth(_stream(pattern), ["a", "b", "c"], 5)
    assert max(ac.values()) > 0.9 and not flagged


# ---- warmup_counts over loader workers (issue 31) ---------------------------------------------

import itertools  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from energon_ordering import OrderingConfig, StateMismatchError  # noqa: E402
from energon_ordering.inspect.diagnostics import warmup_counts  # noqa: E402
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader  # noqa: E402
from energon_ordering.inspect.synthetic import SourceSpec  # noqa: E402
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

WARMUP = dict(start=256, full=2048, warmup_steps=6)
#: Energon's settings that store a worker checkpoint after every micro-batch.
EXACT = dict(checkpoint_every_sec=0, checkpoint_every_min_n_samples=1)


@pytest.fixture(scope="module")
def planned_data(tmp_path_factory) -> Path:
    meta = indexed_synthetic(tmp_path_factory.mktemp("counts"),
                             [SourceSpec("web", 320, "trimodal")], shard_size=32)
    return meta.parent / "web"


def _counts_after(data: Path, num_workers: int, micro_batches: int, packed: bool,
                  **loader_kwargs) -> tuple[dict[str, int], int]:
    """``warmup_counts`` of a planned loader (identical micro-batches for any num_workers)
    with the warmup after ``micro_batches``, and the samples it emitted."""
    cfg = OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                         length_sort_pool_holds="keys", micro_batches_per_step=2, seed=5,
                         plan_window_steps=2, seq_length_warmup=WARMUP,
                         pack_seq_length=2048 if packed else None)
    loader = build_train_loader(data, ordering=cfg, batch_size=2 if packed else 4,
                                num_workers=num_workers,
                                packing_buffer_size=32 if packed else None,
                                task_encoder_factory=IndexedSyntheticTaskEncoder,
                                **loader_kwargs)
    try:
        batches = list(itertools.islice(loader, micro_batches))
        return warmup_counts(loader.save_state_rank()), sum(len(b.keys) for b in batches)
    finally:
        close_loader(loader)


@pytest.mark.slow  # loader workers
@pytest.mark.parametrize("packed", [False, True])
def test_warmup_counts_do_not_depend_on_the_loader_workers(planned_data, packed):
    runs = {w: _counts_after(planned_data, w, 12, packed, **EXACT) for w in (0, 1, 2, 3)}
    counts, emitted = runs[0]
    assert counts, "the state holds no warmup counters (with packing: PlannedPackDataset's)"
    assert counts["seen"] == emitted and counts["truncated"] > 0
    for w, (other, emitted_w) in runs.items():
        assert (other, emitted_w) == (counts, emitted), f"{w} loader workers"


@pytest.mark.slow  # loader workers
def test_a_worker_checkpoint_that_lags_the_save_is_refused(planned_data):
    """Energon's default loader stores a worker checkpoint every 60 s: the state's counters
    missed every micro-batch after the first (4 samples seen of 48 with one worker)."""
    with pytest.raises(StateMismatchError, match=r"warmup_counts: loader worker 0's saved state "
                       r"is its checkpoint from 11 micro-batches before the save .* "
                       r"checkpoint_every_sec=0, checkpoint_every_min_n_samples=1\)") as info:
        _counts_after(planned_data, 1, 12, False)
    assert "\n" not in str(info.value)


def _record(*lengths: int, packs: tuple[tuple[int, ...], ...] = ()):
    from energon_ordering.inspect.rank_simulation import BatchRecord

    return BatchRecord(tuple(f"k{i}" for i in range(len(lengths))), tuple(lengths),
                       ("web",) * len(lengths), packs)


def test_measure_reports_idle_per_step_and_padding_by_tokens():
    """inspect's table (issue 32): idle per optimizer step beside per micro-batch, padding by
    tokens beside the mean of ratios, lost compute = idle per step + padding by tokens."""
    from energon_ordering.inspect.inspection import measure

    # each rank: one short and one long micro-batch, in opposite order: per micro-batch the
    # ranks wait, per step of 2 micro-batches they do not
    records = [[_record(100, 100), _record(300, 100)], [_record(300, 100), _record(100, 100)]]
    two = measure(records, period_batches=4, micro_batches_per_step=2)
    assert two.idle_per_step == 0.0
    assert two.straggler_idle == pytest.approx(straggler_idle([[[100, 100], [300, 100]],
                                                               [[300, 100], [100, 100]]]))
    assert two.straggler_idle > 0.1
    # padded 1,600 tokens for 1,200 real ones; the mean of the ratios (0, 1/3, 1/3, 0) is lower
    assert two.padding_by_tokens == pytest.approx(0.25)
    assert two.padding_waste == pytest.approx(1 / 6)
    assert two.lost_compute == pytest.approx(0.25)
    one = measure(records, period_batches=4, micro_batches_per_step=1)
    assert one.idle_per_step == pytest.approx(one.straggler_idle)
    assert one.lost_compute == pytest.approx(one.straggler_idle + 0.25)


def test_measure_pads_packs_to_the_longest_pack_by_tokens():
    from energon_ordering.inspect.inspection import measure

    # rank 0: packs of 300 and 100 tokens (padded to 300 each); rank 1: one pack of 400
    records = [[_record(200, 100, 100, packs=((200, 100), (100,)))],
               [_record(400, packs=((400,),))]]
    m = measure(records, period_batches=4)
    assert m.padding_by_tokens == pytest.approx(200 / 1000)
    assert m.padding_waste == pytest.approx((1 - 400 / 600) / 2)
    assert m.docs_per_pack == pytest.approx(4 / 3)
