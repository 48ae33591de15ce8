"""Bridge's built-in encoders (``HFEnergonTaskEncoderConfig`` and ``QwenVLEnergonTaskEncoderConfig``
over a Qwen2.5-VL processor) under the ordering: built by Bridge's ``build_energon_task_encoder``, a length pool, exact resume through
Bridge's saver and loader, Bridge's padding and in-batch packing passed through, the
``@stateless`` claim checked by re-encoding from restore keys, and each refusal.

Everything is offline: a ChatML + image dataset and a tiny processor written to tmp_path
(``tests/bridge_chatml.py``). Python 3.12 only (``py312``, run by ``.ci/py312``).
"""

from __future__ import annotations

import os
import sys

import pytest

# The tests use the processor's tokenizer in this process, then fork loader workers: Hugging Face
# tokenizers' thread pool deadlocks in a forked child unless parallelism is off (HF's own advice).
os.environ["TOKENIZERS_PARALLELISM"] = "false"

pytestmark = pytest.mark.py312

if sys.version_info < (3, 12):
    pytest.skip("Megatron-Bridge 0.6.2 needs Python 3.12 (run by .ci/py312)", allow_module_level=True)

import torch  # noqa: E402

from energon_ordering.integrations import bridge_cpu  # noqa: E402

bridge_cpu.install()  # Transformer Engine's CPU stand-in, explicitly; a no-op with real TE

from bridge_chatml import (  # noqa: E402
    MAX_PIXELS,
    MERGE,
    MIN_PIXELS,
    make_chatml_dataset,
    make_tiny_qwen_processor,
    sample_ids,
)
from megatron.bridge.data.builders.energon import (  # noqa: E402
    HFEnergonTaskEncoderConfig,
    NemotronOmniEnergonTaskEncoderConfig,
    QwenVLEnergonTaskEncoderConfig,
)
from megatron.bridge.data.energon.hf_task_encoder import HFTaskEncoder  # noqa: E402
from megatron.bridge.data.utils import get_dataset_provider  # noqa: E402
from megatron.bridge.training.callbacks import CallbackContext  # noqa: E402
from megatron.bridge.training.checkpointing import (  # noqa: E402
    maybe_load_dataloader_state,
    maybe_save_dataloader_state,
)
from megatron.bridge.training.state import GlobalState  # noqa: E402
from megatron.core.rerun_state_machine import RerunDataIterator  # noqa: E402
from megatron.energon import WorkerConfig, get_loader, get_train_dataset  # noqa: E402

from energon_ordering import OrderingConfigError, OrderingTypeError  # noqa: E402
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder  # noqa: E402
from energon_ordering.integrations.bridge import OrderingDatasetProvider, OrderingResumeCheck  # noqa: E402
from energon_ordering.integrations.bridge_encoders import (  # noqa: E402
    BuiltinEncoderSettings,
    OrderingHFTaskEncoder,
    OrderingQwenVLTaskEncoder,
    build_builtin_encoder,
)

NUM_SAMPLES = 96
MICRO_BATCH = 4
PER_STEP = 2
SEQ_LENGTH = 512
ORDERING = {"length_sort_pool_size": 16, "length_sort_mode": "batch", "micro_batches_per_step": PER_STEP}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """(dataset folder, processor folder), written once for the module."""
    root = tmp_path_factory.mktemp("chatml")
    return make_chatml_dataset(root / "data", NUM_SAMPLES), make_tiny_qwen_processor(root / "proc", NUM_SAMPLES)


