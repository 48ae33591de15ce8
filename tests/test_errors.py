"""Every user error is raised with a message naming the field, the value and the fix."""

from __future__ import annotations


import pytest
from megatron.energon import CaptioningSample, DefaultTaskEncoder, WorkerConfig, get_train_dataset, stateless

from energon_ordering import (
    LengthPoolSortDataset,
    NotRestorableError,
    OrderingConfig,
    OrderingConfigError,
    OrderingTaskEncoder,
    OrderingTypeError,
    SampleLengthError,
    StateMismatchError,
)
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, run_with_cuts
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder


def _encoded(path, wc):
    te = SyntheticTaskEncoder()
    return te.build_encode_sample(
        get_train_dataset(path, batch_size=None, worker_config=wc, task_encoder=DefaultTaskEncoder(),
                          shuffle_buffer_size=None, max_samples_per_sequence=None),
        worker_config=wc,
    )


@pytest.fixture
def encoded(small_dataset):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    return _encoded(small_dataset, wc), wc


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(pool_size=0), OrderingConfigError, r"pool_size = 0 must be >= 1"),
        (dict(pool_size=-3), OrderingConfigError, r"pool_size = -3"),
        (dict(pool_size="64"), OrderingTypeError, r"pool_size = '64' \(str\) must be an int"),
        (dict(pool_size=6.5), OrderingTypeError, r"pool_size = 6.5 \(float\)"),
        (dict(pool_size=True), OrderingTypeError, r"pool_size = True \(bool\)"),
        (dict(pool_size=8, mode="bucket"), OrderingConfigError, r"mode = 'bucket' is unknown.*'batch', 'sample'"),
        (dict(pool_size=8, mode="batch"), OrderingConfigError, r"mode = 'batch' needs batch_size"),
        (dict(pool_size=10, mode="batch", batch_size=4), OrderingConfigError,
         r"pool_size = 10 is not a multiple of batch_size = 4.*use pool_size = 8"),
        (dict(pool_size=8, batch_size=0), OrderingConfigError, r"batch_size = 0 must be >= 1"),
        (dict(pool_size=8, seed="x"), OrderingTypeError, r"seed = 'x'"),
        (dict(pool_size=8, key_fn=5), OrderingTypeError, r"key_fn = 5 is not callable"),
    ],
)
def test_constructor_rejects_bad_arguments(encoded, kwargs, exc, match):
    ds, wc = encoded
    with pytest.raises(exc, match=match):
        LengthPoolSortDataset(ds, worker_config=wc, **kwargs)


def test_errors_are_also_builtin_types(encoded):
    ds, wc = encoded
    with pytest.raises(ValueError):
        LengthPoolSortDataset(ds, pool_size=0, worker_config=wc)
    with pytest.raises(TypeError):
        LengthPoolSortDataset(ds, pool_size="1", worker_config=wc)


class StatefulEncoder(OrderingTaskEncoder, DefaultTaskEncoder):
    # Not marked @stateless: its samples cannot be re-created from restore keys.
    def encode_sample(self, sample):
        return sample


def test_non_stateless_encoder_is_refused_when_the_pipeline_is_built(small_dataset):
    te = StatefulEncoder()
    te.ordering = OrderingConfig(length_sort_pool_size=16)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    with pytest.raises(NotRestorableError, match=r"encode_sample.*not marked stateless.*@stateless"):
        get_train_dataset(small_dataset, batch_size=4, worker_config=wc, task_encoder=te,
                          shuffle_buffer_size=8, max_samples_per_sequence=8)
    # Without the pool the same encoder is fine (Energon's own rules apply).
    te.ordering = OrderingConfig()
    get_train_dataset(small_dataset, batch_size=4, worker_config=wc, task_encoder=te,
                      shuffle_buffer_size=8, max_samples_per_sequence=8)


class NoLengthEncoder(OrderingTaskEncoder, DefaultTaskEncoder):
    @stateless
    def encode_sample(self, sample: CaptioningSample) -> CaptioningSample:
        return sample

    @stateless
    def batch(self, samples):
        return samples


def test_sample_without_length_names_the_key_and_the_fix(small_dataset):
    te = NoLengthEncoder()
    te.ordering = OrderingConfig(length_sort_pool_size=4)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_train_dataset(small_dataset, batch_size=2, worker_config=wc, task_encoder=te,
                           shuffle_buffer_size=None, max_samples_per_sequence=None)
    from megatron.energon import get_savable_loader

    loader = get_savable_loader(ds)
    with pytest.raises(SampleLengthError, match=r"sample 'web-\d{8}'.*neither `total_len` nor `tokens`.*key_fn"):
        next(iter(loader))


class _PlainTokens:
    """A user's encoded type that is neither an Energon Sample nor a dict: no restore key."""

    def __init__(self, sample):
        self.__key__, self.total_len = sample.__key__, sample.total_len


