"""Sequence packing with the length pool, the scheduled blend and the warmup, on real pipelines."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from megatron.energon import DefaultTaskEncoder, WorkerConfig, get_savable_loader, get_train_dataset, stateless

from energon_ordering import OrderingConfig, OrderingConfigError, OrderingTaskEncoder, StateMismatchError
from energon_ordering.errors import SampleLengthError, SeqLenOverflowError
from energon_ordering.inspect.diagnostics import (
    pack_source_summary,
    packing_efficiency,
    warmup_counts,
)
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, resume, run_with_cuts
from energon_ordering.inspect.synthetic_task import IMAGE_TOKEN_ID, SyntheticTaskEncoder
from energon_ordering.pool.ffd_pack import first_fit_decreasing
from energon_ordering.pool.order import POOL_ORDERS
from energon_ordering.pool.pack_order import cap_runs, cost_order, emission_batch, pack_cost, pack_order, run_seed
from energon_ordering.pool.pack_pool_sort import PackPoolSortDataset
from energon_ordering.pool.sequence_pack import SequencePack, pack_doc_lengths
from energon_ordering.warmup.pack_cap import PackCapDataset, pack_target
from energon_ordering.warmup.schedule import SeqLenWarmup

# ---- the pure parts ---------------------------------------------------------------------------


def _optimal_bins(lengths, capacity):
    """Fewest bins, by exhaustive search (small inputs only)."""
    best = len(lengths)

    def place(i, free):
        nonlocal best
        if len(free) >= best:
            return
        if i == len(lengths):
            best = len(free)
            return
        for b in range(len(free)):
            if lengths[i] <= free[b]:
                free[b] -= lengths[i]
                place(i + 1, free)
                free[b] += lengths[i]
        free.append(capacity - lengths[i])
        place(i + 1, free)
        free.pop()

    place(0, [])
    return best


def _ffd_reference(lengths, capacity):
    """FFD by its literal definition, for comparison."""
    bins = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b in bins:
            if sum(lengths[j] for j in b) + lengths[i] <= capacity:
                b.append(i)
                break
        else:
            bins.append([i])
    return bins


def test_first_fit_decreasing_against_brute_force():
    rng = random.Random(0)
    worse = 0
    for _ in range(300):
        n = rng.randint(1, 8)
        capacity = rng.choice([10, 16, 20])
        lengths = [rng.randint(1, capacity) for _ in range(n)]
        bins = first_fit_decreasing(lengths, capacity)
        assert sorted(i for b in bins for i in b) == list(range(n))  # each document once
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
        assert bins == _ffd_reference(lengths, capacity)
        opt = _optimal_bins(lengths, capacity)
        assert len(bins) <= 11 / 9 * opt + 6 / 9  # Dosa's tight FFD bound
        worse += len(bins) > opt
    assert worse < 30  # FFD is optimal on nearly all small inputs


def _ffd_reference_caps(lengths, caps):
    bins = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for k, b in enumerate(bins):
            if sum(lengths[j] for j in b) + lengths[i] <= caps[k]:
                b.append(i)
                break
        else:
            bins.append([i])
    return bins


def test_first_fit_decreasing_with_growing_per_pack_capacities():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 9)
        caps = sorted(rng.randint(8, 24) for _ in range(n))
        lengths = [rng.randint(1, 24) for _ in range(n)]
        bins = first_fit_decreasing(lengths, caps)
        assert bins == _ffd_reference_caps(lengths, caps)
        assert sorted(i for b in bins for i in b) == list(range(n))
        for k, b in enumerate(bins):  # within its own capacity, or a single over-long document
            assert sum(lengths[i] for i in b) <= caps[k] or len(b) == 1
    assert first_fit_decreasing([300, 300, 200, 100], [256, 300, 400, 500]) == [[0], [1], [2, 3]]
    with pytest.raises(ValueError, match=r"2 per-pack capacities for 3 documents"):
        first_fit_decreasing([1, 2, 3], [4, 5])
    with pytest.raises(ValueError, match=r"non-decreasing"):
        first_fit_decreasing([1, 2], [5, 4])


def test_first_fit_decreasing_edge_cases():
    assert first_fit_decreasing([], 8) == []
    assert first_fit_decreasing([9, 3, 5], 8) == [[0], [2, 1]]  # over-long: a pack of its own
    assert first_fit_decreasing([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]  # ties keep arrival order
    with pytest.raises(ValueError, match=r"capacity = 0 must be > 0"):
        first_fit_decreasing([1], 0)
    with pytest.raises(ValueError, match=r"lengths\[1\] = -2 must be >= 0"):
        first_fit_decreasing([1, -2], 8)


def test_pack_order_sorts_costs_and_is_rank_independent():
    packs = [[2000], [300, 300, 300, 300, 300, 300], [1000, 1000], [4000], [100]]
    costs = [pack_cost(p) for p in packs]
    assert costs[1] < costs[2] < costs[0] < costs[3]  # one long document costs more than many short
    assert pack_cost([4096]) == 2 * 4096
    for mode in ("sample", "batch"):
        order = pack_order(packs, 7, mode, 1)
        assert order == POOL_ORDERS[mode](costs, 7, 1)  # the pool order, on costs
        assert order == pack_order(packs, 7, mode, 1)
    ranked = POOL_ORDERS["batch"](costs, 7, len(packs))  # one chunk: sorted by cost
    assert ranked == sorted(range(len(packs)), key=costs.__getitem__)
    with pytest.raises(ValueError, match=r"mode = 'cost' is unknown"):
        pack_order(packs, 7, "cost", None)


def test_emission_batch():
    # a pool filled while micro-batch 5 is built, after 1 of its 2 packs; 2 loader workers
    assert [emission_batch(5, 1, q, 2, 2) for q in range(5)] == [5, 7, 7, 9, 9]
    assert [emission_batch(0, 0, q, 3, 0) for q in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    rng = random.Random(6)
    for _ in range(200):  # the next pool fills where this one ends and continues the positions
        b0, bs, nw, size = rng.randrange(50), rng.randint(1, 4), rng.randint(0, 3), rng.randint(1, 9)
        offset = rng.randrange(bs)
        b1, offset1 = emission_batch(b0, offset, size, bs, nw), (offset + size) % bs
        for q in range(12):
            assert emission_batch(b1, offset1, q, bs, nw) == emission_batch(b0, offset, size + q, bs, nw)


def test_cap_runs():
    assert cap_runs([]) == []
    assert cap_runs([512, 512, 512]) == [3]
    assert cap_runs([256, 256, 552, 552, 848, 2048]) == [2, 2, 1, 1]
    assert cap_runs([None, None]) == [2]


def test_pack_order_with_one_cap_is_the_uncapped_order():
    rng = random.Random(4)
    for mode in ("sample", "batch", "stratified"):
        for _ in range(20):
            n = rng.choice([4, 8, 12])
            packs = [[rng.randint(1, 2048) for _ in range(rng.randint(1, 6))] for _ in range(n)]
            seed = rng.getrandbits(64)
            assert pack_order(packs, seed, mode, 2, [2048] * n) == pack_order(packs, seed, mode, 2)
    assert run_seed(99, 0) == 99 and run_seed(99, 1) != run_seed(99, 2) != 99


def test_pack_order_keeps_every_pack_in_its_run_of_one_cap():
    rng = random.Random(5)
    for mode in ("sample", "batch"):
        for _ in range(50):
            runs = [rng.choice([2, 4, 6]) for _ in range(rng.randint(1, 5))]
            caps = [c for g, size in enumerate(runs) for c in [256 * (g + 1)] * size]
            costs = [rng.uniform(0, 9000) for _ in caps]
            order = cost_order(costs, 11, mode, 2, caps)
            assert sorted(order) == list(range(len(caps)))  # every pack once
            # the pack emitted at position q arrived in q's run: it was built to q's cap
            assert all(caps[i] == caps[q] for q, i in enumerate(order))
            start = 0
            for g, size in enumerate(runs):  # within a run: the pool order on that run's costs
                run = POOL_ORDERS[mode](costs[start : start + size], run_seed(11, g), 2)
                assert order[start : start + size] == [start + i for i in run]
                start += size
            assert order == cost_order(costs, 11, mode, 2, caps)  # a pure function of its inputs
    # a run sorts and permutes: the same costs in another arrival order give the same costs out
    costs = [5.0, 1.0, 4.0, 2.0, 3.0, 6.0]
    caps = [1, 1, 1, 1, 2, 2]
    a = [costs[i] for i in cost_order(costs, 3, "sample", 1, caps)]
    swapped = [costs[i] for i in (2, 3, 0, 1, 5, 4)]
    assert [swapped[i] for i in cost_order(swapped, 3, "sample", 1, caps)] == a
    with pytest.raises(ValueError, match=r"2 position caps for 3 packs"):
        cost_order([1.0, 2.0, 3.0], 0, "sample", 1, [1, 1])
    with pytest.raises(ValueError, match=r"mode = 'x' is unknown"):
        cost_order([1.0], 0, "x", 1, [1])


def test_pack_doc_lengths():
    pack = SequencePack(__key__="a,b", __restore_key__=(), samples=[None, None], lengths=[3, 5])
    assert pack_doc_lengths(pack) == [3, 5] and pack.total_len == 8
    assert pack_doc_lengths({"__key__": "p", "cu_lengths": torch.tensor([0, 4, 10])}) == [4, 6]
    with pytest.raises(SampleLengthError, match=r"pack 'q' \(dict\).*ordering_pack_lengths"):
        pack_doc_lengths({"__key__": "q", "tokens": [1]})


def test_pack_target():
    w = SeqLenWarmup(512, 2048, 2000)
    assert pack_target(0, 2048, w) == 512
    assert pack_target(1000, 1024, w) == 1024  # pack_seq_length is the ceiling
    assert pack_target(5000, 2048, w) == 2048
    assert pack_target(5000, None, w) == 2048 and pack_target(3, 4096, None) == 4096
    assert pack_target(3, None, None) is None


def test_config_packing_fields():
    cfg = OrderingConfig(packing_buffer_size=100, pack_seq_length=2048, pack_pool_placement="samples")
    assert OrderingConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(OrderingConfigError, match=r"pack_pool_placement = 'before' is unknown"):
        OrderingConfig(pack_pool_placement="before")
    with pytest.raises(OrderingConfigError, match=r"pack_seq_length = 0 must be >= 1"):
        OrderingConfig(pack_seq_length=0)
    with pytest.raises(TypeError, match=r"packing_buffer_size = '8' \(str\) must be an int"):
        OrderingConfig(packing_buffer_size="8")
    with pytest.raises(OrderingConfigError, match=r"'packs'.*pre-encode.*pack_pool_placement = 'samples'"):
        OrderingConfig(length_sort_pool_size=8, packing_buffer_size=8, length_sort_placement="pre-encode")


def test_pack_diagnostics():
    packs = [["web", "code"], ["web", "web", "curated"], ["code"], ["curated", "web"]]
    summary = pack_source_summary(packs, ["web", "code", "curated"])
    assert summary["share:web"] == pytest.approx(4 / 8) and summary["share:code"] == pytest.approx(2 / 8)
    assert summary["single_source_packs"] == 0.0  # every multi-document pack mixes sources
    assert summary["same_source_neighbours"] == pytest.approx(1 / 4)
    assert summary["expected_same_source_neighbours"] == pytest.approx(0.25 + 1 / 16 + 1 / 16)
    assert packing_efficiency([2048, 1024], [2048, 2048]) == 0.75
    with pytest.raises(ValueError, match=r"one target per pack"):
        packing_efficiency([1], [])
    with pytest.raises(ValueError, match=r"not in"):
        pack_source_summary([["books"]], ["web"])


class StatefulPackTE(SyntheticTaskEncoder):
    def select_samples_to_pack(self, samples):
        return [[s] for s in samples]

    def pack_selected_samples(self, samples):  # not @stateless
        return SequencePack(__key__=samples[0].__key__, __restore_key__=(), samples=samples,
                            lengths=[s.total_len for s in samples])


def test_pool_of_packs_needs_a_stateless_final_packer(small_dataset):
    from energon_ordering.errors import NotRestorableError

    with pytest.raises(NotRestorableError, match=r"pack_selected_samples\) is not marked stateless.*@stateless"):
        build_train_loader(small_dataset, ordering=_cfg(), batch_size=2, task_encoder_factory=StatefulPackTE)


# ---- real pipelines ---------------------------------------------------------------------------

WARMUP = dict(start=256, full=2048, warmup_steps=6)  # 12 micro-batches with 2 per step


def _cfg(placement="packs", *, pool=8, warmup=True, schedule=False, target=2048, **kw):
    mix = None
    if schedule:
        mix = {"phases": [{"until": 8, "weights": {"web": 0.6, "code": 0.3, "curated": 0.1}},
                          {"until": 40, "weights": {"web": 0.2, "code": 0.3, "curated": 0.5}}]}
    return OrderingConfig(
        length_sort_pool_size=pool, length_sort_mode="sample", micro_batches_per_step=2,
        seq_length_warmup=WARMUP if warmup else None, packing_buffer_size=16,
        pack_seq_length=target, pack_pool_placement=placement, mixture_schedule=mix,
        total_steps=40 if schedule else None, seed=3, **kw)


def _record(batch):
    return (tuple(batch.keys), batch.tokens.clone(), tuple(map(tuple, batch.pack_lengths)),
            tuple(map(tuple, batch.pack_sources)))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("placement", ["packs", "samples"])
@pytest.mark.parametrize("steep", [False, True])
def test_exact_resume_with_packing(three_sources, placement, num_workers, steep):
    if steep:  # a pool of packs spanning 6 steps of a warmup whose cap grows every step
        # 23 packs: the second pool fills inside micro-batch 11, after its first pack
        cfg = _steep_cfg(placement, pool=23, mixture_schedule=_cfg(schedule=True).mixture_schedule,
                         total_steps=40)
        total, cuts = 30, (0, 5, 12, 17)  # mid-pool, after a fill, mid-pool at the warmup's end
    else:
        cfg = _cfg(placement, schedule=True)
        total, cuts = 22, (0, 7, 13)  # inside the warmup (12 micro-batches), at and after its end

    def make():
        return build_train_loader(three_sources, ordering=cfg, num_workers=num_workers, batch_size=2)

    full, states = run_with_cuts(make, total, cuts, record=_record)
    for cut, state in states.items():
        resumed = resume(make, state, total - cut, record=_record)
        for b, (want, got) in enumerate(zip(full[cut:], resumed), start=cut):
            assert got[0] == want[0], f"cut {cut}: keys differ at micro-batch {b}"
            assert torch.equal(got[1], want[1]), f"cut {cut}: tokens differ at micro-batch {b}"
            assert got[2:] == want[2:], f"cut {cut}: packs differ at micro-batch {b}"


@pytest.mark.parametrize("placement", ["packs", "samples"])
def test_finite_epoch_on_three_ranks_loses_and_duplicates_nothing(small_dataset, placement):
    cfg = _cfg(placement, warmup=False, target=4096)
    keys = []
    for rank in range(3):
        loader = build_train_loader(small_dataset, ordering=cfg, rank=rank, world_size=3,
                                    batch_size=2, repeat=False)
        keys.append([k for b in loader for k in b.keys])
        close_loader(loader)
    flat = [k for r in keys for k in r]
    assert len(flat) == len(set(flat)) == 640
    assert set(flat) == {f"web-{i:08d}" for i in range(640)}


@pytest.mark.parametrize("placement", ["packs", "samples"])
def test_every_pack_fits_its_emission_cap_and_media_are_never_cut(small_dataset, placement):
    cfg = _cfg(placement, pool=8)
    warm = SeqLenWarmup(**WARMUP)
    loader = build_train_loader(small_dataset, ordering=cfg, batch_size=2)
    batches = list(itertools.islice(loader, 24))
    state = loader.save_state_rank()
    close_loader(loader)
    uncut = {}
    plain = build_train_loader(small_dataset, ordering=OrderingConfig(), batch_size=4, shuffle_buffer_size=None)
    for b in itertools.islice(plain, 160):
        for k, L, t in zip(b.keys, b.lengths, b.tokens):
            uncut[k] = t[:L]
    close_loader(plain)
    cut_docs = 0
    for index, batch in enumerate(batches):
        cap = pack_target(index // 2, 2048, warm)
        pos = 0
        for p, lengths in enumerate(batch.pack_lengths):
            assert sum(lengths) <= cap, f"micro-batch {index}: pack of {sum(lengths)} > cap {cap}"
            row, offset = batch.tokens[p], 0
            for L in lengths:
                doc, key = row[offset : offset + L], batch.keys[pos]
                assert (doc == IMAGE_TOKEN_ID).sum() == 64, "media tokens are never cut"
                if key in uncut:
                    assert torch.equal(doc, uncut[key][:L]), "text is cut from the end only"
                    cut_docs += L < len(uncut[key])
                offset += L
                pos += 1
    counts = warmup_counts(state)
    assert counts["truncated"] > 0 and counts["dropped"] == 0 and counts["kept_over_cap"] == 0
    assert cut_docs > 0
    efficiency = packing_efficiency(
        [sum(p) for b in batches[12:] for p in b.pack_lengths],
        [2048] * sum(len(b.pack_lengths) for b in batches[12:]))
    assert efficiency > 0.8


STEEP = dict(start=256, full=2048, warmup_steps=8)  # 16 micro-batches with 2 per step


def _steep_cfg(placement, pool=24, **kw):
    # a pool of 24 packs spans 12 micro-batches, 6 steps of a warmup whose cap grows each step
    return OrderingConfig(
        length_sort_pool_size=pool, length_sort_mode="sample", micro_batches_per_step=2,
        seq_length_warmup=STEEP, packing_buffer_size=32, pack_seq_length=2048,
        pack_pool_placement=placement, seed=3, **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("placement", "pool"), [("packs", 24), ("packs", 23), ("samples", 24)])
def test_packs_fill_the_cap_of_their_emission_step_during_a_steep_warmup(small_dataset, placement, pool,
                                                                       num_workers):
    # pool 23: a pool fills inside a micro-batch that already holds a pack of the last pool
    warm = SeqLenWarmup(**STEEP)
    loader = build_train_loader(small_dataset, ordering=_steep_cfg(placement, pool=pool), batch_size=2,
                                num_workers=num_workers)
    batches = list(itertools.islice(loader, 28))
    close_loader(loader)
    fills = []
    for index, batch in enumerate(batches):
        cap = pack_target(index // 2, 2048, warm)  # the cap of the step the pack is emitted in
        for lengths in batch.pack_lengths:
            assert sum(lengths) <= cap, f"micro-batch {index}: pack of {sum(lengths)} > cap {cap}"
            if index < 16:  # the warmup
                fills.append(sum(lengths) / cap)
    # packs are built to the cap of their emission step, not to an older, smaller one (a pool
    # of packs built at the fill step's cap measured 0.50 here)
    assert sum(fills) / len(fills) >= 0.9, sum(fills) / len(fills)
    assert min(fills) > 0.3


def test_one_cap_keeps_the_order_of_the_pool_of_packs(small_dataset):
    """A warmup whose cap never changes gives exactly the order without a warmup."""
    runs = []
    for warmup in (None, dict(start=2048, full=2048, warmup_steps=4)):
        cfg = OrderingConfig(length_sort_pool_size=12, length_sort_mode="sample", packing_buffer_size=16,
                             pack_seq_length=2048, seq_length_warmup=warmup, seed=3)
        loader = build_train_loader(small_dataset, ordering=cfg, batch_size=2)
        runs.append([_record(b) for b in itertools.islice(loader, 16)])
        close_loader(loader)
    for want, got in zip(*runs):
        assert got[0] == want[0] and torch.equal(got[1], want[1]) and got[2:] == want[2:]


def test_pool_of_packs_cap_arguments_are_checked(small_dataset):
    from energon_ordering.errors import OrderingTypeError

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    with pytest.raises(OrderingTypeError, match=r"batch_cap = 5 must be callable"):
        PackPoolSortDataset(None, pool_size=4, worker_config=wc, batch_size=2, batch_cap=5)
    with pytest.raises(OrderingConfigError, match=r"batch_cap needs batch_size.*batch_size=<micro-batch size>"):
        PackPoolSortDataset(None, pool_size=4, worker_config=wc, batch_cap=lambda b: 8)
    te = SyntheticTaskEncoder()
    te.ordering = _steep_cfg("packs", pool=8)
    node = get_train_dataset(small_dataset, batch_size=2, worker_config=wc, task_encoder=te,
                             shuffle_buffer_size=None, max_samples_per_sequence=16)
    while not isinstance(node, PackPoolSortDataset):
        node = node.dataset
    assert node.batch_cap is not None and "PackPoolSortDataset(" in str(node) and "capped=True" in str(node)
    while not isinstance(node, PackCapDataset):
        node = node.dataset
    assert node.emission_batches is not None  # the pool tells the packer where packs go
    assert [node.batch_target(b) for b in (0, 1, 2, 16, 99)] == [
        pack_target(s, 2048, SeqLenWarmup(**STEEP)) for s in (0, 0, 1, 8, 49)]
    with pytest.raises(OrderingTypeError, match=r"plan_emission: 3 must be callable"):
        node.plan_emission(3)


class UserPackTE(DefaultTaskEncoder):
    """An encoder with its own packing functions, recording what Energon hands them."""

    image_tokens = 64

    def __init__(self):
        super().__init__()
        self.selected: list[list[str]] = []
        self.packed: list[list[str]] = []

    encode_sample = SyntheticTaskEncoder.encode_sample
    media_tokens = SyntheticTaskEncoder.media_tokens

    def select_samples_to_pack(self, samples):
        self.selected.append([s.__key__ for s in samples])
        lengths = [s.total_len for s in samples]
        order = sorted(range(len(samples)), key=lambda i: lengths[i])
        return [[samples[i] for i in order[j : j + 3]] for j in range(0, len(order), 3)]

    @stateless
    def pack_selected_samples(self, samples):
        self.packed.append([s.__key__ for s in samples])
        return SequencePack(__key__="+".join(s.__key__ for s in samples), __restore_key__=(),
                            samples=list(samples), lengths=[s.total_len for s in samples])

    def batch(self, packs):
        return [p.__key__ for p in packs]


class OrderedUserPackTE(OrderingTaskEncoder, UserPackTE):  # the mixin first, as documented
    pass


def _run_user(te, path, n):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_train_dataset(path, batch_size=2, worker_config=wc, task_encoder=te,
                           shuffle_buffer_size=None, max_samples_per_sequence=16,
                           packing_buffer_size=12)
    loader = get_savable_loader(ds)
    out = [k for b in itertools.islice(loader, n) for k in b]
    close_loader(loader)
    return out


def test_the_users_packer_receives_what_energon_hands_it(small_dataset):
    plain = UserPackTE()
    plain_out = _run_user(plain, small_dataset, 30)
    te = OrderedUserPackTE()
    te.ordering = OrderingConfig(length_sort_pool_size=6, pack_pool_placement="packs", seed=1)
    out = _run_user(te, small_dataset, 20)
    n = min(len(plain.selected), len(te.selected))
    assert n >= 3
    # the pool of packs sits after packing: the packer sees exactly Energon's buffers
    assert te.selected[:n] == plain.selected[:n]
    assert te.packed[: 3 * n] == plain.packed[: 3 * n]
    built = ["+".join(p) for p in plain.packed]
    assert set(out) <= set(built)  # the same packs ...
    assert out != plain_out[: len(out)]  # ... in the pool's order
    # with the warmup its buffers are cut to the target first; it still packs them itself
    te = OrderedUserPackTE()
    te.ordering = OrderingConfig(seq_length_warmup={"start": 256, "full": 4096, "warmup_steps": 50},
                                 pack_seq_length=4096)
    _run_user(te, small_dataset, 4)
    assert te.selected and all(len(s) == 12 for s in te.selected[:2])
    assert te.packed


class TargetReadingTE(SyntheticTaskEncoder):
    """A user's packer that packs first-fit decreasing to ``ordering_pack_target()``."""

    calls: list[tuple[int, int]] = []

    def select_samples_to_pack(self, samples):
        target = self.ordering_pack_target()
        TargetReadingTE.calls.append((WorkerConfig.active_worker_config.active_worker_batch_index, target))
        lengths = [self.ordering_sample_length(s) for s in samples]
        return [[samples[i] for i in p] for p in first_fit_decreasing(lengths, target)]

    @stateless
    def pack_selected_samples(self, samples):
        return self.ordering_pack_selected_samples(samples)