@pytest.fixture(scope="module")
def pg(tmp_path_factory):
    """One-process gloo group, megatron-core model parallel (1, 1), Bridge's process groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    init = tmp_path_factory.mktemp("dist") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield ProcessGroupCollection.use_mpu_process_groups()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _hf_config(processor) -> HFEnergonTaskEncoderConfig:
    return HFEnergonTaskEncoderConfig(hf_processor_path=str(processor), min_pixels=MIN_PIXELS,
                                      max_pixels=MAX_PIXELS, trust_remote_code=False)


def _qwen_vl_config(processor) -> QwenVLEnergonTaskEncoderConfig:
    return QwenVLEnergonTaskEncoderConfig(hf_processor_path=str(processor), patch_size=2,
                                          spatial_merge_size=MERGE, min_pixels=MIN_PIXELS,
                                          max_pixels=MAX_PIXELS, trust_remote_code=False)


#: Bridge's declarative encoder configs, and the ordering class each is built as.
ENCODERS = {"hf": (_hf_config, OrderingHFTaskEncoder), "qwen_vl": (_qwen_vl_config, OrderingQwenVLTaskEncoder)}


def _hf_processor(encoder):
    """The Hugging Face processor a built encoder collates with."""
    return encoder.processor if isinstance(encoder, HFTaskEncoder) else encoder.image_processor


def _provider(chatml, num_workers: int = 0, kind: str = "hf", **kw) -> OrderingDatasetProvider:
    data, processor = chatml
    kw = {"ordering": ORDERING, "seq_length": SEQ_LENGTH, **kw}
    return OrderingDatasetProvider(path=str(data), task_encoder=ENCODERS[kind][0](processor),
                                   micro_batch_size=MICRO_BATCH, num_workers=num_workers,
                                   pin_memory=False, shuffle_buffer_size=8, **kw)


def _build(provider: OrderingDatasetProvider, pg) -> RerunDataIterator:
    train, valid, _ = get_dataset_provider(provider)([1000, 0, 0], provider, tokenizer=None, pg_collection=pg)
    assert valid is None
    return RerunDataIterator(train)


def _resume_check(provider: OrderingDatasetProvider, step: int) -> None:
    state = GlobalState()
    state.train_state.step = step
    OrderingResumeCheck(provider).on_train_start(CallbackContext(state=state, model=[]))


def _batches(it: RerunDataIterator, n: int) -> list[dict]:
    return [next(it) for _ in range(n)]


def _same(a: dict, b: dict) -> bool:
    """Two collated batches are identical: token tensors and pixel values."""
    keys = ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens_q")
    return all(torch.equal(a[k], b[k]) if a.get(k) is not None else b.get(k) is None for k in keys) \
        and torch.equal(a["visual_inputs"].pixel_values, b["visual_inputs"].pixel_values)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "in-batch-packed"])
@pytest.mark.parametrize("kind", list(ENCODERS))
def test_builtin_encoder_resumes_exactly_through_bridge(chatml, tmp_path, pg, kind, packing, num_workers):
    """Bridge's built-in encoder with a length pool: a save through Bridge's saver mid-run (the pool holds
    samples then) and a load through Bridge's loader into a fresh provider continue with the
    identical batches; Bridge's padding / in-batch packing settings reach the collate."""
    step, after = 3, 6
    settings = ({"enable_in_batch_packing": True, "in_batch_packing_pad_to_multiple_of": 4} if packing
                else {"pad_to_multiple_of": 8})
    provider = _provider(chatml, num_workers, kind, **settings)
    it = _build(provider, pg)
    encoder = provider.built_task_encoder
    assert type(encoder) is ENCODERS[kind][1] and encoder.ordering.length_sort_pool_size == 16
    assert encoder.enable_in_batch_packing is packing  # Bridge's builder got the provider's fields
    _resume_check(provider, 0)
    head = _batches(it, step * PER_STEP)
    maybe_save_dataloader_state(None, it, step, str(tmp_path), pg_collection=pg)
    tail = _batches(it, after)

    fresh = _provider(chatml, num_workers, kind, **settings)
    it2 = _build(fresh, pg)
    maybe_load_dataloader_state(it2, step, str(tmp_path), pg_collection=pg)
    _resume_check(fresh, step)
    resumed = _batches(it2, after)
    assert all(_same(a, b) for a, b in zip(resumed, tail))

    tokenizer = _hf_processor(encoder).tokenizer
    seen = [sample_ids(b["input_ids"], tokenizer) for b in head + tail]
    assert all(len(ids) == MICRO_BATCH for ids in seen)
    flat = [i for ids in seen for i in ids]
    assert len(set(flat)) == len(flat)  # within one epoch: no sample twice
    for b in head + tail:
        if packing:
            assert b["input_ids"].shape[0] == 1 and b["cu_seqlens_q"].numel() == MICRO_BATCH + 1
            assert bool(((b["cu_seqlens_q_padded"] % 4) == 0).all())
        else:
            assert b["input_ids"].shape[1] % 8 == 0 and b.get("cu_seqlens_q") is None


def test_pool_groups_similar_lengths(chatml, pg):
    """The pool sorts by the exact length the model computes on (text tokens plus the image's
    merged patches): in 'batch' mode a micro-batch's samples are close in length, far closer
    than without the pool."""

    def spread(ordering) -> float:
        provider = _provider(chatml, ordering=ordering, pad_to_multiple_of=1)
        it = _build(provider, pg)
        _resume_check(provider, 0)
        spreads = []
        for b in _batches(it, 6):
            lengths = b["attention_mask"].sum(dim=1).float()
            spreads.append(float(lengths.max() - lengths.min()))
        return sum(spreads) / len(spreads)

    pooled = spread(ORDERING)
    unpooled = spread({**ORDERING, "length_sort_pool_size": 0})
    assert pooled < unpooled / 2, (pooled, unpooled)


