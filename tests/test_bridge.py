"""Megatron-Bridge integration, through Bridge's own code: its dataset-provider dispatch
(``get_dataset_provider``), its Energon data module, its dataloader-state saver
(``maybe_save_dataloader_state``), its loader (``maybe_load_dataloader_state``) and restricted
unpickler (``energon_torch_load``), on a one-process gloo group with
``initialize_model_parallel(1, 1)``.

Bridge 0.6.2 needs Python 3.12: these tests are marked ``py312`` and run by ``.ci/py312``. It
imports Transformer Engine at import time, which cannot be installed on CPU: the tests call the
package's explicit stand-in, ``energon_ordering.integrations.bridge_cpu.install()``, first.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.py312

if sys.version_info < (3, 12):
    pytest.skip("Megatron-Bridge 0.6.2 needs Python 3.12 (run by .ci/py312)", allow_module_level=True)

import torch  # noqa: E402

from energon_ordering.integrations import bridge_cpu  # noqa: E402

bridge_cpu.install()  # Transformer Engine's CPU stand-in, explicitly; a no-op with real TE

from megatron.bridge.data.utils import get_dataset_provider  # noqa: E402
from megatron.bridge.training.callbacks import CallbackContext  # noqa: E402
from megatron.bridge.training.checkpointing import (  # noqa: E402
    maybe_load_dataloader_state,
    maybe_save_dataloader_state,
)
from megatron.bridge.training.state import GlobalState  # noqa: E402
from megatron.bridge.utils.safe_pickle import energon_torch_load  # noqa: E402
from megatron.core.rerun_state_machine import RerunDataIterator  # noqa: E402

from energon_ordering import (  # noqa: E402
    OrderingConfig,
    OrderingConfigError,
    OrderingTypeError,
    StateMismatchError,
)
from energon_ordering.integrations.bridge import (  # noqa: E402
    DataloaderRestoreError,
    OrderingDatasetProvider,
    OrderingResumeCheck,
)
from energon_ordering.inspect.rank_simulation import close_loader  # noqa: E402
from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder  # noqa: E402

MICRO_BATCH = 4
PER_STEP = 2  # micro-batches per optimizer step
# A packaged recipe by name, with overrides sized for the 640-sample test dataset.
ORDERING = {"length_sort_pool_size": 32, "micro_batches_per_step": PER_STEP,
            "seq_length_warmup": {"start": 64, "full": 256, "warmup_steps": 8, "overflow": "keep"}}


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


def _provider(data: Path, num_workers: int, **kw) -> OrderingDatasetProvider:
    kw = {"recipe": "length_sync_batch", "ordering": ORDERING, **kw}
    return OrderingDatasetProvider(path=str(data), task_encoder=SyntheticTaskEncoder(),
                                   micro_batch_size=MICRO_BATCH, num_workers=num_workers,
                                   pin_memory=False, **kw)


def _build(provider: OrderingDatasetProvider, pg) -> RerunDataIterator:
    """What Bridge's setup does for a DatasetProvider with dataloader_type 'external': dispatch
    through get_dataset_provider, pass the train loader through in a RerunDataIterator."""
    build = get_dataset_provider(provider)
    train, valid, test = build([1000, 0, 0], provider, tokenizer=None, pg_collection=pg)
    assert valid is None and test is None
    return RerunDataIterator(train)


def _resume_check(provider: OrderingDatasetProvider, step: int) -> None:
    state = GlobalState()
    state.train_state.step = step
    OrderingResumeCheck(provider).on_train_start(CallbackContext(state=state, model=[]))


def _keys(it: RerunDataIterator, n: int) -> list[list[str]]:
    return [list(next(it).keys) for _ in range(n)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_round_trip_through_bridge_saver_and_loader(small_dataset, tmp_path, pg, num_workers):
    step, after = 6, 16
    provider = _provider(small_dataset, num_workers)
    it = _build(provider, pg)
    assert provider.ordering_config.length_sort_mode == "batch"  # from the packaged recipe
    _resume_check(provider, 0)
    head = _keys(it, step * PER_STEP)
    save_dir = tmp_path / "energon"
    maybe_save_dataloader_state(None, it, step, str(save_dir), pg_collection=pg)
    saved = save_dir / f"iter_{step:07d}" / "train_dataloader_dprank000.pt"
    assert saved.is_file()
    tail = _keys(it, after)

    fresh = _provider(small_dataset, num_workers)
    it2 = _build(fresh, pg)
    maybe_load_dataloader_state(it2, step, str(save_dir), pg_collection=pg)
    _resume_check(fresh, step)
    assert _keys(it2, after) == tail
    assert len({k for b in head + tail for k in b}) > after  # real, varied samples

    # The state really passed Bridge's restricted unpickler (not a plain torch.load).
    assert energon_torch_load(str(saved))["dataloader_state_dict"] is not None


def test_foreign_class_in_a_state_is_refused_by_bridge(small_dataset, tmp_path, pg):
    """The unpickler check can fail: a state holding a class off Bridge's allowlist is refused."""
    it = _build(_provider(small_dataset, 0, allow_dataloader_restart=True), pg)
    _keys(it, 2)
    save_dir = tmp_path / "energon"
    maybe_save_dataloader_state(None, it, 1, str(save_dir), pg_collection=pg)
    saved = save_dir / "iter_0000001" / "train_dataloader_dprank000.pt"
    state = energon_torch_load(str(saved))
    state["dataloader_state_dict"] = [state["dataloader_state_dict"], OrderingConfig()]
    torch.save(state, saved)
    fresh = _build(_provider(small_dataset, 0), pg)
    with pytest.raises(pickle.UnpicklingError, match="energon_ordering.config.OrderingConfig"):
        maybe_load_dataloader_state(fresh, 1, str(save_dir), pg_collection=pg)


