r"""Megatron-Bridge integration: a dataset provider with your task encoder, loud resume.

Bridge (``megatron-bridge`` 0.6.2, Python 3.12) builds Energon loaders itself; its declarative
``EnergonDatasetConfig`` only knows Bridge's built-in task encoders. A custom encoder goes
through a ``megatron.bridge.data.base.DatasetProvider`` with ``dataloader_type="external"``,
which ``megatron.bridge.data.utils.get_dataset_provider`` dispatches to ``build_datasets``.
:class:`OrderingDatasetProvider` is that provider: it builds Bridge's own
``EnergonMultiModalDataModule`` with your :class:`OrderingTaskEncoder` and an
:class:`OrderingConfig` (a recipe, fields, or both), and returns Bridge's ``EnergonDataloader``
for training and validation::

    from energon_ordering.integrations.bridge import OrderingDatasetProvider, OrderingResumeCheck

    cfg.dataset = OrderingDatasetProvider(path="/data/llava/metadataset.yaml", task_encoder=MyTE(),
                                          recipe="llava_pretrain", micro_batch_size=4, num_workers=4)
    pretrain(cfg, forward_step, callbacks=[OrderingResumeCheck(cfg.dataset)])

Bridge's built-in encoders: pass ``task_encoder=HFEnergonTaskEncoderConfig(...)`` or
``QwenVLEnergonTaskEncoderConfig(...)`` (Bridge's declarative configs) instead of an encoder
object, with ``pad_to_max_length``, ``pad_to_multiple_of``, ``enable_in_batch_packing``, ... as in
Bridge's ``EnergonDatasetConfig``; :mod:`energon_ordering.integrations.bridge_encoders` builds it
with Bridge's builder and gives it the ordering (no warmup or Energon packing with them).

Config life cycle, as Bridge drives it: ``process_config_with_overrides`` sets the provider's
fields (``dataset.recipe=...``, ``dataset.ordering.length_sort_pool_size=16``, ``dataset.*``),
``ConfigContainer.validate()`` calls :meth:`OrderingDatasetProvider.finalize`, which computes the
:class:`OrderingConfig` from the final fields (never at construction). Bridge's ``finalize()``
hook sees no other part of the config, so the agreement with the run (``micro_batches_per_step``
derived from the global batch, ``total_steps`` against ``train.train_iters``, the warmup's
``full`` against ``model.seq_length``, a ``val`` split when validation is requested) is checked
by :meth:`OrderingDatasetProvider.check_run`, which :class:`OrderingResumeCheck` calls at
``on_data_init_start``: after ``validate()``, before any data is read and before training.
``cfg.to_yaml()`` writes the provider; ``ConfigContainer.from_yaml`` loads it back because
importing this module registers the ``energon_ordering.`` prefix with Bridge's instantiation
allowlist (a task encoder from your own package needs
``register_allowed_target_prefix("my_package.")``; Bridge writes it as its class only, so it must
be constructible without arguments for the YAML to rebuild it).

Transformer Engine: Bridge imports it at import time. Without it this module's import fails with
an ImportError naming ``transformer_engine`` and the remedies; on CPU call
:func:`energon_ordering.integrations.bridge_cpu.install` first.

Dataloader state, as Bridge 0.6.2 handles it (``training/checkpointing.py``):
``maybe_save_dataloader_state`` calls ``save_state()`` on ``train_iterator.iterable`` (the
``EnergonDataloader`` returned here; Bridge passes an external loader through inside a
``RerunDataIterator``) on the first tensor/pipeline/context rank of each data-parallel replica
and ``torch.save``\ s ``{"dataloader_state_dict": state}`` to
``{dataset.dataloader_save or <checkpoint.save>/energon}/iter_{step:07d}/train_dataloader_dprank{dp:03d}.pt``
(no ``mp_rank`` folder). On resume (step > 0) ``maybe_load_dataloader_state`` reads that file
through ``utils/safe_pickle.py`` ``energon_torch_load``, a restricted unpickler that admits only
builtins, tensors, numpy arrays and a short list of Energon state classes, and calls
``restore_state``. This module uses exactly that saver and loader; it adds what Bridge does not do:

- Bridge's own Energon builder returns ``iter(EnergonDataloader)``, a generator without
  ``save_state``, so its checkpoints silently hold no dataloader state. This provider returns
  the ``EnergonDataloader`` itself, so Bridge saves and restores it.
- Bridge silently starts the data stream from zero when the state folder is missing at step > 0.
  :class:`OrderingResumeCheck` (a Bridge callback, run at ``on_train_start``) raises then,
  unless ``allow_dataloader_restart=True``; it also checks that the restored loader consumed
  ``step x micro_batches_per_step`` micro-batches and that ``micro_batches_per_step`` agrees with
  Bridge's ``global_batch_size / (micro_batch_size x data-parallel size)``. The first training
  batch refuses to come out if the check did not run.
- The state's own checks (each stage's stamp: logic version, settings, rank, world size,
  workers, dataset identity) run inside ``restore_state`` (the provider's load hook, which
  restores with :func:`energon_ordering.restore_state_rank`), as with any Energon loader.
- Elastic resume (``length_sort_mode: planned``): Bridge reads
  ``train_dataloader_dprank{dp:03d}.pt`` for each rank of the new data-parallel size, so when
  the size shrinks (2 -> 1, 8 -> 6) every rank finds a file saved at the old size and hands it to
  the hook. A planned state is a position in one global order (every rank's file holds the same
  one), so the hook logs one line and continues it at the new size with the micro-batches per
  step derived from Bridge's unchanged global batch; :class:`OrderingResumeCheck` counts the
  restored micro-batches in the saved shape. Other modes refuse, naming both sizes. When the
  size grows, Bridge itself refuses before any hook runs: ``maybe_load_dataloader_state``
  raises ``RuntimeError("Dataloader state directory ... exists but .../train_dataloader_dprank
  XXX.pt is missing. The data-parallel size likely changed ...")`` on the new ranks, and 0.6.2
  offers no provider-level way past it (this module does not patch Bridge).

Bridge is imported when this module is imported; ``energon_ordering`` itself never imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import warnings
from collections.abc import Mapping
from typing import Any, Literal


def _missing_dependency_message(error: ImportError) -> str:
    """What to install, for the module whose import failed while importing Bridge."""
    missing = getattr(error, "name", None) or ""
    if missing.split(".")[0] == "transformer_engine":
        return (
            f"energon_ordering.integrations.bridge: `{missing}` (NVIDIA Transformer Engine) is not "
            "installed, and Megatron-Bridge imports it at import time "
            "(megatron/bridge/peft/lora_layers.py). Megatron-Bridge itself is installed. On a GPU "
            "machine use an image that has Transformer Engine (NVIDIA's NGC PyTorch container) or "
            "`pip install --no-build-isolation \"transformer-engine[pytorch]\"` beside a CUDA "
            "toolkit. On a CPU-only machine (development, CI: datasets, the provider, dataloader "
            "state) call `from energon_ordering.integrations import bridge_cpu; bridge_cpu.install()` "
            "before importing Bridge or this module; see its docstring. "
            f"(Original error: {error})"
        )
    if missing.split(".")[0] == "megatron" or not missing:
        return (
            f"energon_ordering.integrations.bridge needs Megatron-Bridge ({error}). Install it on "
            "Python 3.12 with `pip install --no-deps megatron-bridge==0.6.2 megatron-core==0.19.2` "
            "and `pip install \"energon-ordering[bridge]\"` (see docs/megatron-bridge.md)."
        )
    return (
        f"energon_ordering.integrations.bridge: Megatron-Bridge is installed but its import needs "
        f"`{missing}`, which is not ({error}). `pip install \"energon-ordering[bridge]\"` installs "
        "what Bridge's data path imports; see docs/megatron-bridge.md."
    )


try:
    from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider
    from megatron.bridge.data.energon.base_energon_datamodule import (
        EnergonDataloader,
        EnergonMultiModalDataModule,
        cyclic_iter,
    )
    from megatron.bridge.training.callbacks import Callback, CallbackContext
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(_missing_dependency_message(e), name=getattr(e, "name", None)) from e

from energon_ordering.config import OrderingConfig
from energon_ordering.errors import OrderingConfigError, OrderingTypeError, StateMismatchError, show
from energon_ordering.integrations.bridge_encoders import (
    BUILTIN_ENCODER_CONFIGS,
    BuiltinEncoderSettings,
    build_builtin_encoder,
    check_builtin_ordering,
)
from energon_ordering.integrations.bridge_run import (
    RunShape,
    agree_with_run,
    missing_split,
    unmatched_sources,
)
from energon_ordering.integrations.megatron_lm import (
    DataloaderRestoreError,
    consumed_micro_batches,
    core_honours_rampup,
    elastic_shape_change,
    expected_at_saved_size,
    expected_consumed_micro_batches,
)
from energon_ordering.packaged_recipes import resolve_recipe
from energon_ordering.state_stamp import loader_stamp, restore_state_rank, saved_stamp
from energon_ordering.task_encoder import OrderingTaskEncoder
from energon_ordering.yaml_file import load_yaml

#: Bridge's YAML loader (``ConfigContainer.from_yaml``) instantiates only allow-listed ``_target_``
#: prefixes; the run config it writes names this package's provider (and encoders, recipes'
#: classes), so the prefix is registered when the provider is importable.
YAML_TARGET_PREFIX = "energon_ordering."
register_allowed_target_prefix(YAML_TARGET_PREFIX)

__all__ = [
    "YAML_TARGET_PREFIX",
    "DataloaderRestoreError",
    "OrderingDatasetProvider",
    "OrderingEnergonDataloader",
    "OrderingResumeCheck",
]


_log = logging.getLogger(__name__)


class OrderingEnergonDataloader(EnergonDataloader):
    """Bridge's ``EnergonDataloader`` that remembers whether it was restored and refuses to yield
    training batches before :class:`OrderingResumeCheck` has looked at it.

    Args:
        dataloader: The Energon savable loader.
        checked: True for loaders no resume check is needed for (validation).
    """

    def __init__(self, dataloader: Any, *, checked: bool = False):
        super().__init__(dataloader)
        self.restored_state: Any = None
        self.checked = checked

    def restore_state(self, state: Any) -> None:
        """Bridge's load hook (``maybe_load_dataloader_state`` calls it with the state it read):
        restores ``state`` with :func:`energon_ordering.restore_state_rank` and remembers it.

        The state is checked against this loader first (rank, data-parallel size, num_workers,
        datasets, ordering: a typed :class:`StateMismatchError` before Energon's own asserts).
        A state saved at another data-parallel size is an elastic resume: with
        ``length_sort_mode: planned`` it continues the same global order at this loader's size
        and micro-batches per step (one log line says so); every other mode refuses it, naming
        both sizes.
        """
        saved, here = saved_stamp(state) or {}, loader_stamp(self._dataloader) or {}
        planned = here.get("length_sort_mode") == "planned"
        if elastic_shape_change(saved, here):
            if not planned and saved.get("world_size") != here.get("world_size"):
                raise StateMismatchError(
                    f"Bridge resumed at data-parallel size {here.get('world_size')} from a "
                    f"dataloader state saved at data-parallel size {saved.get('world_size')} "
                    f"(by data-parallel rank {saved.get('rank')}), with length_sort_mode = "
                    f"{show(here.get('length_sort_mode'))}: only length_sort_mode: planned "
                    "continues the order at another data-parallel size (its state is a position "
                    "in one global order; a pool's state is one rank's stream). Resume at "
                    f"{saved.get('world_size')} data-parallel ranks, or start the data stream "
                    "fresh (dataset.dataloader_load naming a folder that does not exist, with "
                    "allow_dataloader_restart=True)."
                )
            if planned:
                _log.warning(
                    "Bridge resumed at data-parallel size %s (rank %s, %s micro-batches per step) "
                    "from a dataloader state saved at data-parallel size %s (rank %s, %s "
                    "micro-batches per step): length_sort_mode = 'planned' continues the same "
                    "global order (elastic resume)", here.get("world_size"), here.get("rank"),
                    here.get("micro_batches_per_step"), saved.get("world_size"), saved.get("rank"),
                    saved.get("micro_batches_per_step"))
        restore_state_rank(self._dataloader, state)
        self._iter = iter(cyclic_iter(self._dataloader))  # as EnergonDataloader.restore_state
        self.restored_state = state

    def __next__(self) -> Any:
        if not self.checked:
            raise DataloaderRestoreError(
                "OrderingDatasetProvider: the training loader was asked for a batch before its "
                "resume check ran, so a resume that Bridge skipped would go unnoticed. Pass "
                "callbacks=[OrderingResumeCheck(cfg.dataset)] to pretrain()/finetune(), or set "
                "allow_dataloader_restart=True on the provider to accept a silent restart."
            )
        return super().__next__()


@dataclasses.dataclass(kw_only=True)
class OrderingDatasetProvider(DatasetProvider):
    """A Bridge dataset provider: Energon data, your task encoder, the package's ordering.

    Set it as ``ConfigContainer.dataset``. Bridge calls :meth:`build_datasets` through
    ``get_dataset_provider``; it returns (train, validation, None) ``EnergonDataloader``\\ s that
    Bridge's checkpointing saves and restores. Register :class:`OrderingResumeCheck` with
    ``pretrain``.

    Args:
        path: The prepared Energon dataset or metadataset.
        task_encoder: Your task encoder with the :class:`OrderingTaskEncoder` mixin first in its
            bases (``encode_sample`` ``@stateless``); its ``ordering`` is set here. Or one of
            Bridge's declarative built-in encoder configs, ``HFEnergonTaskEncoderConfig`` or
            ``QwenVLEnergonTaskEncoderConfig``: built at :meth:`build_datasets` by Bridge's
            ``build_energon_task_encoder`` and given the ordering
            (:mod:`energon_ordering.integrations.bridge_encoders`; a post-encode pool, mixture
            schedules and exact resume; no warmup, no Energon packing).
        micro_batch_size: Samples per micro-batch (Bridge's ``train.micro_batch_size``).
        recipe: A recipe file, or the name of a packaged recipe (``llava_pretrain``); None: no
            recipe.
        ordering: A mapping of :class:`OrderingConfig` settings applied on top of ``recipe``, or
            an :class:`OrderingConfig` (without ``recipe``; stored as the mapping of its settings,
            so command-line overrides such as ``dataset.ordering.length_sort_pool_size=16`` reach
            it); None: the recipe alone (or every ordering stage off). With None, override with
            ``+dataset.ordering.<setting>=...`` (Hydra's syntax for a new key).
        seq_length: Passed to Bridge's data module (tokens; informational for custom encoders);
            for a built-in encoder config, its collate's ``seq_length`` as in Bridge.
        validation_task_encoder: Encoder for the validation split; None: ``task_encoder``.
        do_validation: Build the validation loader (when Bridge asks for validation samples).
        num_val_workers: Loader workers for validation; None: ``num_workers``.
        shuffle_buffer_size: Energon's shuffle buffer (samples).
        max_samples_per_sequence: Energon's ``max_samples_per_sequence``; None: whole shards.
        dataset_kwargs: More keyword arguments for Energon's ``get_train_dataset``.
        allow_dataloader_restart: Accept a resume (step > 0) without dataloader state: the data
            stream restarts from zero with a warning instead of an error.
        scale_schedule_to_run: A mixture schedule written for another ``total_steps`` than
            Bridge's ``train.train_iters`` is stretched to the run (each phase keeps its share)
            instead of refused.
        pad_to_max_length, pad_to_multiple_of, enable_in_batch_packing,
        defer_in_batch_packing_to_step, in_batch_packing_pad_to_multiple_of: Bridge's
            ``EnergonDatasetConfig`` fields of the same names and defaults, passed to
            ``build_energon_task_encoder`` for a built-in encoder config; with your own encoder
            they must stay at their defaults (configure your encoder instead).

    The :class:`OrderingConfig` is computed from the final fields, never at construction: at
    Bridge's :meth:`finalize` (after command-line overrides), at :meth:`check_run` (against the
    run) and at :meth:`build_datasets`; :attr:`ordering_config` holds the last one (None before).
    Importing this module registers the ``energon_ordering.`` prefix with Bridge's YAML loader;
    register your task encoder's module too (``register_allowed_target_prefix("my_project.")``).
    """

    path: str
    task_encoder: Any
    micro_batch_size: int
    recipe: str | None = None
    ordering: OrderingConfig | Mapping[str, Any] | None = None
    seq_length: int = 2048
    validation_task_encoder: Any = None
    do_validation: bool = True
    num_val_workers: int | None = None
    shuffle_buffer_size: int = 100
    max_samples_per_sequence: int | None = None
    dataset_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    allow_dataloader_restart: bool = False
    scale_schedule_to_run: bool = False
    dataloader_type: Literal["external"] | None = "external"
    pad_to_max_length: bool = False
    pad_to_multiple_of: int = 128
    enable_in_batch_packing: bool = False
    defer_in_batch_packing_to_step: bool = False
    in_batch_packing_pad_to_multiple_of: int = 1

    def __post_init__(self) -> None:
        self._check_fields()
        self._ordering_config()  # refuse a bad recipe or setting now; the config used is computed later
        if isinstance(self.ordering, OrderingConfig):
            # Kept as the mapping of its settings: Bridge's overrides cannot assign to the frozen
            # OrderingConfig (process_config_with_overrides only logs a warning and drops them).
            self.ordering = self.ordering.to_dict()
        self.ordering_config: OrderingConfig | None = None
        self.run_shape: RunShape | None = None  # set by check_run
        self.train_loader: OrderingEnergonDataloader | None = None
        self.built_task_encoder: OrderingTaskEncoder | None = None  # set by build_datasets

    def _builtin(self) -> bool:
        """True if ``task_encoder`` is one of Bridge's declarative built-in encoder configs."""
        return isinstance(self.task_encoder, BUILTIN_ENCODER_CONFIGS)

    def _builtin_settings(self) -> BuiltinEncoderSettings:
        return BuiltinEncoderSettings(**{
            f.name: getattr(self, f.name) for f in dataclasses.fields(BuiltinEncoderSettings)})

    def _check_builtin_fields(self) -> None:
        """A built-in encoder config is checked by Bridge's own ``validate()``; with your own
        encoder, the fields only Bridge's builder reads must keep their defaults."""
        if self._builtin():
            try:
                self.task_encoder.validate()
            except ValueError as e:
                raise OrderingConfigError(
                    f"OrderingDatasetProvider.task_encoder ({type(self.task_encoder).__name__}): {e} "
                    "(Bridge's validate(); fix that field of dataset.task_encoder)."
                ) from e
            for name in ("pad_to_multiple_of", "in_batch_packing_pad_to_multiple_of"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise OrderingConfigError(
                        f"OrderingDatasetProvider.{name} = {show(value)} must be an int >= 1 "
                        "(tokens, as in Bridge's EnergonDatasetConfig)."
                    )
            return
        defaults = BuiltinEncoderSettings(seq_length=self.seq_length)
        for f in dataclasses.fields(BuiltinEncoderSettings):
            if f.name in ("seq_length", "trust_remote_code"):
                continue  # the provider's own fields, meaningful for every encoder
            value, default = getattr(self, f.name), getattr(defaults, f.name)
            if value != default:
                raise OrderingConfigError(
                    f"OrderingDatasetProvider.{f.name} = {show(value)} configures Bridge's built-in "
                    f"encoders, but task_encoder is your {type(self.task_encoder).__name__}, which "
                    f"does not read it; leave it at {show(default)} and configure your encoder "
                    "(or pass an HFEnergonTaskEncoderConfig / QwenVLEnergonTaskEncoderConfig)."
                )

    def _check_fields(self) -> None:
        if self.dataloader_type != "external":
            raise OrderingConfigError(
                f"OrderingDatasetProvider.dataloader_type = {show(self.dataloader_type)}: the provider "
                "returns ready Energon loaders, which Bridge passes through only as 'external'; "
                "leave it at 'external'."
            )
        for encoder, name in ((self.task_encoder, "task_encoder"),
                              (self.validation_task_encoder, "validation_task_encoder")):
            if name == "task_encoder" and self._builtin():
                continue
            if name == "task_encoder" or encoder is not None:
                if not isinstance(encoder, OrderingTaskEncoder):
                    raise OrderingTypeError(
                        f"OrderingDatasetProvider.{name} = {type(encoder).__name__} has no "
                        f"OrderingTaskEncoder mixin; define class MyTE(OrderingTaskEncoder, "
                        f"{type(encoder).__name__}) and pass MyTE()"
                        + (", or pass one of Bridge's HFEnergonTaskEncoderConfig / "
                           "QwenVLEnergonTaskEncoderConfig." if name == "task_encoder" else ".")
                    )
        self._check_builtin_fields()
        if isinstance(self.micro_batch_size, bool) or not isinstance(self.micro_batch_size, int) \
                or self.micro_batch_size < 1:
            raise OrderingConfigError(
                f"OrderingDatasetProvider.micro_batch_size = {show(self.micro_batch_size)} must be an "
                "int >= 1 (Bridge's train.micro_batch_size)."
            )

    def _settings(self) -> tuple[OrderingConfig, set[str]]:
        """The OrderingConfig of the current fields, and the names of the settings the recipe or
        ``ordering`` gives explicitly (the rest are OrderingConfig's defaults)."""
        if isinstance(self.ordering, OrderingConfig):
            if self.recipe is not None:
                raise OrderingConfigError(
                    f"OrderingDatasetProvider: recipe = {show(self.recipe)} and an OrderingConfig "
                    "object were both given; give one, or pass `ordering` as a mapping of the "
                    "settings that override the recipe."
                )
            return self.ordering, {f.name for f in dataclasses.fields(OrderingConfig)}
        if self.ordering is not None and not isinstance(self.ordering, Mapping):
            raise OrderingTypeError(
                f"OrderingDatasetProvider.ordering = {type(self.ordering).__name__}: expected an "
                "OrderingConfig, a mapping of its settings, or None."
            )
        base: dict[str, Any] = {}
        given: set[str] = set()
        if self.recipe is not None:
            path = resolve_recipe(self.recipe)
            base = OrderingConfig.from_yaml(path).to_dict()
            raw = load_yaml(path, "OrderingDatasetProvider.recipe")
            given = set(raw) if isinstance(raw, Mapping) else set()
        overrides = dict(self.ordering or {})
        return OrderingConfig.from_dict({**base, **overrides}), given | set(overrides)

    def _ordering_config(self, run: RunShape | None = None) -> OrderingConfig:
        """The OrderingConfig of the current fields, completed by and checked against ``run``."""
        config, given = self._settings()
        if self._builtin():
            check_builtin_ordering(config, self.task_encoder)
        if run is None:
            return config
        return agree_with_run(config, run, given=given, scale_schedule_to_run=self.scale_schedule_to_run)

    def finalize(self) -> None:
        """Bridge's finalize hook (``ConfigContainer.validate`` calls it after
        ``process_config_with_overrides``): checks the fields and computes :attr:`ordering_config`
        from their final values, so overrides of ``dataset.recipe``, ``dataset.ordering.*`` and
        ``dataset.*`` take effect."""
        super().finalize()
        self._check_fields()
        self.ordering_config = self._ordering_config(self.run_shape)

    def check_run(self, cfg: Any) -> OrderingConfig:
        """Checks the ordering against Bridge's run and completes it, before any data is read.

        Bridge's ``finalize()`` hook sees only the dataset config, so this runs where the whole
        validated ``ConfigContainer`` is visible: :class:`OrderingResumeCheck` calls it at
        ``on_data_init_start`` (after ``cfg.validate()``, before the datasets are built and
        training starts). Call it yourself after ``runtime_config_update(cfg)`` or
        ``cfg.validate()`` to fail before launching. See :func:`agree_with_run` for the checks;
        with validation requested (``validation.eval_iters`` and ``eval_interval`` > 0 and
        ``do_validation``) the dataset must have a ``val`` split.

        Args:
            cfg: Bridge's validated ``ConfigContainer`` (``data_parallel_size`` set).

        Returns:
            The completed :class:`OrderingConfig` (also stored as :attr:`ordering_config`).
        """
        self._check_fields()
        run = _run_shape(cfg)
        if run.micro_batch_size != self.micro_batch_size:
            raise OrderingConfigError(
                f"OrderingDatasetProvider.micro_batch_size = {self.micro_batch_size}, but Bridge's "
                f"train.micro_batch_size = {run.micro_batch_size}; set dataset.micro_batch_size="
                f"{run.micro_batch_size} (or pass micro_batch_size=cfg.train.micro_batch_size)."
            )
        config = self._ordering_config(run)
        if config.mixture_schedule is not None:
            self._require_sources(list(config.mixture_schedule.sources))
        if run.validation and self.do_validation:
            self._require_split("val")
        self.run_shape, self.ordering_config = run, config
        return config

    def _require_sources(self, sources: list[str]) -> None:
        missing, names = unmatched_sources(self.path, sources)
        if missing:
            given = f"recipe = {show(self.recipe)}" if self.recipe is not None else "ordering"
            raise OrderingConfigError(
                f"OrderingDatasetProvider.{given}: its mixture schedule draws from the sources "
                f"{', '.join(sources)}, but dataset.path = {show(self.path)} has no {', '.join(missing)} "
                f"(its sources: {', '.join(names)}; an entry is named by `subflavors: {{source: "
                "NAME}`, else its folder). Name the metadataset's entries after the schedule's "
                "sources, or give a recipe whose schedule names yours."
            )

    def _require_split(self, split: str) -> None:
        reason = missing_split(self.path, split)
        if reason is not None:
            raise OrderingConfigError(
                f"OrderingDatasetProvider.path = {show(self.path)} has no {show(split)} split "
                f"({reason}), but Bridge asks for validation samples (validation.eval_iters > 0 "
                "with validation.eval_interval set). Set dataset.do_validation=false, or "
                "validation.eval_iters=0, or point dataset.path at a metadataset with a "
                f"{show(split)} split."
            )

    def build_datasets(self, context: DatasetBuildContext) -> tuple[Any | None, Any | None, None]:
        """Bridge's hook: the training and validation loaders (None where Bridge asks for no
        samples), built by Bridge's ``EnergonMultiModalDataModule`` over the data-parallel group
        of ``context.pg_collection``, with the OrderingConfig of the provider's final fields
        (completed by :meth:`check_run` if it ran)."""
        self._check_fields()
        self.ordering_config = config = self._ordering_config(self.run_shape)
        want_valid = self.do_validation and context.valid_samples > 0
        if want_valid:
            self._require_split("val")
        encoder, validation_encoder = self.task_encoder, self.validation_task_encoder
        if self._builtin():  # Bridge's builder, as its EnergonDatasetConfig would; one encoder for both
            encoder = build_builtin_encoder(self.task_encoder, self._builtin_settings(),
                                            path=self.path, micro_batch_size=self.micro_batch_size)
            validation_encoder = validation_encoder if validation_encoder is not None else encoder
        encoder.ordering = config
        if validation_encoder is not None:
            validation_encoder.ordering = config
        self.built_task_encoder = encoder
        datamodule = EnergonMultiModalDataModule(
            path=self.path,
            tokenizer=context.tokenizer,
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            num_workers=self.num_workers,
            num_val_workers=self.num_val_workers,
            pin_memory=self.pin_memory,
            shuffle_buffer_size=self.shuffle_buffer_size,
            max_samples_per_sequence=self.max_samples_per_sequence,
            task_encoder=encoder,
            validation_task_encoder=validation_encoder,
            pg_collection=context.pg_collection,
            **self.dataset_kwargs,
        )
        train = valid = None
        if context.train_samples > 0:
            datamodule.train_dataloader()  # builds the savable loader; we wrap it ourselves
            train = OrderingEnergonDataloader(datamodule.train_dataloader_object,
                                              checked=self.allow_dataloader_restart)
            self.train_loader = train
        if want_valid:
            datamodule.val_dataloader()
            valid = OrderingEnergonDataloader(datamodule.val_dataloader_object, checked=True)
        return train, valid, None


def _ramp_args(train: Any, dp_size: int) -> argparse.Namespace | None:
    """Bridge's ``train.rampup_batch_size`` and batch sizes as the Megatron-LM args
    :func:`~energon_ordering.integrations.megatron_lm.expected_consumed_micro_batches` reads
    (None: no ramp-up, no train config, or a megatron-core that ignores the ramp-up: Bridge
    hands it to core's ``init_num_microbatches_calculator``, which 0.19 ignores)."""
    ramp = getattr(train, "rampup_batch_size", None)
    if not ramp or not core_honours_rampup():
        return None
    return argparse.Namespace(
        rampup_batch_size=list(ramp), global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size, data_parallel_size=dp_size,
        decrease_batch_size_if_needed=bool(getattr(train, "decrease_batch_size_if_needed", False)))


def _run_shape(cfg: Any) -> RunShape:
    """The numbers of Bridge's validated ``ConfigContainer`` the ordering depends on."""
    dp_size = getattr(cfg, "data_parallel_size", None)
    if dp_size is None:
        raise OrderingConfigError(
            "OrderingDatasetProvider.check_run: cfg.data_parallel_size is not set yet; call it "
            "after Bridge's runtime_config_update(cfg) or cfg.validate() (OrderingResumeCheck calls "
            "it at on_data_init_start)."
        )
    train, validation = cfg.train, cfg.validation
    eval_iters = validation.eval_iters or 0
    shape = RunShape(
        micro_batch_size=train.micro_batch_size,
        global_batch_size=train.global_batch_size,
        data_parallel_size=dp_size,
        train_iters=train.train_iters,
        seq_length=getattr(cfg.model, "seq_length", None),
        validation=bool(validation.eval_interval) and eval_iters > 0,
    )
    ramp = _ramp_args(train, dp_size)
    if ramp is None or not train.train_iters:
        return shape
    # the full global batches train_iters ramp-up iterations draw: the steps the schedule counts
    drawn = expected_consumed_micro_batches(ramp, int(train.train_iters))
    return dataclasses.replace(shape, ramp_steps=drawn // shape.micro_batches_per_step)


class OrderingResumeCheck(Callback):
    """Bridge callback: agrees the ordering with the run before data is read, and makes a resume
    loud.

    At ``on_data_init_start`` (after Bridge validated the config, before the datasets are built)
    it calls :meth:`OrderingDatasetProvider.check_run` with Bridge's config: the ordering is
    completed by the run (``micro_batches_per_step``) and every contradiction is refused.

    At ``on_train_start`` (after Bridge's restore), at step > 0 the training loader must have
    been restored (else :class:`DataloaderRestoreError` unless the provider allows a restart),
    and the restored state must have consumed ``step x micro_batches_per_step`` micro-batches
    (under ``train.rampup_batch_size``: what Megatron's num-microbatches calculator draws in
    ``step`` iterations; at the saved data-parallel size for a planned elastic resume).
    ``micro_batches_per_step`` of the ordering config must equal Bridge's ``global_batch_size / (micro_batch_size x data-parallel size)``.

    Args:
        provider: The :class:`OrderingDatasetProvider` set as ``cfg.dataset``.
    """

    def __init__(self, provider: OrderingDatasetProvider):
        self.provider = provider

    def on_data_init_start(self, context: CallbackContext) -> None:
        """Runs :meth:`OrderingDatasetProvider.check_run` on Bridge's validated config."""
        self.provider.check_run(context.state.cfg)

    def on_train_start(self, context: CallbackContext) -> None:
        """Runs the checks; raises :class:`DataloaderRestoreError` or :class:`OrderingConfigError`."""
        provider, loader = self.provider, self.provider.train_loader
        if loader is None:
            return  # this rank builds no training loader
        per_step = provider.ordering_config.micro_batches_per_step
        dp_size = loader._dataloader.worker_config.world_size
        train_cfg = getattr(getattr(context.state, "cfg", None), "train", None)
        if train_cfg is not None:
            bridge_per_step = train_cfg.global_batch_size // (train_cfg.micro_batch_size * dp_size)
            if bridge_per_step != per_step:
                raise OrderingConfigError(
                    f"OrderingConfig.micro_batches_per_step = {per_step}, but Bridge's "
                    f"train.global_batch_size {train_cfg.global_batch_size} / (micro_batch_size "
                    f"{train_cfg.micro_batch_size} x data-parallel size {dp_size}) = "
                    f"{bridge_per_step}; set micro_batches_per_step: {bridge_per_step} in the "
                    "recipe or the provider's `ordering`."
                )
        step = int(context.state.train_state.step)
        loader.checked = True
        if step == 0:
            return
        if loader.restored_state is None:
            msg = (f"Bridge resumed at step {step} but restored no dataloader state (its "
                   "maybe_load_dataloader_state skips a missing dataloader_load folder, "
                   "<checkpoint>/energon by default, without a word).")
            if not provider.allow_dataloader_restart:
                raise DataloaderRestoreError(
                    f"{msg} Refusing to restart the data stream from zero (the run would repeat "
                    "its first samples). Point dataset.dataloader_load at the saved states, or "
                    "set allow_dataloader_restart=True on the OrderingDatasetProvider."
                )
            warnings.warn(f"{msg} allow_dataloader_restart: RESTARTING THE DATA STREAM FROM ZERO.",
                          RuntimeWarning, stacklevel=2)
            return
        saved, counted = saved_stamp(loader.restored_state) or {}, per_step
        elastic = elastic_shape_change(saved, loader_stamp(loader._dataloader) or {})
        if elastic:
            # an elastic resume (planned): the state counts micro-batches of the shape it was saved at
            counted = int(saved.get("micro_batches_per_step", per_step))
        consumed, expected = consumed_micro_batches(loader.restored_state), step * counted
        how = f"step {step} x {counted} micro-batches per step = {expected}"
        ramp = _ramp_args(train_cfg, dp_size)
        if ramp is not None:  # Bridge's iterations draw what Megatron's calculator says
            expected = (expected_at_saved_size(ramp, step, saved) if elastic
                        else expected_consumed_micro_batches(ramp, step))
            how = (f"Megatron's num-microbatches calculator draws {expected} micro-batches in "
                   f"{step} steps with train.rampup_batch_size = {ramp.rampup_batch_size}")
        if consumed != expected:
            raise DataloaderRestoreError(
                f"The restored dataloader state was saved after {consumed} micro-batches, but "
                f"{how}: it belongs to another checkpoint or another batch configuration. Use the "
                "state saved with this checkpoint."
            )
