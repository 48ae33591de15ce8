"""OrderingTaskEncoder: puts the package's ordering stages into Energon's training pipeline."""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from collections.abc import Iterator
from typing import Any

from megatron.energon import TaskEncoder, stateless
from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers import (
    EpochizeDataset,
    LogSampleDataset,
    MapDataset,
    RepeatDataset,
    ShuffleBufferDataset,
)

from energon_ordering.config import OrderingConfig
from energon_ordering.errors import OrderingConfigError, OrderingTypeError
from energon_ordering.pool.finite_packing import FinitePackingDataset
from energon_ordering.pipeline.build import TrainBuild, current_build
from energon_ordering.pipeline.plan import (
    DEFER,
    EPOCHIZE,
    KEY_POOL,
    LENGTH_POOL,
    PACK_CAP,
    PACK_POOL,
    PLANNED_PACK,
    PLANNED_SOURCE,
    PLANNED_UNUSED,
    REPEAT,
    SCHEDULED_BLEND,
    SEQ_WARMUP,
    SHUFFLE,
    BuildArgs,
    PipelinePlan,
    packed_step_note,
    plan_pipeline,
    run_samples_per_pack,
    run_window_steps,
    window_repeat_note,
)
from energon_ordering.pipeline.planned_packs import PlannedPackDataset, PlannedPackSourceDataset
from energon_ordering.pipeline.planned_source import PlannedSourceDataset, indexed_lengths
from energon_ordering.pipeline.sources import describe_source, source_label
from energon_ordering.pipeline.stamp import pipeline_stamp
from energon_ordering.pool.finite_shuffle_buffer import FiniteShuffleBufferDataset
from energon_ordering.pool.deferred_load import Defer, DeferredLength, Materialize, split_loader
from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset
from energon_ordering.pool.index_fill import index_fill_problem, index_filled, loader_byte_reader
from energon_ordering.length_index.index import (
    LengthIndex,
    length_index_files,
    task_encoder_label,
)
from energon_ordering.pool.length_pool_sort import LengthPoolSortDataset
from energon_ordering.pool.ffd_pack import first_fit_decreasing
from energon_ordering.pool.pack_pool_sort import PackPoolSortDataset
from energon_ordering.pool.sequence_pack import SequencePack, pack_doc_lengths
from energon_ordering.pool.sample_length import default_sample_length
from energon_ordering.mixture.scheduled_blend import ScheduledBlendDataset
from energon_ordering.warmup.pack_cap import PackCapDataset, PackCapPrePacker, pack_target, round_target
from energon_ordering.warmup.seq_warmup import SeqLenWarmupDataset
from energon_ordering.sample_fields import sample_field, sample_key
from energon_ordering.state_stamp import InputEndDataset, PipelineStampDataset
from energon_ordering.warmup.token_layout import TokenLayout
from energon_ordering.errors import show

__all__ = ["OrderingTaskEncoder"]

logger = logging.getLogger(__name__)