def test_missing_state_at_a_resume_is_loud(small_dataset, tmp_path, pg):
    provider = _provider(small_dataset, 0)
    it = _build(provider, pg)
    maybe_load_dataloader_state(it, 5, str(tmp_path / "nowhere"), pg_collection=pg)  # Bridge: quiet
    with pytest.raises(DataloaderRestoreError, match="resumed at step 5 but restored no dataloader state"):
        _resume_check(provider, 5)

    allowed = _provider(small_dataset, 0, allow_dataloader_restart=True)
    it = _build(allowed, pg)
    maybe_load_dataloader_state(it, 5, str(tmp_path / "nowhere"), pg_collection=pg)
    with pytest.warns(RuntimeWarning, match="RESTARTING THE DATA STREAM FROM ZERO"):
        _resume_check(allowed, 5)
    assert len(next(it).keys) == MICRO_BATCH


def test_no_batch_before_the_resume_check(small_dataset, pg):
    it = _build(_provider(small_dataset, 0), pg)
    with pytest.raises(DataloaderRestoreError, match="before its resume check ran"):
        next(it)


def test_restore_into_other_settings_is_refused(small_dataset, tmp_path, pg):
    """The stages' own state checks (stamps) run under Bridge's loader too."""
    it = _build(_provider(small_dataset, 0, allow_dataloader_restart=True), pg)
    _keys(it, 2 * PER_STEP)
    maybe_save_dataloader_state(None, it, 2, str(tmp_path), pg_collection=pg)
    other = _provider(small_dataset, 0, ordering={**ORDERING, "length_sort_pool_size": 16})
    it = _build(other, pg)
    with pytest.raises(StateMismatchError, match="pool_size: saved 32 != configured 16"):
        maybe_load_dataloader_state(it, 2, str(tmp_path), pg_collection=pg)  # raises here with
        _resume_check(other, 2)  # no worker processes; with workers at the first batch
        next(it)


