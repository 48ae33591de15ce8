"""The pool ramp: a worker's first pools are smaller (1,000, 10,000, ... up to the pool size).

Pure sizes first, then the config, then real pre-encode pipelines: the first ramped pool is
exactly a 1,000-sample pool, a resume inside the ramp is exact, and a state written with another
ramp setting or by the pool logic before the ramp is refused."""

from __future__ import annotations

import dataclasses

import pytest

from energon_ordering import OrderingConfig, StateMismatchError
from energon_ordering.errors import OrderingConfigError, OrderingTypeError
from energon_ordering.inspect.pool_memory import find_stage
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, resume, run_with_cuts
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
from energon_ordering.length_index.build import build_length_index
from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset
from energon_ordering.pool.ramp import RAMP_FIRST, RAMP_MIN_POOL, pool_size_at, ramp_sizes
from energon_ordering.pool.settings import PoolSettings


# ---- pure sizes -------------------------------------------------------------------------------

def test_ramp_sizes_grow_tenfold_to_the_pool_size():
    assert ramp_sizes(100_000, ramp=True) == [1_000, 10_000, 100_000]
    assert ramp_sizes(1_000_000, ramp=True) == [1_000, 10_000, 100_000, 1_000_000]
    assert ramp_sizes(20_000, ramp=True) == [1_000, 10_000, 20_000]
    assert [pool_size_at(k, 100_000, ramp=True) for k in range(6)] == [
        1_000, 10_000, 100_000, 100_000, 100_000, 100_000]


def test_ramp_off_or_small_pools_keep_one_size():
    assert [pool_size_at(k, 100_000, ramp=False) for k in range(4)] == [100_000] * 4
    assert [pool_size_at(k, 600, ramp=True) for k in range(3)] == [600] * 3
    assert pool_size_at(10**6, 100_000, ramp=True) == 100_000  # no overflow, no slow loop


@pytest.mark.parametrize("batch_size", [3, 4, 7, 64])
def test_ramped_sizes_are_whole_micro_batches(batch_size):
    pool = 5_000 * batch_size  # a multiple of the micro-batch, as batch mode requires
    sizes = ramp_sizes(pool, ramp=True, batch_size=batch_size)
    assert all(s % batch_size == 0 for s in sizes), sizes
    assert sizes[0] >= RAMP_FIRST and sizes[-1] == pool
    assert sizes == sorted(sizes)


def test_pool_settings_size_at_and_stamp():
    on = PoolSettings("t", 100_000, "batch", 4, 0, ramp=True)
    off = PoolSettings("t", 100_000, "batch", 4, 0)
    assert [on.size_at(k) for k in range(3)] == [1_000, 10_000, 100_000]
    assert [off.size_at(k) for k in range(3)] == [100_000] * 3
    assert on.stamp(3)["ramp"] != off.stamp(3)["ramp"] is None
    with pytest.raises(OrderingTypeError, match=r"ramp = 'yes' \(str\) must be True or False"):
        PoolSettings("t", 100_000, "batch", 4, 0, ramp="yes")


# ---- config -----------------------------------------------------------------------------------

def test_config_ramps_large_pools_by_default():
    assert OrderingConfig(length_sort_pool_size=RAMP_MIN_POOL).length_sort_ramp_on
    assert not OrderingConfig(length_sort_pool_size=RAMP_MIN_POOL - 1).length_sort_ramp_on
    assert not OrderingConfig(length_sort_pool_size=100_000,
                              length_sort_pool_ramp=False).length_sort_ramp_on
    assert OrderingConfig(length_sort_pool_size=2_000, length_sort_pool_ramp=True).length_sort_ramp_on
    assert not OrderingConfig(length_sort_pool_ramp=True).length_sort_ramp_on  # pool off


def test_config_refuses_a_bad_ramp(tmp_path):
    with pytest.raises(OrderingTypeError, match=r"length_sort_pool_ramp = 'on' \(str\) must be true, "
                                                r"false or null"):
        OrderingConfig(length_sort_pool_size=100_000, length_sort_pool_ramp="on")
    with pytest.raises(OrderingConfigError, match=r"length_sort_pool_ramp = true, but the pool of "
                                                  r"packs .* does not ramp"):
        OrderingConfig(length_sort_pool_size=100, length_sort_pool_ramp=True,
                       packing_buffer_size=64, pack_pool_placement="packs")