class OrderingTaskEncoder:
    """Mixin that inserts the length pool between ``encode_sample`` and batching, for training.

    Put it before the Energon task encoder in the bases and set ``ordering``::

        class MyTaskEncoder(OrderingTaskEncoder, DefaultTaskEncoder[...]):
            @stateless
            def encode_sample(self, sample): ...

        te = MyTaskEncoder()
        te.ordering = OrderingConfig(length_sort_pool_size=1000, length_sort_mode="batch")
        ds = get_train_dataset(path, batch_size=4, task_encoder=te, worker_config=wc, ...)

    Which stages a training pipeline gets is decided in one place,
    :func:`energon_ordering.pipeline.plan_pipeline` (print its result to see them); the hooks
    below only instantiate what it says. The training pipeline becomes::

        per source: load -> repeat -> shuffle buffer     (only with a mixture schedule)
        -> ScheduledBlendDataset                         (only with a mixture schedule)
        -> encode_sample -> LengthPoolSortDataset        (only with length_sort_pool_size > 0)
        -> SeqLenWarmupDataset                           (only with seq_length_warmup)
        -> InputEndDataset                               (reports the end of the batcher's
                                                          input to the stamp, see state_stamp)
        -> batch -> encode_batch
        -> PipelineStampDataset                          (always: what a restore is checked
                                                          against; see state_stamp)

    Energon's shuffle buffer is replaced by :class:`FiniteShuffleBufferDataset` (same order; a
    finite epoch resumes exactly). With ``length_sort_placement = "pre-encode"`` the pool moves before loading::

        per source: raw tar reader -> Defer          (+ repeat / shuffle buffer / blend as above)
        -> pool of raw samples (or keys only)        lengths from the length index or
                                                     ordering_raw_sample_length
        -> Materialize (Energon's load_sample / cooker: decoding) -> encode_sample
        -> SeqLenWarmupDataset -> batch -> encode_batch

    Validation pipelines are left untouched. With a mixture schedule, each metadataset ``blend:``
    entry is one source, named by its ``subflavors: {source: NAME}`` or else by the last
    component of its dataset path; the metadataset weights are replaced by the schedule. The
    shuffle buffer is applied per source, before the blend, so that a phase switch is not
    delayed by the buffer. Without a schedule Energon's own blend is used unchanged. The sort key is
    :meth:`ordering_sample_length` (override it if your samples carry neither ``total_len`` nor
    ``tokens``). The warmup cuts samples as :attr:`ordering_token_layout` describes (media
    tokens are never cut). The pool sorts by the UNCAPPED length: the cap is applied after the
    pool, at batch time, so the warmup changes batch shapes but never which samples meet in a
    micro-batch or in which order they come; a sample's rank in the pool does not move when its
    cap changes. ``batch_group_criterion`` is not supported together with the pool or the warmup.

    With sequence packing (``packing_buffer_size`` given to ``get_train_dataset``, or
    ``OrderingConfig.packing_buffer_size``) the training pipeline becomes::

        ... -> encode_sample -> [LengthPoolSortDataset]     (pack_pool_placement = "samples")
        -> PackCapDataset -> Energon's PackingDataset        cut to the pack target, then pack
        -> [PackPoolSortDataset]                             (pack_pool_placement = "packs")
        -> InputEndDataset -> batch -> encode_batch

    Your ``select_samples_to_pack`` / ``pack_selected_samples`` are used unchanged; an encoder
    without them packs with :meth:`ordering_select_samples_to_pack` (first-fit decreasing to
    :meth:`ordering_pack_target`) and :meth:`ordering_pack_selected_samples` (a
    :class:`~energon_ordering.pool.sequence_pack.SequencePack`). With the warmup the default
    packer gives each pack the cap of the micro-batch it is emitted in (with the pool of packs
    too: the pool tells where each pack will go and sorts only among positions with one cap);
    see :mod:`energon_ordering.warmup.pack_cap`. Your own packer should read
    :meth:`ordering_pack_target` instead of a constant.
    """

    #: The ordering configuration; the default turns every stage off.
    ordering: OrderingConfig = OrderingConfig()

    #: How the sequence-length warmup cuts this encoder's samples (override per task encoder).
    ordering_token_layout: TokenLayout = TokenLayout()

    #: Fill a key pool (``length_sort_pool_holds = "keys"``) of a source with a length index
    #: from the indexes, reading no payload (:mod:`energon_ordering.pool.index_fill`); the
    #: emitted order is the same either way. False reads every sample during the fill.
    ordering_index_fill: bool = True

    def ordering_sample_length(self, sample: Any) -> float:
        """Length of an encoded sample in tokens; the key the pool sorts by."""
        return default_sample_length(sample)

    def ordering_pack_lengths(self, pack: Any) -> list[int]:
        """Per-document lengths of a packed sample, in tokens; the pool of packs costs packs by
        them. Default: :func:`~energon_ordering.pool.sequence_pack.pack_doc_lengths`
        (``SequencePack.lengths``, or a ``cu_lengths`` / ``cu_seqlens`` field)."""
        return pack_doc_lengths(pack)

    def ordering_pack_target(self) -> int | None:
        """Tokens the pack being built may hold: ``OrderingConfig.pack_seq_length``, capped by
        the warmup's ``max_seq_len`` of the step being built, or, while your
        ``select_samples_to_pack`` runs, of the step its first pack is emitted in (with the
        pool of packs that is a later step; caps never shrink). None: no target configured.
        Call it from your ``select_samples_to_pack`` (it runs in the loader worker)."""
        cfg = self._ordering_config()
        if cfg.seq_length_warmup is None:
            return cfg.pack_seq_length
        target = round_target()
        if target is not None:
            return target
        wc = WorkerConfig.active_worker_config
        if wc is None:
            raise OrderingConfigError(
                f"{type(self).__name__}.ordering_pack_target() is only defined inside an Energon "
                "loader worker (the target depends on the step being built)."
            )
        step = wc.active_worker_batch_index // cfg.micro_batches_per_step
        return pack_target(step, cfg.pack_seq_length, cfg.seq_length_warmup)

    def ordering_select_samples_to_pack(self, samples: list[Any]) -> list[list[Any]]:
        """Default ``select_samples_to_pack``: first-fit decreasing (by
        :meth:`ordering_sample_length`) into packs of :meth:`ordering_pack_target` tokens."""
        target = self.ordering_pack_target()
        if target is None:
            raise OrderingConfigError(
                "OrderingConfig.pack_seq_length = None: the default packer needs a target; set "
                "pack_seq_length (Megatron: --packing-seq-length) or seq_length_warmup."
            )
        lengths = [self.ordering_sample_length(s) for s in samples]
        return [[samples[i] for i in pack] for pack in first_fit_decreasing(lengths, target)]

    @stateless
    def ordering_pack_selected_samples(self, samples: list[Any]) -> SequencePack:
        """Default ``pack_selected_samples``: a :class:`SequencePack` of the documents."""
        sources = [sample_field(s, "__sources__") for s in samples]
        return SequencePack(
            __key__=",".join(str(sample_key(s)) for s in samples),
            __restore_key__=(),
            __subflavors__=None,
            __sources__=tuple(x for src in sources if src for x in src) or None,
            samples=list(samples),
            lengths=[int(self.ordering_sample_length(s)) for s in samples],
        )

    def _ordering_own(self, name: str) -> bool:
        """True if the encoder defines Energon method ``name`` itself (not only TaskEncoder)."""
        return self._is_overridden(getattr(self, name))  # type: ignore[attr-defined]

    @contextlib.contextmanager
    def _ordering_default_packers(self) -> Iterator[None]:
        """Installs the default packing functions where the encoder has none, for one build."""
        installed = []
        for name, default in (
            ("select_samples_to_pack", _DefaultPacker(self, "ordering_select_samples_to_pack")),
            ("pack_selected_samples", _DefaultPacker(self, "ordering_pack_selected_samples")),
        ):
            if not self._ordering_own(name):
                setattr(self, name, default)
                installed.append(name)
        try:
            yield
        finally:
            for name in installed:
                delattr(self, name)

    @contextlib.contextmanager
    def _ordering_postencode_done(self) -> Iterator[None]:
        """Hides ``postencode_sample`` from Energon's batching while the packs (which already ran
        it inside ``PackingDataset``) are batched."""
        if not self._ordering_own("postencode_sample"):
            yield
            return
        self.postencode_sample = types.MethodType(TaskEncoder.postencode_sample, self)
        try:
            yield
        finally:
            del self.postencode_sample

    def ordering_raw_sample_length(self, raw: dict[str, Any]) -> float:
        """Length in tokens of a RAW sample, for ``length_sort_placement = "pre-encode"``
        without a length index: ``raw`` maps file extensions to still-compressed bytes
        (``{"__key__": ..., "jpg": b"...", "txt": b"..."}``). Override it with a cheap estimate
        (e.g. text tokens + images x tokens per image) or build a length index instead."""
        raise NotImplementedError

    def _ordering_has_raw_length(self) -> bool:
        return (
            type(self).ordering_raw_sample_length
            is not OrderingTaskEncoder.ordering_raw_sample_length
        )

    def _ordering_config(self) -> OrderingConfig:
        cfg = self.ordering
        if not isinstance(cfg, OrderingConfig):
            raise OrderingTypeError(
                f"{type(self).__name__}.ordering = {show(cfg)} must be an OrderingConfig; build one "
                "with OrderingConfig(...) or OrderingConfig.from_yaml(path)."
            )
        return cfg

    def ordering_plan(self, *, batch_size: int | None, **kwargs: Any) -> PipelinePlan:
        """The training pipeline this encoder builds for Energon's ``build_train_datasets``
        arguments (validated; print it to see the stages). Reads the datasets' names and
        identities, opens nothing else."""
        cfg = self._ordering_config()
        datasets = kwargs.get("datasets", [])
        worker_config = kwargs.get("worker_config")
        mode = kwargs.get("blend_mode")
        own_select = self._ordering_own("select_samples_to_pack")
        return plan_pipeline(cfg, BuildArgs(
            batch_size=batch_size,
            packing_buffer_size=kwargs.get("packing_buffer_size"),
            shuffle_buffer_size=kwargs.get("shuffle_buffer_size"),
            repeat=kwargs.get("repeat", True),
            blend_mode=getattr(mode, "value", mode) or "none",
            batch_drop_last=kwargs.get("batch_drop_last", False),
            virtual_epoch_length=kwargs.get("virtual_epoch_length", 0),
            num_workers=worker_config.num_workers if worker_config is not None else 0,
            world_size=worker_config.world_size if worker_config is not None else None,
            sources=tuple(
                describe_source(d, named=cfg.mixture_schedule is not None) for d in datasets
            ),
            encoder=type(self).__name__,
            own_select_samples_to_pack=own_select,
            own_batch_group_criterion=self._ordering_own("batch_group_criterion"),
            packer=(self._ordering_packer_name("select_samples_to_pack"),
                    self._ordering_packer_name("pack_selected_samples")),
            index_fill=bool(self.ordering_index_fill),
        ))

    def _ordering_packer_name(self, name: str) -> str:
        """Qualified name of the packing function ``name`` a build uses: the encoder's own, or
        the package's default (``ordering_<name>``)."""
        fn = getattr(self, name if self._ordering_own(name) else f"ordering_{name}")
        return getattr(fn, "__qualname__", None) or type(fn).__qualname__

    def build_train_datasets(self, *, batch_size: int | None, **kwargs: Any) -> SavableDataset:
        """Plans the pipeline (:meth:`ordering_plan`), builds it through Energon's hooks, which
        read the plan from the active :class:`~energon_ordering.pipeline.build.TrainBuild`,
        and stamps it."""
        plan = self.ordering_plan(batch_size=batch_size, **kwargs)
        if plan.packing_buffer_size is not None:
            kwargs["packing_buffer_size"] = plan.packing_buffer_size
        build = TrainBuild(encoder=self, plan=plan)
        with build.active():
            if plan.has(PLANNED_SOURCE):
                dataset = self._build_planned_train(plan, batch_size=batch_size, **kwargs)
            elif plan.has(SCHEDULED_BLEND):
                dataset = self._build_scheduled_train(plan, batch_size=batch_size, **kwargs)
            else:
                dataset = super().build_train_datasets(batch_size=batch_size, **kwargs)  # type: ignore[misc]
        stamp = pipeline_stamp(plan, length_indexes=build.loads.length_indexes,
                               window_steps=build.loads.window_steps)
        return PipelineStampDataset(dataset, stamp=stamp, worker_config=kwargs["worker_config"])

    def _load_dataset(
        self, dataset: Any, worker_rotation_offset: int, worker_config: WorkerConfig
    ) -> SavableDataset:
        """Energon's source loading; with the pre-encode pool, loading is split off and
        deferred until after the pool (see :mod:`energon_ordering.pool.deferred_load`)."""
        loaded = super()._load_dataset(  # type: ignore[misc]
            dataset, worker_rotation_offset, worker_config=worker_config
        )
        build = current_build(self)
        defer = build.plan.stage(DEFER) if build is not None else None
        if defer is None:
            return loaded
        raw, load_fns = split_loader(loaded)
        length_source = self._ordering_length_source(build, dataset.dataset)
        source_index = build.loads.add(load_fns, length_source)
        if (
            defer.kwargs["index_fill"]
            and hasattr(length_source, "length")
            and index_fill_problem(raw) is None
        ):
            # Lengths come from the length index: the fill reads keys and lengths from the
            # indexes only (pool/index_fill.py).
            raw = index_filled(raw, length_source.path, length_source.digest)
        return MapDataset(
            raw,
            Defer(source_index),
            worker_config=worker_config,
            stateless_map_fn=True,
            map_fn_config=dict(defer=source_index),
        )

    def _ordering_length_source(self, build: TrainBuild, factory: Any) -> Any:
        """The length index of a source's dataset (recorded in ``build``), else
        ``ordering_raw_sample_length``."""
        cfg = build.plan.config
        path = getattr(factory, "path", None)
        has_index = path is not None and (
            cfg.length_index is not None
            or bool(length_index_files(path, cfg.length_index_dir))
        )
        if has_index or not self._ordering_has_raw_length():
            if path is None:
                raise OrderingConfigError(
                    f"OrderingConfig.length_sort_placement = 'pre-encode': source {show(factory)} "
                    f"has no dataset path for a length index; override "
                    f"{type(self).__name__}.ordering_raw_sample_length instead."
                )
            mine = task_encoder_label(self)
            # raises if missing, stale, corrupt or of another version
            index = LengthIndex.open(
                path, cfg.length_index, prefer=mine, index_dir=cfg.length_index_dir
            )
            build.loads.add_length_index(index.identity())
            if index.computed_by != mine:
                cls = type(self)
                how = (f"in your training script with `energon_ordering.build_length_index("
                       f"'{path}', task_encoder={cls.__qualname__}())` (an encoder defined in "
                       "the script that runs cannot be imported by the command line)"
                       if cls.__module__ == "__main__" else
                       f"with `energon-ordering index {path} --task-encoder "
                       f"{cls.__module__}:{cls.__qualname__}`")
                warnings.warn(
                    f"length index {index.path} was computed by {index.computed_by}, not by "
                    f"{mine}; the pool sorts by those lengths. For exact lengths build one {how} "
                    "(it is kept next to the others, named after what computed it).",
                    stacklevel=2,
                )
            return index
        return self.ordering_raw_sample_length

    def build_encode_sample(
        self, dataset: SavableDataset, *, worker_config: WorkerConfig
    ) -> SavableDataset:
        build = current_build(self)
        if build is None:
            return super().build_encode_sample(dataset, worker_config=worker_config)  # type: ignore[misc]
        plan = build.plan
        if plan.has(SHUFFLE) and type(dataset) is ShuffleBufferDataset:
            # Energon's buffer forgets that a finite stream ended (see finite_shuffle_buffer).
            dataset = FiniteShuffleBufferDataset(
                dataset.dataset, size=dataset.size, worker_config=worker_config
            )
        pool = plan.stage(KEY_POOL)
        if pool is not None:
            _check_pool_share(pool.kwargs["pool_size"], dataset, worker_config)
            dataset = KeyPoolSortDataset(
                dataset,
                **pool.kwargs,
                worker_config=worker_config,
                key_fn=DeferredLength(build.loads.length_sources),
            )
            dataset = MapDataset(
                dataset,
                Materialize(build.loads.load_fns),
                worker_config=worker_config,
                stateless_map_fn=True,
                map_fn_config=dict(materialize=len(build.loads)),
            )
        return super().build_encode_sample(dataset, worker_config=worker_config)  # type: ignore[misc]

    def _build_scheduled_train(
        self,
        plan: PipelinePlan,
        *,
        datasets: list[Any],
        worker_config: WorkerConfig,
        batch_size: int | None,
        batch_drop_last: bool = False,
        packing_buffer_size: int | None = None,
        virtual_epoch_length: int = 0,
        shuffle_buffer_size: int | None = None,
        blend_mode: Any = None,
        repeat: bool = True,
    ) -> SavableDataset:
        """Energon's build_train_datasets with the scheduled blend after per-source shuffles."""
        names = [s.name for s in plan.args.sources]
        # Same worker rotation as Energon's build_train_datasets, so shards spread evenly.
        global_workers = max(1, worker_config.num_workers) * worker_config.world_size
        offsets, acc = [], 0
        for d in datasets:
            offsets.append(acc % global_workers)
            acc += len(d.dataset)
        shuffle = plan.stage(SHUFFLE)
        sources = []
        for name, d, offset in zip(names, datasets, offsets):
            ds = self._load_dataset(d, offset, worker_config=worker_config)  # type: ignore[attr-defined]
            if plan.has(REPEAT):
                ds = RepeatDataset(ds, worker_config=worker_config)
            if shuffle is not None:
                ds = FiniteShuffleBufferDataset(ds, **shuffle.kwargs, worker_config=worker_config)
            sources.append((name, ds))
        blend = plan.stage(SCHEDULED_BLEND)
        assert blend is not None
        dataset = ScheduledBlendDataset(sources, **blend.kwargs, worker_config=worker_config)
        return self._encode_and_batch_train(
            plan, dataset, worker_config=worker_config, batch_size=batch_size,
            batch_drop_last=batch_drop_last, packing_buffer_size=packing_buffer_size,
        )

    def _encode_and_batch_train(
        self,
        plan: PipelinePlan,
        dataset: SavableDataset,
        *,
        worker_config: WorkerConfig,
        batch_size: int | None,
        batch_drop_last: bool,
        packing_buffer_size: int | None,
        encoded: bool = False,
    ) -> SavableDataset:
        """The tail of Energon's build_train_datasets after the blend, for the pipelines built
        here: encode_sample (unless ``encoded``), batching (with packing), the virtual epoch,
        sample logging."""
        if not encoded:
            dataset = self.build_encode_sample(dataset, worker_config=worker_config)  # type: ignore[attr-defined]
        dataset = self.build_batch(
            dataset,
            batch_size=batch_size,
            batch_drop_last=batch_drop_last,
            packing_buffer_size=packing_buffer_size,
            worker_config=worker_config,
        )
        epochize = plan.stage(EPOCHIZE)
        if epochize is not None:
            dataset = EpochizeDataset(dataset, **epochize.kwargs, worker_config=worker_config)
        if worker_config.should_log(level=1):
            dataset = LogSampleDataset(dataset, mode="train", worker_config=worker_config)
        return dataset

    def _build_planned_train(
        self,
        plan: PipelinePlan,
        *,
        datasets: list[Any],
        worker_config: WorkerConfig,
        batch_size: int | None,
        batch_drop_last: bool = False,
        packing_buffer_size: int | None = None,
        virtual_epoch_length: int = 0,
        shuffle_buffer_size: int | None = None,
        blend_mode: Any = None,
        repeat: bool = True,
    ) -> SavableDataset:
        """The planned global order: :class:`PlannedSourceDataset` over every source (read by
        byte range, decoded by Energon's own load functions), then Energon's encode_sample and
        batching. Energon's slice walk, blend, repeat and shuffle buffer are not built."""
        build = current_build(self)
        assert build is not None
        unused = [f"{name} = {value}" for name, value in (
            ("shuffle_buffer_size", shuffle_buffer_size),
            ("max_samples_per_sequence", [s.max_samples_per_sequence for s in plan.args.sources]),
            ("parallel_shard_iters", [s.parallel_shard_iters for s in plan.args.sources]),
        ) if value not in (None, 0, 1) and value != [None] * len(plan.args.sources)]
        if unused:
            logger.info(
                "length_sort_mode = 'planned': Energon's %s replaced by the plan (%s unused)",
                "/".join(PLANNED_UNUSED), ", ".join(unused))
        readers, loaders, lengths = [], [], []
        for d in datasets:
            loaded = super()._load_dataset(  # type: ignore[misc]
                d, 0, worker_config=worker_config)
            raw, load_fns = split_loader(loaded)
            problem = index_fill_problem(raw)
            if problem is not None:
                raise OrderingConfigError(
                    f"OrderingConfig.length_sort_mode = 'planned' reads samples by byte range, "
                    f"but {raw} cannot be: {problem}; use a pool mode for this dataset.")
            index = self._ordering_length_source(build, d.dataset)
            if not isinstance(index, LengthIndex):
                raise OrderingConfigError(
                    f"OrderingConfig.length_sort_mode = 'planned' plans from a length index, "
                    f"and {show(d.dataset)} has none; build it with `energon-ordering index "
                    f"{getattr(d.dataset, 'path', '<dataset>')}`.")
            reader = loader_byte_reader(raw, index.path, index.digest, cache_shards=16)
            readers.append(reader)
            loaders.append(load_fns)
            lengths.append(indexed_lengths(reader, getattr(d.dataset, "path", d.dataset)))
        source = plan.stage(PLANNED_SOURCE)
        assert source is not None
        kw = dict(source.kwargs)
        packs = plan.stage(PLANNED_PACK)
        cls = PlannedSourceDataset
        spp = None
        if packs is not None:
            cls = PlannedPackSourceDataset
            # a packed window's default steps depend on how many samples a pack holds
            spp = run_samples_per_pack(plan.config, plan.args, lengths)
            if (note := packed_step_note(plan.config, plan.args, spp)) is not None:
                logger.warning(note)
            logger.info(
                "length_sort_mode = 'planned' with packing: the plan builds every pack "
                "(packing_buffer_size = %s and %s unused); %s packs each",
                packing_buffer_size, plan.args.packer[0], plan.args.packer[1])
        # the default window reads the length index: the samples a pack holds, and each
        # source's size (on repeating data no window draws a source beyond one epoch of it)
        k = run_window_steps(plan.config, plan.args, lengths, packs is not None, spp)
        if k != kw["window_steps"]:
            logger.info(
                "length_sort_mode = 'planned': a plan window holds %d steps rather than %d, "
                "read off the length index (no window draws a source of repeating data beyond "
                "its size%s; set plan_window_steps to choose)", k, kw["window_steps"],
                ", and a packed window's planning holds about 53 bytes a sample"
                if packs is not None else "")
        names = [source_label(d) for d in datasets]
        if (note := window_repeat_note(plan.config, plan.args, lengths, k, spp,
                                       names=names)) is not None:
            logger.warning(note)
        kw["window_steps"] = build.loads.window_steps = k
        dataset: SavableDataset = cls(readers, loaders, lengths, **kw, worker_config=worker_config)
        if packs is None:
            return self._encode_and_batch_train(
                plan, dataset, worker_config=worker_config, batch_size=batch_size,
                batch_drop_last=batch_drop_last, packing_buffer_size=None,
            )
        dataset = self.build_encode_sample(dataset, worker_config=worker_config)  # type: ignore[attr-defined]
        with self._ordering_default_packers():
            final_packer = self.pack_selected_samples  # type: ignore[attr-defined]
        dataset = PlannedPackDataset(
            dataset, final_packer=final_packer, layout=self.ordering_token_layout,
            sample_encoder=(self.postencode_sample  # type: ignore[attr-defined]
                            if self._ordering_own("postencode_sample") else None),
            length_fn=self.ordering_sample_length,
            **packs.kwargs, worker_config=worker_config)
        return self._encode_and_batch_train(
            plan, dataset, worker_config=worker_config, batch_size=batch_size,
            batch_drop_last=batch_drop_last, packing_buffer_size=None, encoded=True,
        )

    def build_batch(
        self,
        dataset: SavableDataset,
        *,
        batch_size: int | None,
        worker_config: WorkerConfig,
        packing_buffer_size: int | None = None,
        **kwargs: Any,
    ) -> SavableDataset:
        build = current_build(self)
        if build is None:  # not a training build (validation): Energon's batching unchanged
            return super().build_batch(  # type: ignore[misc]
                dataset, batch_size=batch_size, worker_config=worker_config,
                packing_buffer_size=packing_buffer_size, **kwargs
            )
        plan = build.plan
        if plan.has(PLANNED_PACK):  # the plan's packs, packed already (PlannedPackDataset)
            dataset = InputEndDataset(dataset, worker_config=worker_config)
            with self._ordering_postencode_done():
                return super().build_batch(  # type: ignore[misc]
                    dataset, batch_size=batch_size, worker_config=worker_config,
                    packing_buffer_size=None, **kwargs
                )
        pool = plan.stage(LENGTH_POOL)
        if pool is not None:
            _check_pool_share(pool.kwargs["pool_size"], dataset, worker_config)
            dataset = LengthPoolSortDataset(
                dataset, **pool.kwargs, worker_config=worker_config,
                key_fn=self.ordering_sample_length,
            )
        if plan.packing_buffer_size is not None:
            with self._ordering_default_packers():
                return self._ordering_build_packing(
                    plan, dataset, batch_size=batch_size, worker_config=worker_config,
                    packing_buffer_size=packing_buffer_size, **kwargs
                )
        warmup = plan.stage(SEQ_WARMUP)
        if warmup is not None:
            dataset = SeqLenWarmupDataset(
                dataset, **warmup.kwargs, worker_config=worker_config,
                layout=self.ordering_token_layout,
            )
        # the last, partial batch of a finite epoch goes out after its input has ended
        dataset = InputEndDataset(dataset, worker_config=worker_config)
        return super().build_batch(  # type: ignore[misc]
            dataset, batch_size=batch_size, worker_config=worker_config,
            packing_buffer_size=packing_buffer_size, **kwargs
        )

    def _ordering_build_packing(
        self,
        plan: PipelinePlan,
        dataset: SavableDataset,
        *,
        batch_size: int | None,
        worker_config: WorkerConfig,
        packing_buffer_size: int,
        **kwargs: Any,
    ) -> SavableDataset:
        """Pack cap -> Energon's PackingDataset (the encoder's packers) -> [pool of packs] ->
        Energon's batching."""
        cap_stage, pool_stage = plan.stage(PACK_CAP), plan.stage(PACK_POOL)
        assert cap_stage is not None
        default_packer = isinstance(getattr(self, "select_samples_to_pack"), _DefaultPacker)
        cap = PackCapDataset(
            dataset,
            **cap_stage.kwargs,
            worker_config=worker_config,
            layout=self.ordering_token_layout,
        )
        # Energon builds the PackingDataset exactly as without ordering (batch_size=None: the
        # packs only); the pre-packer is then wrapped to cut the buffer to the pack target.
        packed = super().build_batch(  # type: ignore[misc]
            cap, batch_size=None, worker_config=worker_config,
            packing_buffer_size=packing_buffer_size,
        )
        # Energon's packer, resumable at the end of a finite epoch; the pre-packer cuts the
        # buffer to the pack target and holds every pack to its emission step's target
        packed = FinitePackingDataset.replacing(packed, epoch_end=cap.end_epoch)
        packed.pre_packer = PackCapPrePacker(
            packed.pre_packer, cap, length_fn=self.ordering_sample_length,
            bin_packer=first_fit_decreasing, packs_itself=default_packer,
            target_attribute=None if default_packer else _packer_target_attribute(self),
        )
        if pool_stage is not None:
            # under the warmup the pool tells the packer where each pack goes, and sorts only
            # among positions with one cap: every pack is built to its emission step's cap
            capped = cap_stage.kwargs["warmup"] is not None
            packed = PackPoolSortDataset(
                packed,
                **pool_stage.kwargs,
                worker_config=worker_config,
                doc_lengths=self.ordering_pack_lengths,
                batch_cap=cap.batch_target if capped else None,
            )
            if capped:
                cap.plan_emission(packed.upcoming_batch_indices)
        # the last, partial batch of a finite epoch goes out after its input has ended
        packed = InputEndDataset(packed, worker_config=worker_config)
        with self._ordering_postencode_done():
            return super().build_batch(  # type: ignore[misc]
                packed, batch_size=batch_size, worker_config=worker_config,
                packing_buffer_size=None, **kwargs
            )


