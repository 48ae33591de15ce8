"""OrderingTaskEncoder: puts the package's ordering stages into Energon's training pipeline."""

from __future__ import annotations

import contextlib
import types
import hashlib
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
from energon_ordering.pool.finite_shuffle_buffer import FiniteShuffleBufferDataset
from energon_ordering.pool.deferred_load import Defer, DeferredLength, Materialize, split_loader
from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset
from energon_ordering.pool.index_fill import index_fill_problem, index_filled
from energon_ordering.pool.order import BATCHED_MODES
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
from energon_ordering.source_tag import SOURCE_KEY
from energon_ordering.state_stamp import InputEndDataset, PipelineStampDataset
from energon_ordering.warmup.token_layout import TokenLayout

__all__ = ["OrderingTaskEncoder"]


class OrderingTaskEncoder:
    """Mixin that inserts the length pool between ``encode_sample`` and batching, for training.

    Put it before the Energon task encoder in the bases and set ``ordering``::

        class MyTaskEncoder(OrderingTaskEncoder, DefaultTaskEncoder[...]):
            @stateless
            def encode_sample(self, sample): ...

        te = MyTaskEncoder()
        te.ordering = OrderingConfig(length_sort_pool_size=1000, length_sort_mode="batch")
        ds = get_train_dataset(path, batch_size=4, task_encoder=te, worker_config=wc, ...)

    The training pipeline becomes::

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

    _ordering_building_train: bool = False
    #: While a pre-encode pipeline is built: per source, its load functions and length source.
    _ordering_deferred: list[tuple[list[Any], Any]] | None = None
    _ordering_batch_size: int | None = None
    _ordering_packing_buffer_size: int | None = None
    #: While a pre-encode pipeline is built: the identity of each length index it sorts by.
    _ordering_length_indexes: list[dict[str, Any]] | None = None

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

    def _ordering_pre_encode(self) -> bool:
        cfg = self._ordering_config()
        return (
            self._ordering_building_train
            and cfg.length_sort_enabled
            and cfg.length_sort_placement == "pre-encode"
            and not (self._ordering_packing_buffer_size is not None
                     and cfg.pack_pool_placement == "packs")
        )

    def _ordering_config(self) -> OrderingConfig:
        cfg = self.ordering
        if not isinstance(cfg, OrderingConfig):
            raise OrderingTypeError(
                f"{type(self).__name__}.ordering = {cfg!r} must be an OrderingConfig; build one "
                "with OrderingConfig(...) or OrderingConfig.from_yaml(path)."
            )
        return cfg

    def build_train_datasets(self, *, batch_size: int | None, **kwargs: Any) -> SavableDataset:
        cfg = self._ordering_config()
        stages = []
        if cfg.length_sort_enabled:
            stages.append(f"length_sort_pool_size = {cfg.length_sort_pool_size}")
        if cfg.seq_length_warmup is not None:
            stages.append("seq_length_warmup")
        packing = kwargs.get("packing_buffer_size")
        if cfg.packing_buffer_size is not None:
            if packing is not None and packing != cfg.packing_buffer_size:
                raise OrderingConfigError(
                    f"OrderingConfig.packing_buffer_size = {cfg.packing_buffer_size} contradicts "
                    f"get_train_dataset(packing_buffer_size={packing}); give it once (Megatron: "
                    "--packing-buffer-size)."
                )
            packing = kwargs["packing_buffer_size"] = cfg.packing_buffer_size
        if packing is not None:
            if cfg.length_sort_enabled and cfg.pack_pool_placement == "packs" and (
                cfg.length_sort_placement == "pre-encode"
            ):
                raise OrderingConfigError(
                    "OrderingConfig.pack_pool_placement = 'packs' pools packs after packing, so "
                    "it cannot also sit before encoding (length_sort_placement = 'pre-encode'); "
                    "use pack_pool_placement = 'samples' with the pre-encode pool."
                )
            if (
                not self._ordering_own("select_samples_to_pack")
                and cfg.pack_seq_length is None
                and cfg.seq_length_warmup is None
            ):
                raise OrderingConfigError(
                    f"{type(self).__name__} has no select_samples_to_pack, so packing "
                    f"(packing_buffer_size = {packing}) uses the default first-fit-decreasing "
                    "packer, which needs OrderingConfig.pack_seq_length (Megatron: "
                    "--packing-seq-length); set it or define select_samples_to_pack."
                )
        if stages:
            if self._is_overridden(self.batch_group_criterion):  # type: ignore[attr-defined]
                raise OrderingConfigError(
                    f"OrderingConfig.{' and '.join(stages)} cannot be combined with "
                    f"{type(self).__name__}.batch_group_criterion yet; remove the override or "
                    "turn the ordering stage off."
                )
        if cfg.length_sort_enabled:
            if cfg.length_sort_mode in BATCHED_MODES and batch_size is None:
                raise OrderingConfigError(
                    f"OrderingConfig.length_sort_mode = {cfg.length_sort_mode!r} needs batching; pass batch_size "
                    "to get_train_dataset or use length_sort_mode = 'sample'."
                )
        self._ordering_building_train = True
        self._ordering_deferred = []
        self._ordering_length_indexes = []
        self._ordering_batch_size = batch_size
        self._ordering_packing_buffer_size = packing
        try:
            if cfg.mixture_schedule is not None:
                dataset = self._build_scheduled_train(cfg, batch_size=batch_size, **kwargs)
            else:
                dataset = super().build_train_datasets(batch_size=batch_size, **kwargs)  # type: ignore[misc]
            worker_config = kwargs["worker_config"]
            stamp = _pipeline_stamp(
                cfg,
                datasets=kwargs.get("datasets", []),
                length_indexes=self._ordering_length_indexes,
                lag_batches=self._ordering_lag_batches(cfg, batch_size, worker_config),
                repeat=kwargs.get("repeat", True),
                shuffle_buffer_size=kwargs.get("shuffle_buffer_size"),
            )
            return PipelineStampDataset(dataset, stamp=stamp, worker_config=worker_config)
        finally:
            self._ordering_building_train = False
            self._ordering_deferred = None
            self._ordering_packing_buffer_size = None
            self._ordering_length_indexes = None

    @staticmethod
    def _ordering_lag_batches(
        cfg: OrderingConfig, batch_size: int | None, worker_config: WorkerConfig
    ) -> float:
        """Rank-level batches the scheduled blend looks ahead (lag compensation); 0 if off."""
        if not (cfg.length_sort_enabled and cfg.schedule_lag_compensation):
            return 0.0
        per_batch = batch_size or 1
        lag = (cfg.length_sort_pool_size / per_batch - 1) / 2 * max(1, worker_config.num_workers)
        return max(0.0, lag)

    def _load_dataset(
        self, dataset: Any, worker_rotation_offset: int, worker_config: WorkerConfig
    ) -> SavableDataset:
        """Energon's source loading; with the pre-encode pool, loading is split off and
        deferred until after the pool (see :mod:`energon_ordering.pool.deferred_load`)."""
        loaded = super()._load_dataset(  # type: ignore[misc]
            dataset, worker_rotation_offset, worker_config=worker_config
        )
        if not self._ordering_pre_encode():
            return loaded
        assert self._ordering_deferred is not None
        raw, load_fns = split_loader(loaded)
        source_index = len(self._ordering_deferred)
        length_source = self._ordering_length_source(dataset.dataset)
        self._ordering_deferred.append((load_fns, length_source))
        if (
            self.ordering_index_fill
            and self._ordering_config().length_sort_pool_holds == "keys"
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

    def _ordering_length_source(self, factory: Any) -> Any:
        """The length index of a source's dataset, else ``ordering_raw_sample_length``."""
        cfg = self._ordering_config()
        path = getattr(factory, "path", None)
        has_index = path is not None and (
            cfg.length_index is not None
            or bool(length_index_files(path, cfg.length_index_dir))
        )
        if has_index or not self._ordering_has_raw_length():
            if path is None:
                raise OrderingConfigError(
                    f"OrderingConfig.length_sort_placement = 'pre-encode': source {factory!r} "
                    f"has no dataset path for a length index; override "
                    f"{type(self).__name__}.ordering_raw_sample_length instead."
                )
            mine = task_encoder_label(self)
            # raises if missing, stale, corrupt or of another version
            index = LengthIndex.open(
                path, cfg.length_index, prefer=mine, index_dir=cfg.length_index_dir
            )
            if self._ordering_length_indexes is not None:
                self._ordering_length_indexes.append(index.identity())
            if index.computed_by != mine:
                warnings.warn(
                    f"length index {index.path} was computed by {index.computed_by}, not by "
                    f"{mine}; the pool sorts by those lengths. For exact lengths build one with "
                    f"`energon-ordering index {path} --task-encoder {type(self).__module__}:"
                    f"{type(self).__qualname__}` (it is kept next to the others, named after "
                    "what computed it).",
                    stacklevel=2,
                )
            return index
        return self.ordering_raw_sample_length

    def build_encode_sample(
        self, dataset: SavableDataset, *, worker_config: WorkerConfig
    ) -> SavableDataset:
        if self._ordering_building_train and type(dataset) is ShuffleBufferDataset:
            # Energon's buffer forgets that a finite stream ended (see finite_shuffle_buffer).
            dataset = FiniteShuffleBufferDataset(
                dataset.dataset, size=dataset.size, worker_config=worker_config
            )
        if self._ordering_pre_encode():
            _check_pool_share(self._ordering_config(), dataset, worker_config)
            cfg = self._ordering_config()
            assert self._ordering_deferred is not None
            dataset = KeyPoolSortDataset(
                dataset,
                pool_size=cfg.length_sort_pool_size,
                worker_config=worker_config,
                key_fn=DeferredLength([length for _, length in self._ordering_deferred]),
                mode=cfg.length_sort_mode,
                batch_size=self._ordering_batch_size,
                seed=cfg.seed,
                keep_samples=cfg.length_sort_pool_holds == "raw",
            )
            dataset = MapDataset(
                dataset,
                Materialize([fns for fns, _ in self._ordering_deferred]),
                worker_config=worker_config,
                stateless_map_fn=True,
                map_fn_config=dict(materialize=len(self._ordering_deferred)),
            )
        return super().build_encode_sample(dataset, worker_config=worker_config)  # type: ignore[misc]

    def _build_scheduled_train(
        self,
        cfg: OrderingConfig,
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
        schedule = cfg.mixture_schedule
        assert schedule is not None
        names = [_source_name(d) for d in datasets]
        epochized = [n for n, d in zip(names, datasets) if d.repetitions not in (None, 1)]
        if epochized:
            raise OrderingConfigError(
                f"OrderingConfig.mixture_schedule replaces the metadataset's blend, but the "
                f"entries {epochized} use `blend_epochized` repetitions, which a step schedule "
                "cannot honour; use `blend:` with weights (they are replaced by the schedule)."
            )
        if len(set(names)) != len(names):
            raise OrderingConfigError(
                f"OrderingConfig.mixture_schedule: metadataset entries share source names "
                f"{names}; give each blend entry its own `subflavors: {{{SOURCE_KEY}: NAME}}`."
            )
        # Same worker rotation as Energon's build_train_datasets, so shards spread evenly.
        global_workers = max(1, worker_config.num_workers) * worker_config.world_size
        offsets, acc = [], 0
        for d in datasets:
            offsets.append(acc % global_workers)
            acc += len(d.dataset)
        sources = []
        for name, d, offset in zip(names, datasets, offsets):
            ds = self._load_dataset(d, offset, worker_config=worker_config)  # type: ignore[attr-defined]
            if repeat:
                ds = RepeatDataset(ds, worker_config=worker_config)
            if shuffle_buffer_size is not None and shuffle_buffer_size > 1:
                ds = FiniteShuffleBufferDataset(
                    ds, size=shuffle_buffer_size, worker_config=worker_config
                )
            sources.append((name, ds))
        lag = self._ordering_lag_batches(cfg, batch_size, worker_config)
        dataset: SavableDataset = ScheduledBlendDataset(
            sources,
            schedule=schedule,
            worker_config=worker_config,
            micro_batches_per_step=cfg.micro_batches_per_step,
            batch_size=batch_size,
            policy=cfg.blend_policy,
            lag_batches=lag,
            allow_schedule_change=cfg.allow_schedule_change,
        )
        dataset = self.build_encode_sample(dataset, worker_config=worker_config)  # type: ignore[attr-defined]
        dataset = self.build_batch(
            dataset,
            batch_size=batch_size,
            batch_drop_last=batch_drop_last,
            packing_buffer_size=packing_buffer_size,
            worker_config=worker_config,
        )
        if virtual_epoch_length > 0:
            dataset = EpochizeDataset(dataset, length=virtual_epoch_length, worker_config=worker_config)
        if worker_config.should_log(level=1):
            dataset = LogSampleDataset(dataset, mode="train", worker_config=worker_config)
        return dataset

    def build_batch(
        self,
        dataset: SavableDataset,
        *,
        batch_size: int | None,
        worker_config: WorkerConfig,
        packing_buffer_size: int | None = None,
        **kwargs: Any,
    ) -> SavableDataset:
        cfg = self._ordering_config()
        train = self._ordering_building_train
        packing = train and packing_buffer_size is not None
        pool_of_packs = packing and cfg.pack_pool_placement == "packs"
        if train and cfg.length_sort_placement == "post-encode" and cfg.length_sort_enabled and (
            not pool_of_packs
        ):
            _check_pool_share(cfg, dataset, worker_config)
            dataset = LengthPoolSortDataset(
                dataset,
                pool_size=cfg.length_sort_pool_size,
                worker_config=worker_config,
                mode=cfg.length_sort_mode,
                batch_size=batch_size,
                key_fn=self.ordering_sample_length,
                seed=cfg.seed,
            )
        if packing:
            with self._ordering_default_packers():
                return self._ordering_build_packing(
                    cfg, dataset, batch_size=batch_size, worker_config=worker_config,
                    packing_buffer_size=packing_buffer_size, **kwargs
                )
        if train and cfg.seq_length_warmup is not None:
            dataset = SeqLenWarmupDataset(
                dataset,
                warmup=cfg.seq_length_warmup,
                worker_config=worker_config,
                micro_batches_per_step=cfg.micro_batches_per_step,
                overflow=cfg.seq_length_overflow,
                layout=self.ordering_token_layout,
            )
        if train:
            # the last, partial batch of a finite epoch goes out after its input has ended
            dataset = InputEndDataset(dataset, worker_config=worker_config)
        return super().build_batch(  # type: ignore[misc]
            dataset, batch_size=batch_size, worker_config=worker_config,
            packing_buffer_size=packing_buffer_size, **kwargs
        )

    def _ordering_build_packing(
        self,
        cfg: OrderingConfig,
        dataset: SavableDataset,
        *,
        batch_size: int | None,
        worker_config: WorkerConfig,
        packing_buffer_size: int,
        **kwargs: Any,
    ) -> SavableDataset:
        """Pack cap -> Energon's PackingDataset (the encoder's packers) -> [pool of packs] ->
        Energon's batching."""
        pool_of_packs = cfg.length_sort_enabled and cfg.pack_pool_placement == "packs"
        default_packer = isinstance(getattr(self, "select_samples_to_pack"), _DefaultPacker)
        cap = PackCapDataset(
            dataset,
            worker_config=worker_config,
            pack_seq_length=cfg.pack_seq_length,
            warmup=cfg.seq_length_warmup,
            micro_batches_per_step=cfg.micro_batches_per_step,
            overflow=cfg.seq_length_overflow,
            layout=self.ordering_token_layout,
            batch_size=batch_size or 1,
            # packs go straight to the batcher in creation order: each gets its own step's cap
            per_pack_targets=default_packer and not pool_of_packs,
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
        if pool_of_packs:
            # under the warmup the pool tells the packer where each pack goes, and sorts only
            # among positions with one cap: every pack is built to its emission step's cap
            capped = cfg.seq_length_warmup is not None
            packed = PackPoolSortDataset(
                packed,
                pool_size=cfg.length_sort_pool_size,
                worker_config=worker_config,
                mode=cfg.length_sort_mode,
                batch_size=(batch_size or 1) if capped else batch_size,
                doc_lengths=self.ordering_pack_lengths,
                seed=cfg.seed,
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


def _source_name(loaded: Any) -> str:
    """A metadataset entry's source name: ``subflavors.source``, else its folder name."""
    factory = loaded.dataset
    subflavors = getattr(factory, "subflavors", None) or {}
    if subflavors.get(SOURCE_KEY):
        return str(subflavors[SOURCE_KEY])
    path = getattr(factory, "path", None)
    if path is None:
        raise OrderingConfigError(
            f"OrderingConfig.mixture_schedule: cannot name the metadataset entry {factory!r}; "
            f"give it `subflavors: {{{SOURCE_KEY}: NAME}}`."
        )
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def _check_pool_share(cfg: OrderingConfig, dataset: SavableDataset, worker_config: WorkerConfig) -> None:
    """Refuses a pool larger than a loader worker's share of repeating data: it would only fill
    after many epochs, holding every sample meanwhile (no emission, growing memory)."""
    if not _repeats(dataset):
        return
    shares = [dataset.len_worker(w) for w in range(max(1, worker_config.num_workers))]
    share = min(shares)
    if 0 < share < cfg.length_sort_pool_size:
        raise OrderingConfigError(
            f"OrderingConfig.length_sort_pool_size = {cfg.length_sort_pool_size} is larger than a "
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


def _dataset_identity(loaded: Any) -> dict[str, Any]:
    """A metadataset entry's identity: Energon's ``index.uuid``, a digest of its split (shard
    names and sample counts, excludes) and the loading settings that decide its stream."""
    factory = loaded.dataset
    path = getattr(factory, "path", None)
    uuid = None
    if path is not None:
        try:
            uuid = (path / ".nv-meta" / "index.uuid").read_text().strip()
        except (OSError, TypeError):
            uuid = None
    shards = getattr(factory, "shards", None) or []
    split = hashlib.sha1(
        repr(
            (
                [(str(getattr(s, "name", s)), int(getattr(s, "count", 0))) for s in shards],
                sorted(str(x) for x in (getattr(factory, "sample_excludes", None) or ())),
                repr(getattr(factory, "subset", None)),
            )
        ).encode()
    ).hexdigest()[:16]
    return {
        "uuid": uuid,
        "split": split,
        "max_samples_per_sequence": getattr(factory, "max_samples_per_sequence", None),
        "shuffle_over_epochs": getattr(factory, "shuffle_over_epochs", None),
        "parallel_shard_iters": getattr(factory, "parallel_shard_iters", None),
        "repetitions": getattr(loaded, "repetitions", None),
    }


def _pipeline_stamp(
    cfg: OrderingConfig,
    *,
    datasets: list[Any],
    length_indexes: list[dict[str, Any]] | None,
    lag_batches: float,
    repeat: bool,
    shuffle_buffer_size: int | None,
) -> dict[str, Any]:
    """What a training pipeline's continuation depends on besides rank, world size and
    num_workers (which :class:`PipelineStampDataset` adds); plain builtin values only. A
    setting whose stage is off is stamped as None, so changing it is not refused."""
    pool = cfg.length_sort_enabled
    schedule = cfg.mixture_schedule
    warmup = cfg.seq_length_warmup
    step_based = schedule is not None or warmup is not None
    ids = [_dataset_identity(d) for d in datasets]
    return {
        "datasets": [{k: v for k, v in i.items() if k in ("uuid", "split")} for i in ids],
        "max_samples_per_sequence": [i["max_samples_per_sequence"] for i in ids],
        "shuffle_over_epochs": [i["shuffle_over_epochs"] for i in ids],
        "parallel_shard_iters": [i["parallel_shard_iters"] for i in ids],
        "repeat": bool(repeat),
        "shuffle_buffer_size": shuffle_buffer_size if (shuffle_buffer_size or 0) > 1 else None,
        "length_sort_pool_size": cfg.length_sort_pool_size,
        "length_sort_mode": cfg.length_sort_mode if pool else None,
        "length_sort_placement": cfg.length_sort_placement if pool else None,
        "seed": cfg.seed if pool else None,
        "length_index": list(length_indexes) if length_indexes else None,
        "mixture_schedule": list(schedule.sources) if schedule is not None else None,
        "blend_policy": cfg.blend_policy if schedule is not None else None,
        "seq_length_warmup": warmup.to_dict() if warmup is not None else None,
        "seq_length_overflow": cfg.seq_length_overflow if warmup is not None else None,
        "micro_batches_per_step": cfg.micro_batches_per_step if step_based else None,
        "schedule_lag_compensation": (
            cfg.schedule_lag_compensation if schedule is not None and pool else None
        ),
        "schedule_lag_batches": float(lag_batches) if schedule is not None else None,
    }
