"""``allow_global_batch_change`` (planned order, issue 23): a resume that changes the global batch
(micro-batches per step, ranks or the micro-batch size) continues the global order from a plan
window boundary, exactly; without the setting, or inside a window, it is refused by name.

Real prepared datasets with length indexes, real rank pipelines (``WorkerConfig(rank=r,
world_size=R)``); the reference is each source's permutation (``planned.cursor.draws``).
"""

from __future__ import annotations

import itertools
import pickle
from pathlib import Path

import pytest
from megatron.energon import WorkerConfig, load_dataset

from energon_ordering import OrderingConfig
from energon_ordering.errors import OrderingConfigError, StateMismatchError
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, record_batch
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.planned.cursor import draws
from energon_ordering.pool.byte_range_reader import ByteRangeReader
from energon_ordering.state_stamp import restore_state_rank
import sys

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

K = 2  # plan_window_steps
SEED = 7
SOURCES = {"web": 400, "code": 240}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return indexed_synthetic(
        tmp_path_factory.mktemp("batch_change"),
        [SourceSpec("web", SOURCES["web"], "short", weight=0.6),
         SourceSpec("code", SOURCES["code"], "long", weight=0.4)], shard_size=40)


def _cfg(mbps: int, allow: bool = True) -> OrderingConfig:
    return OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                          length_sort_pool_holds="keys", micro_batches_per_step=mbps, seed=SEED,
                          plan_window_steps=K, allow_global_batch_change=allow,
                          planned_mix="step")


def _loader(data, shape, rank, *, allow=True, repeat=False):
    R, M, B = shape
    return build_train_loader(data, ordering=_cfg(M, allow), rank=rank, world_size=R,
                              batch_size=B, repeat=repeat,
                              task_encoder_factory=IndexedSyntheticTaskEncoder)


def _take(loader, n):
    """``n`` micro-batches (None: to the end) and the state after them."""
    it = iter(loader)
    got = [record_batch(b) for b in (it if n is None else itertools.islice(it, n))]
    state = pickle.dumps(loader.save_state_rank())
    del it
    close_loader(loader)
    return got, state


def _permutation_keys(data: Path) -> dict[str, list[str]]:
    """Each source's keys in the order of its epoch-0 permutation (the plan's draw order)."""
    out = {}
    for s, name in enumerate(SOURCES):
        folder = data.parent / name
        factory = load_dataset(folder).get_datasets(
            training=True, split_part="train",
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0)).datasets[0].dataset
        reader = ByteRangeReader(folder, [(x.name, x.count) for x in factory.shards])
        order = draws(SEED, s, len(reader), 0, len(reader))
        out[name] = [reader.key(int(i)) for i in order]
    return out


@pytest.mark.parametrize("before,after", [
    ((2, 2, 4), (2, 3, 4)),  # 16 -> 24 samples per step (more micro-batches)
    ((2, 3, 4), (3, 1, 4)),  # 24 -> 12 (fewer ranks and micro-batches)
    ((2, 2, 4), (2, 2, 2)),  # 16 -> 8 (a smaller micro-batch)
], ids=["16-to-24", "24-to-12", "micro-batch-4-to-2"])
def test_a_finite_epoch_continues_with_the_new_global_batch(data, before, after):
    cut = 2 * K  # optimizer step 4: a window boundary
    first = []
    for rank in range(before[0]):
        got, state = _take(_loader(data, before, rank), cut * before[1])
        first += [k for b in got for k in b.keys]
        if rank == 0:
            saved = state
    rest, lengths = [], set()
    for rank in range(after[0]):
        loader = _loader(data, after, rank)
        restore_state_rank(loader, pickle.loads(saved))  # rank 0's file only
        got, _ = _take(loader, None)
        rest += [k for b in got for k in b.keys]
        lengths.add(len(got))
        assert all(len(b.keys) == after[2] for b in got)
    assert len(lengths) == 1, "the ranks stopped at different steps"
    assert lengths.pop() % after[1] == 0, "the epoch ended inside an optimizer step"
    used = first + rest
    assert len(used) == len(set(used)), "a sample was drawn twice"
    # every source's samples are a prefix of its permutation: nothing skipped, in draw order
    for name, keys in _permutation_keys(data).items():
        mine = [k for k in used if k in set(keys)]
        assert set(mine) == set(keys[: len(mine)]), f"{name}: a sample was skipped"
    assert len(rest) >= 2 * after[0] * after[1] * after[2]  # steps ran after the change