def test_recipe_yaml_sets_the_ramp(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("length_sort_pool_size: 100000\nlength_sort_pool_ramp: false\n"
                      "placement: pre-encode\nlength_sort_pool_holds: keys\n")
    cfg = OrderingConfig.from_yaml(recipe)
    assert cfg.length_sort_pool_ramp is False and not cfg.length_sort_ramp_on


# ---- real pipelines ---------------------------------------------------------------------------

POOL = 2 * RAMP_FIRST  # ramped pools: 1,000 then 2,000
FIRST_BATCHES = RAMP_FIRST // 4


@pytest.fixture(scope="module")
def ramp_dataset(tmp_path_factory):
    """2,400 trimodal samples with a length index: room for a 1,000 and a 2,000 pool."""
    root = tmp_path_factory.mktemp("ramp")
    make_synthetic_dataset(root, [SourceSpec("web", 2_400, "trimodal")], shard_size=64)
    build_length_index(root / "web", task_encoder=IndexedSyntheticTaskEncoder())
    return root / "web"


def _cfg(pool, ramp, holds="keys", seed=3):
    return OrderingConfig(length_sort_pool_size=pool, length_sort_mode="batch", seed=seed,
                          length_sort_placement="pre-encode", length_sort_pool_holds=holds,
                          length_sort_pool_ramp=ramp)


def _make(path, cfg):
    def make():
        return build_train_loader(path, ordering=cfg, batch_size=4,
                                  task_encoder_factory=IndexedSyntheticTaskEncoder)

    return make


def test_first_ramped_pool_is_exactly_a_first_pool_of_1000(ramp_dataset):
    # Pool 0 of a ramped 2,000 pool has the size, seed and arrivals of pool 0 of a 1,000 pool.
    ramped = run_with_cuts(_make(ramp_dataset, _cfg(POOL, True)), FIRST_BATCHES + 2, ())[0]
    small = run_with_cuts(_make(ramp_dataset, _cfg(RAMP_FIRST, False)), FIRST_BATCHES + 2, ())[0]
    full = run_with_cuts(_make(ramp_dataset, _cfg(POOL, False)), FIRST_BATCHES, ())[0]
    assert ramped[:FIRST_BATCHES] == small[:FIRST_BATCHES]
    assert ramped[:FIRST_BATCHES] != full  # without the ramp the first pool is 2,000 samples
    # the next pool is the second ramp size (2,000), not a second pool of 1,000
    assert ramped[FIRST_BATCHES:] != small[FIRST_BATCHES:]


@pytest.mark.slow
@pytest.mark.parametrize("holds", ["keys", "raw"])
def test_resume_inside_the_ramp_is_exact(ramp_dataset, holds):
    total, cuts = FIRST_BATCHES + 60, (37, FIRST_BATCHES + 20)
    make = _make(ramp_dataset, _cfg(POOL, True, holds))
    full, states = run_with_cuts(make, total, cuts)
    for cut, state in states.items():
        assert resume(make, state, total - cut) == full[cut:], f"cut {cut}"


def test_ramp_is_stamped_and_old_pool_states_are_refused(ramp_dataset):
    loader = _make(ramp_dataset, _cfg(POOL, True))()
    assert find_stage(loader.dataset, KeyPoolSortDataset).settings.ramp
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    del it
    close_loader(loader)
    other = _make(ramp_dataset, _cfg(POOL, False))()
    with pytest.raises(StateMismatchError, match=r"ramp: saved .*1000.* != configured None"):
        other.restore_state_rank(state)
        next(iter(other))
    close_loader(other)
    # A state written before the ramp existed (pool state version 2, no ramp field).
    _rewrite_pool_stamps(state, lambda s: {k: v for k, v in {**s, "state_version": 2}.items()
                                           if k != "ramp"})
    again = _make(ramp_dataset, _cfg(POOL, True))()
    with pytest.raises(StateMismatchError, match=r"state_version: saved 2 != configured 3"):
        again.restore_state_rank(state)
        next(iter(again))
    close_loader(again)


def _rewrite_pool_stamps(obj, fn):
    """Replaces, in place, every pool stamp (a dict with ``order_version``) inside a state."""
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            if k == "_stamp" and isinstance(v, dict) and "order_version" in v:
                obj[k] = fn(v)
            else:
                _rewrite_pool_stamps(v, fn)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _rewrite_pool_stamps(v, fn)
    elif dataclasses.is_dataclass(obj):
        for field in dataclasses.fields(obj):
            _rewrite_pool_stamps(getattr(obj, field.name), fn)