def test_state_of_another_micro_batch_size_is_refused_naming_it(small_dataset, tmp_path, pg):
    """Half the micro-batch size at the same global batch: refused by the state's stamp at
    Bridge's load, naming the micro-batch size (not only a count of micro-batches)."""
    it = _build(_provider(small_dataset, 0, allow_dataloader_restart=True), pg)
    _keys(it, 2 * PER_STEP)
    maybe_save_dataloader_state(None, it, 2, str(tmp_path), pg_collection=pg)
    other = _provider(small_dataset, 0, ordering={**ORDERING, "micro_batches_per_step": 2 * PER_STEP})
    other.micro_batch_size = MICRO_BATCH // 2
    it = _build(other, pg)
    with pytest.raises(StateMismatchError, match=r"batch_size: saved 4 != configured 2.*micro-batch size"):
        maybe_load_dataloader_state(it, 2, str(tmp_path), pg_collection=pg)
        _resume_check(other, 2)
        next(it)


def test_state_of_another_step_is_refused(small_dataset, tmp_path, pg):
    it = _build(_provider(small_dataset, 0, allow_dataloader_restart=True), pg)
    _keys(it, 3 * PER_STEP)
    maybe_save_dataloader_state(None, it, 3, str(tmp_path), pg_collection=pg)
    # A state saved at step 3 filed under step 4 (e.g. copied between checkpoints by hand).
    (tmp_path / "iter_0000003").rename(tmp_path / "iter_0000004")
    provider = _provider(small_dataset, 0)
    it = _build(provider, pg)
    maybe_load_dataloader_state(it, 4, str(tmp_path), pg_collection=pg)
    with pytest.raises(DataloaderRestoreError, match=r"saved after 6 micro-batches, but step 4 x 2"):
        _resume_check(provider, 4)


def test_micro_batches_per_step_must_match_bridge(small_dataset, pg):
    from types import SimpleNamespace

    from megatron.bridge.training.config import TrainingConfig

    provider = _provider(small_dataset, 0)
    _build(provider, pg)
    state = GlobalState()
    state._cfg = SimpleNamespace(train=TrainingConfig(global_batch_size=12, micro_batch_size=MICRO_BATCH))
    with pytest.raises(OrderingConfigError, match=r"micro_batches_per_step = 2, but Bridge's .* = 3"):
        OrderingResumeCheck(provider).on_train_start(CallbackContext(state=state, model=[]))


def test_validation_loader(small_dataset, tmp_path, pg):
    meta = tmp_path / "metadataset.yaml"  # the train split doubles as the validation split
    meta.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n"
                    f"  train: {{path: {small_dataset}}}\n"
                    f"  val: {{path: {small_dataset}, split_part: train}}\n")
    provider = _provider(meta, 0)
    build = get_dataset_provider(provider)
    train, valid, _ = build([100, 10, 0], provider, tokenizer=None, pg_collection=pg)
    assert len(next(valid).keys) == MICRO_BATCH  # validation needs no resume check
    assert hasattr(train, "save_state")  # the loader itself, which Bridge's saver looks for


def test_provider_errors(small_dataset):
    from megatron.energon import DefaultTaskEncoder

    with pytest.raises(OrderingTypeError, match="task_encoder = DefaultTaskEncoder has no OrderingTaskEncoder"):
        OrderingDatasetProvider(path=str(small_dataset), task_encoder=DefaultTaskEncoder(), micro_batch_size=4)
    with pytest.raises(OrderingConfigError, match="dataloader_type = 'cyclic'"):
        _provider(small_dataset, 0, dataloader_type="cyclic")
    with pytest.raises(OrderingConfigError, match="micro_batch_size = 0 must be"):
        OrderingDatasetProvider(path=str(small_dataset), task_encoder=SyntheticTaskEncoder(), micro_batch_size=0)
    with pytest.raises(OrderingConfigError, match="recipe 'nope'"):
        _provider(small_dataset, 0, recipe="nope")
    with pytest.raises(OrderingConfigError, match="were both given"):
        _provider(small_dataset, 0, ordering=OrderingConfig())
    with pytest.raises(OrderingConfigError, match="unknown setting"):
        _provider(small_dataset, 0, ordering={"pool": 3})
    with pytest.raises(OrderingTypeError, match="ordering = int: expected an OrderingConfig"):
        _provider(small_dataset, 0, ordering=42)
    with pytest.raises(OrderingTypeError, match="validation_task_encoder = DefaultTaskEncoder"):
        _provider(small_dataset, 0, validation_task_encoder=DefaultTaskEncoder())
    cfg = OrderingConfig(length_sort_pool_size=8)
    provider = _provider(small_dataset, 0, recipe=None, ordering=cfg)
    assert provider.ordering_config is None  # computed from the final fields, never at construction
    assert provider.ordering == cfg.to_dict()
    provider.finalize()
    assert provider.ordering_config == cfg