def test_the_new_steps_hold_the_mix_of_the_new_global_batch(data):
    before, after, cut = (2, 2, 4), (2, 3, 4), 2 * K
    _, saved = _take(_loader(data, before, 0, repeat=True), cut * before[1])
    records = []
    for rank in range(after[0]):
        loader = _loader(data, after, rank, repeat=True)
        restore_state_rank(loader, pickle.loads(saved))
        records.append(_take(loader, 4 * K * after[1])[0])
    G2 = after[0] * after[1] * after[2]
    web = []
    for step in range(4 * K):
        keys = [k for r in records for b in r[step * after[1]:(step + 1) * after[1]] for k in b.keys]
        assert len(keys) == G2
        web.append(sum(k.startswith("web") for k in keys))
    assert all(abs(n - 0.6 * G2) < 1 for n in web), web


def test_exact_resume_after_the_change_is_exact(data):
    """A state saved after a global batch change resumes exactly: the change is in the state."""
    before, after, cut = (2, 2, 4), (2, 3, 4), 2 * K
    _, saved = _take(_loader(data, before, 0, repeat=True), cut * before[1])
    for rank in range(after[0]):
        loader = _loader(data, after, rank, repeat=True)
        restore_state_rank(loader, pickle.loads(saved))
        whole, _ = _take(loader, 5 * after[1] + 1)
        loader = _loader(data, after, rank, repeat=True)
        restore_state_rank(loader, pickle.loads(saved))
        head, mid = _take(loader, 3 * after[1] + 1)  # inside an optimizer step, mid-window
        loader = _loader(data, after, rank, repeat=True)
        restore_state_rank(loader, pickle.loads(mid))
        tail, _ = _take(loader, 2 * after[1])
        assert head + tail == whole


def test_without_the_setting_the_change_is_refused(data):
    _, saved = _take(_loader(data, (2, 2, 4), 0, repeat=True), 2 * K * 2)
    loader = _loader(data, (2, 3, 4), 0, allow=False, repeat=True)
    with pytest.raises(StateMismatchError, match=r"global batch changes.*allow_global_batch_change"):
        restore_state_rank(loader, pickle.loads(saved))
    close_loader(loader)


def test_a_change_inside_a_window_is_refused(data):
    _, saved = _take(_loader(data, (2, 2, 4), 0, repeat=True), 3 * 2)  # step 3: mid-window
    loader = _loader(data, (2, 3, 4), 0, repeat=True)
    with pytest.raises(StateMismatchError, match=r"inside plan window 1 \(steps 2-3\).*multiple "
                                                 r"of plan_window_steps = 2"):
        restore_state_rank(loader, pickle.loads(saved))
    close_loader(loader)


def test_the_setting_is_planned_only():
    with pytest.raises(OrderingConfigError, match="allow_global_batch_change = true applies to "
                                                  "length_sort_mode = 'planned' only"):
        OrderingConfig(length_sort_pool_size=8, length_sort_mode="batch",
                       allow_global_batch_change=True)
    assert OrderingConfig.from_dict({**_cfg(2).to_dict()}).allow_global_batch_change


def test_the_next_finite_epoch_ends_as_the_new_global_batch_alone_ends_it(data):
    """The epoch after the one a change happened in has no history: it ends where the new
    global batch alone ends it, as in a loader started with it (its end was kept from the
    changed epoch before)."""
    before, after = (2, 2, 4), (2, 3, 4)
    _, saved = _take(_loader(data, before, 0), 2 * K * before[1])
    loader = _loader(data, after, 0)
    restore_state_rank(loader, pickle.loads(saved))
    sum(1 for _ in loader)  # the rest of the changed epoch
    next_epoch = [record_batch(b) for b in loader]
    close_loader(loader)
    fresh, _ = _take(_loader(data, after, 0), None)
    assert len(next_epoch) == len(fresh) > 0
