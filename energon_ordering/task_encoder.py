"""OrderingTaskEncoder: puts the package's ordering stages into Energon's training pipeline."""

from __future__ import annotations

from typing import Any

from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.worker import WorkerConfig

from energon_ordering.config import OrderingConfig
from energon_ordering.errors import OrderingConfigError, OrderingTypeError
from energon_ordering.length_pool_sort import LengthPoolSortDataset
from energon_ordering.sample_length import default_sample_length

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

    The training pipeline becomes ``... -> encode_sample -> LengthPoolSortDataset -> batch ->
    encode_batch``; validation pipelines are left untouched. The sort key is
    :meth:`ordering_sample_length` (override it if your samples carry neither ``total_len`` nor
    ``tokens``). Packing and ``batch_group_criterion`` are not supported together with the pool.
    """

    #: The ordering configuration; the default turns every stage off.
    ordering: OrderingConfig = OrderingConfig()

    _ordering_building_train: bool = False

    def ordering_sample_length(self, sample: Any) -> float:
        """Length of an encoded sample in tokens; the key the pool sorts by."""
        return default_sample_length(sample)

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
        if cfg.length_sort_enabled:
            if kwargs.get("packing_buffer_size") is not None:
                raise OrderingConfigError(
                    f"OrderingConfig.length_sort_pool_size = {cfg.length_sort_pool_size} cannot "
                    f"be combined with packing (packing_buffer_size = "
                    f"{kwargs['packing_buffer_size']}) yet; set one of them off."
                )
            if self._is_overridden(self.batch_group_criterion):  # type: ignore[attr-defined]
                raise OrderingConfigError(
                    f"OrderingConfig.length_sort_pool_size = {cfg.length_sort_pool_size} cannot "
                    f"be combined with {type(self).__name__}.batch_group_criterion yet; remove "
                    "the override or set length_sort_pool_size = 0."
                )
            if cfg.length_sort_mode == "batch" and batch_size is None:
                raise OrderingConfigError(
                    "OrderingConfig.length_sort_mode = 'batch' needs batching; pass batch_size "
                    "to get_train_dataset or use length_sort_mode = 'sample'."
                )
        self._ordering_building_train = True
        try:
            return super().build_train_datasets(batch_size=batch_size, **kwargs)  # type: ignore[misc]
        finally:
            self._ordering_building_train = False

    def build_batch(
        self,
        dataset: SavableDataset,
        *,
        batch_size: int | None,
        worker_config: WorkerConfig,
        **kwargs: Any,
    ) -> SavableDataset:
        cfg = self._ordering_config()
        if self._ordering_building_train and cfg.length_sort_enabled:
            dataset = LengthPoolSortDataset(
                dataset,
                pool_size=cfg.length_sort_pool_size,
                worker_config=worker_config,
                mode=cfg.length_sort_mode,
                batch_size=batch_size,
                key_fn=self.ordering_sample_length,
                seed=cfg.seed,
            )
        return super().build_batch(  # type: ignore[misc]
            dataset, batch_size=batch_size, worker_config=worker_config, **kwargs
        )