def test_provider_goes_into_bridge_run_config(small_dataset):
    """Bridge writes ``cfg.to_yaml()`` (run_config.yaml) with every checkpoint; the dataset entry
    (our provider, holding a task encoder object and an OrderingConfig) must convert and dump."""
    import yaml
    from megatron.bridge.training.utils.config_utils import _ConfigContainerBase
    from megatron.training.config.yaml_utils import safe_yaml_representers

    for provider in (_provider(small_dataset, 0),
                     _provider(small_dataset, 0, recipe=None, ordering=OrderingConfig.from_dict(ORDERING))):
        as_dict = _ConfigContainerBase._convert_value_to_dict(provider)
        with safe_yaml_representers():
            text = yaml.safe_dump(as_dict)
        assert "OrderingDatasetProvider" in text and "length_sort_pool_size: 32" in text


def test_import_without_transformer_engine_names_it_and_the_remedies():
    """Without the stand-in the import fails, naming transformer_engine (not Bridge, which is
    installed), why Bridge needs it, and the GPU and CPU remedies; importing the stand-in's module
    alone changes nothing."""
    import subprocess

    code = ("import sys\n"
            "from energon_ordering.integrations import bridge_cpu\n"
            "assert 'transformer_engine' not in sys.modules and 'megatron.bridge' not in sys.modules\n"
            "try:\n"
            "    import energon_ordering.integrations.bridge\n"
            "except ImportError as e:\n"
            "    print('@@', e.name, '@@', e, sep='')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    _, name, message = out[out.index("@@"):].split("@@")
    assert name == "transformer_engine"
    for part in ("`transformer_engine` (NVIDIA Transformer Engine) is not installed",
                 "megatron/bridge/peft/lora_layers.py", "Megatron-Bridge itself is installed",
                 "NGC PyTorch container", "transformer-engine[pytorch]", "bridge_cpu.install()"):
        assert part in message, part


def test_cpu_stand_in_is_removed_after_install():
    """After install() Bridge is imported and the placeholder modules are gone again, so code
    imported later sees Transformer Engine absent; a placeholder class refuses to be built."""
    assert "transformer_engine" not in sys.modules
    assert "megatron.bridge.peft.lora_layers" in sys.modules
    from megatron.bridge.peft import lora_layers

    assert lora_layers.te.__name__ == "transformer_engine.pytorch"  # the stand-in, kept by Bridge
    with pytest.raises(RuntimeError, match=r"transformer_engine.pytorch.Linear is energon_ordering.s CPU stand-in"):
        lora_layers.te.Linear()
    assert bridge_cpu.install() is True  # idempotent


# ---- Bridge's config life cycle: overrides, finalize, the YAML round trip, the run's checks ----


def _container(provider: OrderingDatasetProvider, *, global_batch_size: int = MICRO_BATCH * PER_STEP,
               train_iters: int = 100, seq_length: int = 256, eval_iters: int = 0):
    """A real ConfigContainer around ``provider`` (a one-layer GPT; nothing is built)."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        LoggerConfig,
        OptimizerConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )

    return ConfigContainer(
        train=TrainingConfig(global_batch_size=global_batch_size, micro_batch_size=MICRO_BATCH,
                             train_iters=train_iters),
        validation=ValidationConfig(eval_iters=eval_iters, eval_interval=10),
        model=GPTModelProvider(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=seq_length),
        optimizer=OptimizerConfig(lr=1e-4, use_distributed_optimizer=False),
        scheduler=SchedulerConfig(), dataset=provider, logger=LoggerConfig(),
        tokenizer=TokenizerConfig(), checkpoint=CheckpointConfig(),
    )


def test_command_line_overrides_reach_what_is_built(small_dataset, pg):
    """Overrides through Bridge's own process_config_with_overrides, then Bridge's validate()
    (which calls the provider's finalize()), then the build: the pool, the recipe and a plain
    dataset field all take effect."""
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    cfg = _container(_provider(small_dataset, 0))
    process_config_with_overrides(cfg, cli_overrides=[
        "dataset.ordering.length_sort_pool_size=16", "dataset.recipe=length_sync_reference",
        "dataset.num_workers=1", "dataset.pin_memory=false"])
    cfg.validate()
    assert cfg.dataset.ordering_config.length_sort_pool_size == 16
    assert cfg.dataset.ordering_config.length_sort_mode == "sample"  # length_sync_reference
    assert cfg.dataset.ordering_config.seed == 1234
    it = _build(cfg.dataset, pg)
    built = cfg.dataset.task_encoder.ordering
    assert (built.length_sort_pool_size, built.length_sort_mode) == (16, "sample")
    assert it.iterable._dataloader.worker_config.num_workers == 1

    # An OrderingConfig object is kept as the mapping of its settings, so overrides reach it too
    # (Bridge cannot assign to the frozen object and would only log a warning).
    cfg = _container(_provider(small_dataset, 0, recipe=None, ordering=OrderingConfig.from_dict(ORDERING)))
    process_config_with_overrides(cfg, cli_overrides=["dataset.ordering.length_sort_pool_size=16"])
    cfg.validate()
    assert cfg.dataset.ordering_config.length_sort_pool_size == 16


def test_yaml_round_trip_through_bridge_writer_and_loader(small_dataset, tmp_path):
    """Bridge's run_config.yaml writer and its allow-listed loader: importing the provider's
    module registers the package's prefix, so the provider (and the package's encoders) load."""
    from megatron.bridge.training.config import ConfigContainer

    cfg = _container(_provider(small_dataset, 0, scale_schedule_to_run=True))
    path = tmp_path / "run_config.yaml"
    cfg.to_yaml(str(path))
    assert "_target_: energon_ordering.integrations.bridge.OrderingDatasetProvider" in path.read_text()
    loaded = ConfigContainer.from_yaml(str(path))
    assert type(loaded.dataset) is OrderingDatasetProvider
    assert type(loaded.dataset.task_encoder) is SyntheticTaskEncoder
    for name in ("path", "recipe", "ordering", "micro_batch_size", "scale_schedule_to_run", "num_workers"):
        assert getattr(loaded.dataset, name) == getattr(cfg.dataset, name), name
    loaded.dataset.finalize()
    cfg.dataset.finalize()
    assert loaded.dataset.ordering_config == cfg.dataset.ordering_config


def test_check_run_derives_micro_batches_per_step(small_dataset):
    cfg = _container(_provider(small_dataset, 0, ordering={"length_sort_pool_size": 32}),
                     global_batch_size=MICRO_BATCH * 3)
    cfg.validate()
    assert cfg.dataset.ordering_config.micro_batches_per_step == 1  # the default until the run is known
    state = GlobalState()
    state.cfg = cfg
    OrderingResumeCheck(cfg.dataset).on_data_init_start(CallbackContext(state=state, model=[]))
    assert cfg.dataset.ordering_config.micro_batches_per_step == 3
    cfg.dataset.finalize()  # a later finalize keeps what the run decided
    assert cfg.dataset.ordering_config.micro_batches_per_step == 3


def test_check_run_refusals(small_dataset):
    cfg = _container(_provider(small_dataset, 0), global_batch_size=MICRO_BATCH * 3)
    cfg.validate()
    with pytest.raises(OrderingConfigError, match=r"micro_batches_per_step = 2, but Bridge's .* = 3; "
                                                  r"set dataset.ordering.micro_batches_per_step=3"):
        cfg.dataset.check_run(cfg)

    cfg = _container(_provider(small_dataset, 0), seq_length=512)  # the warmup's full is 256
    cfg.validate()
    with pytest.raises(OrderingConfigError, match=r"seq_length_warmup.full = 256, but Bridge's "
                                                  r"model.seq_length = 512"):
        cfg.dataset.check_run(cfg)

    schedule = {"total_steps": 200, "sources": {"web": {"weight": 1}}}
    cfg = _container(_provider(small_dataset, 0, ordering={**ORDERING, "mixture_schedule": schedule}),
                     train_iters=1000)
    cfg.validate()
    with pytest.raises(OrderingConfigError, match=r"total_steps = 200 .* train.train_iters = 1000.*"
                                                  r"scale_schedule_to_run"):
        cfg.dataset.check_run(cfg)
    cfg.dataset.scale_schedule_to_run = True
    assert cfg.dataset.check_run(cfg).mixture_schedule.total_steps == 1000

    cfg = _container(_provider(small_dataset, 0))
    cfg.train.micro_batch_size = MICRO_BATCH // 2
    cfg.data_parallel_size = 1
    with pytest.raises(OrderingConfigError, match=r"OrderingDatasetProvider.micro_batch_size = 4, but Bridge's "
                                                  r"train.micro_batch_size = 2"):
        cfg.dataset.check_run(cfg)


def test_llava_pretrain_recipe_requirements_are_checked(small_dataset):
    """The packaged llava_pretrain recipe needs 4 micro-batches per step, 50,000 steps and its
    five named sources; each unmet one is refused at check_run, before any data is read."""
    def container(global_batch_size: int, train_iters: int):
        cfg = _container(_provider(small_dataset, 0, recipe="llava_pretrain", ordering=None),
                         global_batch_size=global_batch_size, train_iters=train_iters)
        cfg.validate()
        return cfg

    cfg = container(MICRO_BATCH * 2, 50_000)
    with pytest.raises(OrderingConfigError, match=r"micro_batches_per_step = 4, but Bridge's"):
        cfg.dataset.check_run(cfg)
    cfg = container(MICRO_BATCH * 4, 1000)
    with pytest.raises(OrderingConfigError, match=r"total_steps = 50000 .* train.train_iters = 1000"):
        cfg.dataset.check_run(cfg)
    cfg = container(MICRO_BATCH * 4, 50_000)
    with pytest.raises(OrderingConfigError,
                       match=r"recipe = 'llava_pretrain': its mixture schedule draws from the sources "
                             r"caption, vqa, ocr, interleaved, sft_quality, but dataset.path = .* has no "
                             r"caption, vqa, ocr, interleaved, sft_quality \(its sources: "):
        cfg.dataset.check_run(cfg)


def test_planned_mix_passes_through_the_provider(small_dataset):
    provider = _provider(small_dataset, 0, ordering={**ORDERING, "length_sort_mode": "planned",
                                                     "length_sort_pool_size": 0,
                                                     "length_sort_placement": "pre-encode",
                                                     "length_sort_pool_holds": "keys",
                                                     "planned_mix": "window"})
    provider.finalize()
    assert provider.ordering_config.planned_mix == "window"


def test_validation_without_a_val_split_is_refused_by_name(small_dataset, pg):
    """The dataset has no val split: refused before training, naming the two ways out, at
    check_run and (without the callback) at the build, instead of Energon's bare KeyError."""
    cfg = _container(_provider(small_dataset, 0), eval_iters=2)
    cfg.validate()
    with pytest.raises(OrderingConfigError, match=r"has no 'val' split .* dataset.do_validation=false, "
                                                  r"or validation.eval_iters=0"):
        cfg.dataset.check_run(cfg)
    provider = _provider(small_dataset, 0)
    with pytest.raises(OrderingConfigError, match=r"has no 'val' split"):
        get_dataset_provider(provider)([100, 10, 0], provider, tokenizer=None, pg_collection=pg)
    cfg.dataset.do_validation = False
    cfg.dataset.check_run(cfg)  # no validation wanted: fine


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_under_bridges_rampup_batch_size(small_dataset, tmp_path, pg, num_workers):
    """train.rampup_batch_size: Bridge's first iterations draw fewer micro-batches (Megatron's
    calculator, as Bridge's train loop updates it). The resume check counts those, not step x
    micro_batches_per_step, and the resume is exact; the schedule's run length is the full
    global batches the iterations draw."""
    from energon_ordering.integrations.bridge import _run_shape
    from energon_ordering.integrations.megatron_lm import core_honours_rampup

    ramp, step, after = [4, 4, 16], 6, 8  # the global batch grows 4 -> 8 over the first 16 samples

    def run(provider: OrderingDatasetProvider) -> tuple[OrderingResumeCheck, CallbackContext]:
        cfg = _container(provider, global_batch_size=MICRO_BATCH * PER_STEP, train_iters=100)
        cfg.train.rampup_batch_size = ramp
        cfg.validate()
        state = GlobalState()
        state.cfg = cfg
        check = OrderingResumeCheck(provider)
        context = CallbackContext(state=state, model=[])
        check.on_data_init_start(context)
        return check, context

    drawn = _bridge_loop_micro_batches(ramp, step)
    ramps = core_honours_rampup()
    assert drawn == (10 if ramps else step * PER_STEP)  # 1, 1, 1, 1, 2, 2 where core ramps up
    provider = _provider(small_dataset, num_workers)
    check, context = run(provider)
    assert _run_shape(context.state.cfg).ramp_steps == (
        _bridge_loop_micro_batches(ramp, 100) // PER_STEP if ramps else None)
    it = _build(provider, pg)
    check.on_train_start(context)
    _keys(it, drawn)
    save_dir = tmp_path / "energon"
    maybe_save_dataloader_state(None, it, step, str(save_dir), pg_collection=pg)
    tail = _keys(it, after)
    it.iterable._iter = None
    close_loader(it.iterable._dataloader)

    fresh = _provider(small_dataset, num_workers)
    check, context = run(fresh)
    context.state.train_state.step = step
    it2 = _build(fresh, pg)
    maybe_load_dataloader_state(it2, step, str(save_dir), pg_collection=pg)
    check.on_train_start(context)  # what Bridge's loop drew in 6 steps: accepted
    assert _keys(it2, after) == tail
    it2.iterable._iter = None
    close_loader(it2.iterable._dataloader)


def _bridge_loop_micro_batches(ramp: list[int], iterations: int) -> int:
    """Micro-batches Bridge's train loop draws on one rank: its initialize's
    init_num_microbatches_calculator call, then update_num_microbatches(consumed) before each
    step, consumed += data-parallel size x micro-batch size x micro-batches after it."""
    from megatron.core import num_microbatches_calculator as nmc

    nmc.init_num_microbatches_calculator(1, ramp, MICRO_BATCH * PER_STEP, MICRO_BATCH, 1, False)
    consumed = total = 0
    try:
        for _ in range(iterations):
            nmc.update_num_microbatches(consumed, consistency_check=False)
            total += nmc.get_num_microbatches()
            consumed += MICRO_BATCH * nmc.get_num_microbatches()
    finally:
        nmc.destroy_num_microbatches_calculator()
    return total