class PlainTypeEncoder(SyntheticTaskEncoder):
    @stateless
    def encode_sample(self, sample):
        return _PlainTokens(super().encode_sample(sample))

    @stateless
    def batch(self, samples):
        return {"__keys__": [s.__key__ for s in samples], "total_len": [s.total_len for s in samples]}

    def encode_batch(self, batch):
        return batch


def test_a_pooled_sample_without_restore_key_is_refused_when_pooled(small_dataset):
    """Before: the pool saved None for such a sample and the restore failed with a bare
    TypeError, hours later. Now the first pooled sample names its type and the fix."""
    cfg = OrderingConfig(length_sort_pool_size=8, length_sort_mode="batch")
    loader = build_train_loader(small_dataset, ordering=cfg, task_encoder_factory=PlainTypeEncoder)
    with pytest.raises(NotRestorableError, match=r"LengthPoolSortDataset: sample 'web-\d{8}' "
                       r"\(_PlainTokens\) has no __restore_key__.*derive_from"):
        next(iter(loader))
    close_loader(loader)


class LengthFromCaption(NoLengthEncoder):
    def ordering_sample_length(self, sample):
        return len(sample.caption.split())


def test_custom_length_via_task_encoder_override(small_dataset):
    te = LengthFromCaption()
    te.ordering = OrderingConfig(length_sort_pool_size=8, length_sort_mode="batch")
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = get_train_dataset(small_dataset, batch_size=2, worker_config=wc, task_encoder=te,
                           shuffle_buffer_size=None, max_samples_per_sequence=None)
    from megatron.energon import get_savable_loader

    batch = next(iter(get_savable_loader(ds)))
    lengths = [len(s.caption.split()) for s in batch]
    assert lengths == sorted(lengths)


def test_non_numeric_length_is_refused(encoded):
    ds, wc = encoded
    pool = LengthPoolSortDataset(ds, pool_size=4, worker_config=wc, key_fn=lambda s: "long")
    from megatron.energon import get_savable_loader

    with pytest.raises(SampleLengthError, match=r"key_fn returned 'long' for sample 'web-"):
        next(iter(get_savable_loader(pool)))


def test_packing_and_grouping_are_refused(small_dataset):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    te = SyntheticTaskEncoder()
    te.ordering = OrderingConfig(length_sort_pool_size=16)
    with pytest.raises(OrderingConfigError, match=r"packing \(packing_buffer_size = 32\)"):
        get_train_dataset(small_dataset, batch_size=4, worker_config=wc, task_encoder=te,
                          shuffle_buffer_size=8, max_samples_per_sequence=8, packing_buffer_size=32)

    class Grouped(SyntheticTaskEncoder):
        def batch_group_criterion(self, sample):
            return sample.source, 4

    g = Grouped()
    g.ordering = OrderingConfig(length_sort_pool_size=16)
    with pytest.raises(OrderingConfigError, match=r"batch_group_criterion"):
        get_train_dataset(small_dataset, batch_size=4, worker_config=wc, task_encoder=g,
                          shuffle_buffer_size=8, max_samples_per_sequence=8)


def test_batch_mode_without_batching_is_refused(small_dataset):
    te = SyntheticTaskEncoder()
    te.ordering = OrderingConfig(length_sort_pool_size=16, length_sort_mode="batch")
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    with pytest.raises(OrderingConfigError, match=r"length_sort_mode = 'batch' needs batching"):
        get_train_dataset(small_dataset, batch_size=None, worker_config=wc, task_encoder=te,
                          shuffle_buffer_size=8, max_samples_per_sequence=8)


def test_ordering_must_be_an_ordering_config(small_dataset):
    te = SyntheticTaskEncoder()
    te.ordering = {"length_sort_pool_size": 16}
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    with pytest.raises(OrderingTypeError, match=r"must be an OrderingConfig"):
        get_train_dataset(small_dataset, batch_size=4, worker_config=wc, task_encoder=te,
                          shuffle_buffer_size=8, max_samples_per_sequence=8)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(
    "changed,match",
    [
        (dict(length_sort_pool_size=32), r"pool_size: saved 64 != configured 32"),
        (dict(length_sort_mode="sample"), r"mode: saved 'batch' != configured 'sample'"),
        (dict(seed=9), r"seed: saved 0 != configured 9"),
    ],
)
def test_restoring_with_another_pool_configuration_raises(small_dataset, num_workers, changed, match):
    saved_cfg = dict(length_sort_pool_size=64, length_sort_mode="batch", seed=0)
    _, states = run_with_cuts(lambda: build_train_loader(
        small_dataset, ordering=OrderingConfig(**saved_cfg), num_workers=num_workers), 4, [3])
    state = states[3]

    other = build_train_loader(small_dataset, ordering=OrderingConfig(**{**saved_cfg, **changed}),
                               num_workers=num_workers)
    with pytest.raises(StateMismatchError, match=match):
        other.restore_state_rank(state)
        next(iter(other))  # with worker processes the state is applied in the worker
    close_loader(other)