class _DefaultPacker:
    """One of the encoder's default packing functions, handed to Energon's PackingDataset for an
    encoder without its own (a plain callable, so Energon takes it as provided; it keeps the
    encoder, not a method name, so it survives pickling into loader workers)."""

    def __init__(self, encoder: OrderingTaskEncoder, method: str):
        self.encoder = encoder
        self.method = method
        self.__qualname__ = f"{type(encoder).__qualname__}.{method}"
        fn = getattr(type(encoder), method)
        self.__stateless__ = bool(getattr(fn, "__stateless__", False))

    def __call__(self, samples: list[Any]) -> Any:
        return getattr(self.encoder, self.method)(samples)

    def __repr__(self) -> str:
        return self.__qualname__


def _packer_target_attribute(encoder: Any) -> tuple[Any, str] | None:
    """Where a user's packer reads its pack length: Megatron-LM's ``examples/multimodal``
    encoder packs with ``greedy_knapsack(..., self.packing_seq_length)``, so during the warmup
    that attribute holds the round's target while ``select_samples_to_pack`` runs."""
    return (encoder, "packing_seq_length") if hasattr(encoder, "packing_seq_length") else None


def _check_pool_share(pool_size: int, dataset: SavableDataset, worker_config: WorkerConfig) -> None:
    """Refuses a pool larger than a loader worker's share of repeating data: it would only fill
    after many epochs, holding every sample meanwhile (no emission, growing memory)."""
    if not _repeats(dataset):
        return
    shares = [dataset.len_worker(w) for w in range(max(1, worker_config.num_workers))]
    share = min(shares)
    if 0 < share < pool_size:
        raise OrderingConfigError(
            f"OrderingConfig.length_sort_pool_size = {pool_size} is larger than a "
            f"loader worker's share of the data ({share} samples per epoch for rank "
            f"{worker_config.rank}, {max(1, worker_config.num_workers)} worker(s)); with repeating "
            f"data the pool would fill only after several epochs. Use length_sort_pool_size <= "
            f"{share}, fewer loader workers or data-parallel ranks, or more data."
        )


def _repeats(dataset: Any) -> bool:
    """True if a RepeatDataset without a repetition count sits in ``dataset``'s pipeline."""
    stack = [dataset]
    while stack:
        ds = stack.pop()
        if isinstance(ds, RepeatDataset) and ds.repeats is None:
            return True
        stack.extend(getattr(ds, "datasets", None) or [])
    return False