def test_a_users_packer_under_the_pool_of_packs_gets_the_rounds_first_target(small_dataset):
    warm = SeqLenWarmup(**STEEP)
    TargetReadingTE.calls = []
    loader = build_train_loader(small_dataset, ordering=_steep_cfg("packs"), batch_size=2,
                                task_encoder_factory=TargetReadingTE)
    batches = list(itertools.islice(loader, 28))
    close_loader(loader)
    for index, batch in enumerate(batches):
        cap = pack_target(index // 2, 2048, warm)
        assert all(sum(p) <= cap for p in batch.pack_lengths), f"micro-batch {index} over cap {cap}"
    # a round packed while micro-batch b is built goes out later: its target is the cap of the
    # step its first pack is emitted in, at least the cap of b's step and larger for later rounds
    assert all(t >= pack_target(b // 2, 2048, warm) for b, t in TargetReadingTE.calls)
    assert any(t > pack_target(b // 2, 2048, warm) for b, t in TargetReadingTE.calls)


def test_default_packer_needs_a_target(small_dataset):
    with pytest.raises(OrderingConfigError, match=r"default first-fit-decreasing packer.*pack_seq_length"):
        build_train_loader(small_dataset, ordering=OrderingConfig(length_sort_pool_size=8, packing_buffer_size=8))


def test_packing_buffer_size_given_twice_must_agree(small_dataset):
    te = SyntheticTaskEncoder()
    te.ordering = OrderingConfig(packing_buffer_size=8, pack_seq_length=2048)
    with pytest.raises(OrderingConfigError, match=r"packing_buffer_size = 8 contradicts.*packing_buffer_size=16"):
        get_train_dataset(small_dataset, batch_size=2, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                          task_encoder=te, packing_buffer_size=16, shuffle_buffer_size=None,
                          max_samples_per_sequence=16)


def test_restoring_with_another_pack_target_raises(small_dataset):
    loader = build_train_loader(small_dataset, ordering=_cfg(), batch_size=2)
    next(iter(loader))
    state = loader.save_state_rank()
    close_loader(loader)
    loader = build_train_loader(small_dataset, ordering=_cfg(target=4096), batch_size=2)
    # the pipeline's stamp (checked first, on top) names it; PackCapDataset's own stamp too
    with pytest.raises(StateMismatchError, match=r"PipelineStampDataset.*pack_seq_length: saved 2048 != configured 4096"):
        loader.restore_state_rank(state)
    close_loader(loader)


def test_packs_mix_sources_in_the_scheduled_proportions(three_sources):
    cfg = _cfg(warmup=False, schedule=True, target=4096, pool=8)
    loader = build_train_loader(three_sources, ordering=cfg, batch_size=2)
    batches = list(itertools.islice(loader, 16))  # steps 0..7: the first phase
    close_loader(loader)
    packs = [list(s) for b in batches for s in b.pack_sources]
    summary = pack_source_summary(packs, ["web", "code", "curated"])
    assert abs(summary["share:web"] - 0.6) < 0.12 and abs(summary["share:code"] - 0.3) < 0.12
    # not neighbours from one shard: about as mixed as independent draws
    assert summary["single_source_packs"] < summary["expected_single_source"] + 0.2
    # (FFD groups similar lengths, so same-SOURCE neighbours follow the length profiles; what
    # must not happen is consecutive samples of one shard sitting next to each other)
    consecutive = total = 0
    for b in batches:
        pos = 0
        for lengths in b.pack_lengths:
            keys = b.keys[pos : pos + len(lengths)]
            pos += len(lengths)
            for x, y in zip(keys, keys[1:]):
                (sx, ix), (sy, iy) = x.rsplit("-", 1), y.rsplit("-", 1)
                total += 1
                consecutive += sx == sy and abs(int(ix) - int(iy)) == 1
    assert total > 20 and consecutive / total < 0.1


def test_pack_pool_is_in_the_pipeline(small_dataset):
    te = SyntheticTaskEncoder()
    te.ordering = _cfg("packs")
    ds = get_train_dataset(small_dataset, batch_size=2, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                           task_encoder=te, shuffle_buffer_size=None, max_samples_per_sequence=16)
    chain, node = [], ds
    while True:
        chain.append(type(node).__name__)
        if not hasattr(node, "dataset"):
            break
        node = node.dataset
    i = chain.index("PackPoolSortDataset")
    assert chain[i : i + 3] == ["PackPoolSortDataset", "FinitePackingDataset", "PackCapDataset"]
    assert "LengthPoolSortDataset" not in chain and "SeqLenWarmupDataset" not in chain
    te.ordering = _cfg("samples")
    ds = get_train_dataset(small_dataset, batch_size=2, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                           task_encoder=te, shuffle_buffer_size=None, max_samples_per_sequence=16)
    assert "PackingDataset(" in str(ds) and "LengthPoolSortDataset(" in str(ds) and "PackPoolSortDataset(" not in str(ds)
    assert isinstance(PackPoolSortDataset, type) and isinstance(PackCapDataset, type)


class BigImages(SyntheticTaskEncoder):
    def __init__(self):
        super().__init__(image_tokens=300)  # more media tokens than the first pack targets (256..)


class SomeBigImages(SyntheticTaskEncoder):
    def media_tokens(self, sample):  # every third sample has a 300-token image
        return 300 if int(sample.__key__.rsplit("-", 1)[1]) % 3 == 0 else 64


@pytest.mark.parametrize("overflow", ["keep", "drop", "error"])
def test_overflow_policy_with_packing(small_dataset, overflow):
    cfg = OrderingConfig(
        micro_batches_per_step=2, seq_length_warmup=WARMUP, seq_length_overflow=overflow,
        packing_buffer_size=16, pack_seq_length=2048)
    te = SomeBigImages if overflow == "drop" else BigImages
    loader = build_train_loader(small_dataset, ordering=cfg, batch_size=2, task_encoder_factory=te)
    if overflow == "error":
        with pytest.raises(SeqLenOverflowError, match=r"300 media tokens, more than the pack target of 256 tokens at step 0"):
            next(iter(loader))
        close_loader(loader)
        return
    batches = list(itertools.islice(loader, 4))
    state = loader.save_state_rank()
    close_loader(loader)
    counts = warmup_counts(state)
    if overflow == "keep":
        assert counts["kept_over_cap"] > 0 and counts["dropped"] == 0
        # an over-long document (media alone above the target) is packed alone, uncut
        assert all(len(p) == 1 and p[0] >= 300 for b in batches for p in b.pack_lengths)
        assert all((b.tokens == IMAGE_TOKEN_ID).sum() == 300 * len(b.keys) for b in batches)
    else:
        assert counts["dropped"] > 0 and counts["kept_over_cap"] == 0
        for index, b in enumerate(batches):  # nothing above the target was packed
            assert all(sum(p) <= pack_target(index // 2, 2048, SeqLenWarmup(**WARMUP)) for p in b.pack_lengths)
            assert all(int(k.rsplit("-", 1)[1]) % 3 for k in b.keys)  # the big images were dropped


def test_dropping_every_sample_raises_instead_of_looping(small_dataset):
    cfg = OrderingConfig(micro_batches_per_step=2, seq_length_warmup=WARMUP, seq_length_overflow="drop",
                         packing_buffer_size=16, pack_seq_length=2048)
    loader = build_train_loader(small_dataset, ordering=cfg, batch_size=2, task_encoder_factory=BigImages)
    with pytest.raises(SeqLenOverflowError, match=r"1000 samples in a row were dropped at step 0"):
        next(iter(loader))
    close_loader(loader)


@pytest.mark.slow  # 8 real rank pipelines
def test_pool_of_packs_aligns_the_ranks_pack_costs(small_dataset):
    from energon_ordering.inspect.diagnostics import straggler_idle
    from energon_ordering.inspect.rank_simulation import lengths_by_step, run_ranks

    base = dict(packing_buffer_size=32, pack_seq_length=4096, seed=5)
    idle = {}
    for name, cfg in (("off", OrderingConfig(**base)),
                      ("packs", OrderingConfig(**base, length_sort_pool_size=24))):
        records = run_ranks(small_dataset, ordering=cfg, world_size=4, steps=24, batch_size=1)
        idle[name] = straggler_idle(lengths_by_step(records))
    assert idle["packs"] < 0.6 * idle["off"], idle