@pytest.mark.parametrize("kind", list(ENCODERS))
def test_encode_sample_is_pure_and_restorable(chatml, kind):
    """The claim behind ``@stateless``: re-encoding a sample from its restore key gives the same
    sample (same collated tokens and pixels), and the length is text + visual tokens. Bridge's
    own class cannot restore a sample at all (no restore key on its output, not stateless)."""
    data, processor = chatml
    encoder = build_builtin_encoder(ENCODERS[kind][0](processor), BuiltinEncoderSettings(seq_length=SEQ_LENGTH),
                                    path=str(data), micro_batch_size=MICRO_BATCH)
    hf_processor = _hf_processor(encoder)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    loader = get_loader(get_train_dataset(str(data), batch_size=None, task_encoder=encoder, worker_config=wc,
                                          shuffle_buffer_size=None, max_samples_per_sequence=None))
    it = iter(loader)
    samples = [next(it) for _ in range(12)]
    for sample in samples:
        again = loader.restore_sample(sample.__restore_key__)
        assert again.__key__ == sample.__key__
        a, b = encoder.collate_fn([sample.example]), encoder.collate_fn([again.example])
        assert _same(a, b)
        grid = a["visual_inputs"].image_grid_thw
        visual = int(grid.prod()) // MERGE**2
        text = len(hf_processor.tokenizer(
            hf_processor.apply_chat_template(sample.example["conversation"], tokenize=False))["input_ids"])
        assert encoder.ordering_sample_length(sample) == text - 1 + visual  # the placeholder expands

    bridge_class = next(c for c in type(encoder).__mro__ if c.__module__.startswith("megatron.bridge"))
    plain = bridge_class.__new__(bridge_class)
    plain.__dict__.update(vars(encoder))
    loader = get_loader(get_train_dataset(str(data), batch_size=None, task_encoder=plain, worker_config=wc,
                                          shuffle_buffer_size=None, max_samples_per_sequence=None))
    sample = next(iter(loader))
    assert not hasattr(sample, "__restore_key__")  # nothing to restore it by


def test_builtin_encoder_refusals(chatml):
    data, processor = chatml
    warmup = {"start": 64, "full": 256, "warmup_steps": 4}
    with pytest.raises(OrderingConfigError, match=r"OrderingConfig.seq_length_warmup = .* with Bridge's "
                                                  r"built-in encoder \(HFEnergonTaskEncoderConfig\)"):
        _provider(chatml, ordering={**ORDERING, "seq_length_warmup": warmup})
    with pytest.raises(OrderingConfigError, match=r"packing_buffer_size = 8 .* use the provider's "
                                                  r"enable_in_batch_packing=True"):
        _provider(chatml, ordering={**ORDERING, "packing_buffer_size": 8, "pack_seq_length": 256})
    with pytest.raises(OrderingConfigError, match=r"length_sort_placement = 'pre-encode' .* "
                                                  r"use length_sort_placement: post-encode"):
        _provider(chatml, ordering={**ORDERING, "length_sort_placement": "pre-encode"})
    with pytest.raises(OrderingConfigError, match=r"pad_to_multiple_of = 0 must be an int >= 1"):
        _provider(chatml, pad_to_multiple_of=0)
    with pytest.raises(OrderingConfigError, match=r"task_encoder \(HFEnergonTaskEncoderConfig\): "
                                                  r"hf_processor_path must be a non-empty string"):
        OrderingDatasetProvider(path=str(data), micro_batch_size=MICRO_BATCH,
                                task_encoder=HFEnergonTaskEncoderConfig(hf_processor_path=" "))
    omni = NemotronOmniEnergonTaskEncoderConfig(
        hf_processor_path=str(processor), max_audio_duration=1.0, num_mel_bins=8,
        visual_keys=("pixel_values",), temporal_patch_size=1, video_fps=1.0, video_nframes=1,
        use_temporal_video_embedder=False, patch_dim=2)
    with pytest.raises(OrderingTypeError, match=r"task_encoder = NemotronOmniEnergonTaskEncoderConfig has no "
                                                r"OrderingTaskEncoder mixin.*HFEnergonTaskEncoderConfig"):
        OrderingDatasetProvider(path=str(data), micro_batch_size=MICRO_BATCH, task_encoder=omni)
    # With your own encoder, the built-in encoders' fields are not silently ignored.
    with pytest.raises(OrderingConfigError, match=r"enable_in_batch_packing = True configures Bridge's "
                                                  r"built-in encoders, but task_encoder is your "
                                                  r"SyntheticTaskEncoder"):
        OrderingDatasetProvider(path=str(data), micro_batch_size=MICRO_BATCH,
                                task_encoder=SyntheticTaskEncoder(), enable_in_batch_packing=True)


def test_builtin_config_overrides_and_yaml_round_trip(chatml, tmp_path):
    """The declarative encoder config is part of Bridge's run config: command-line overrides reach
    it and Bridge's YAML writer and loader round-trip it."""
    from megatron.bridge.training.config import ConfigContainer
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides
    from test_bridge import _container

    cfg = _container(_provider(chatml), global_batch_size=MICRO_BATCH * PER_STEP, seq_length=SEQ_LENGTH)
    process_config_with_overrides(cfg, cli_overrides=[
        "dataset.task_encoder.max_pixels=256", "dataset.pad_to_multiple_of=16",
        "dataset.ordering.length_sort_pool_size=8"])
    cfg.validate()
    assert cfg.dataset.task_encoder.max_pixels == 256 and cfg.dataset.pad_to_multiple_of == 16
    assert cfg.dataset.ordering_config.length_sort_pool_size == 8

    path = tmp_path / "run_config.yaml"
    cfg.to_yaml(str(path))
    loaded = ConfigContainer.from_yaml(str(path))
    assert type(loaded.dataset.task_encoder) is HFEnergonTaskEncoderConfig
    assert loaded.dataset.task_encoder == cfg.dataset.task_encoder
    assert loaded.dataset.pad_to_multiple_of == 16
