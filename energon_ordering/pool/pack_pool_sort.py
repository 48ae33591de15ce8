"""PackPoolSortDataset: a pool of packs after Energon's packing, sorted by cost and permuted with
the rank-independent seed.

With sequence packing every micro-batch holds about the same number of tokens; what still
differs across data-parallel ranks is the attention cost inside the packed documents,
``sum(L + L**2 / 4096)`` per pack (:func:`~energon_ordering.pool.pack_order.pack_cost`). This pool
sits between Energon's ``PackingDataset`` and the batcher, collects ``pool_size`` packs, sorts
them by cost and emits them in the order of :mod:`energon_ordering.pool.order` computed on the
costs, with the seed of (ordering seed, pool index, loader worker slot), never the rank: the
i-th pack of every rank comes from the same cost quantile.

It is the encoded pool (:class:`~energon_ordering.pool.length_pool_sort.LengthPoolSortDataset`)
keyed by pack cost, with its own stamp; pooled packs are saved as Energon's pack restore keys
(the restore keys of the packed samples) and rebuilt by ``PackingDataset.restore_sample``, so
``pack_selected_samples`` must be ``@stateless`` (checked at construction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.worker import WorkerConfig

from energon_ordering.pool.length_pool_sort import LengthPoolSortDataset
from energon_ordering.pool.pack_order import pack_cost
from energon_ordering.pool.sequence_pack import pack_doc_lengths

__all__ = ["PackCost", "PackPoolSortDataset"]

T_sample = TypeVar("T_sample")

#: Version of the pack pool's logic (on top of the encoded pool's); bumped on any order change.
PACK_STATE_VERSION = 1


class PackCost:
    """Key function: the cost ``sum(L + L**2 / 4096)`` of a pack, from its document lengths."""

    def __init__(self, doc_lengths: Callable[[Any], Sequence[float]] = pack_doc_lengths):
        self.doc_lengths = doc_lengths

    def __call__(self, pack: Any) -> float:
        return pack_cost(self.doc_lengths(pack))

    def __repr__(self) -> str:
        return f"PackCost({getattr(self.doc_lengths, '__qualname__', self.doc_lengths)!r})"


class PackPoolSortDataset(LengthPoolSortDataset[T_sample], Generic[T_sample]):
    """Pools ``pool_size`` packs, sorts them by cost and permutes them identically on all ranks.

    Place it after Energon's ``PackingDataset`` and before batching (``OrderingTaskEncoder`` does
    with ``OrderingConfig.pack_pool_placement = "packs"``). Same contracts as the encoded pool:
    deterministic, finite if the packs are, exact resume, stamped state.
    """

    def __init__(
        self,
        dataset: SavableDataset[T_sample],
        *,
        pool_size: int,
        worker_config: WorkerConfig,
        mode: str = "sample",
        batch_size: int | None = None,
        doc_lengths: Callable[[Any], Sequence[float]] = pack_doc_lengths,
        seed: int = 0,
    ):
        """Construct a PackPoolSortDataset.

        Args:
            dataset: Packs (Energon's ``PackingDataset``; its final packer must be stateless).
            pool_size: Packs per pool, per loader worker (>= 1).
            worker_config: Energon's worker configuration.
            mode: ``"sample"`` (permute packs) or ``"batch"`` (permute sorted chunks of
                ``batch_size`` packs).
            batch_size: Packs per micro-batch; required for ``mode="batch"``.
            doc_lengths: Per-document lengths of a pack, in tokens (default:
                :func:`~energon_ordering.pool.sequence_pack.pack_doc_lengths`).
            seed: Ordering seed; must be the same on every data-parallel rank.
        """
        super().__init__(
            dataset,
            pool_size=pool_size,
            worker_config=worker_config,
            mode=mode,
            batch_size=batch_size,
            key_fn=PackCost(doc_lengths),
            seed=seed,
        )

    def _expected_stamp(self) -> dict[str, Any]:
        return {
            **super()._expected_stamp(),
            "holds": "packs",
            "pack_state_version": PACK_STATE_VERSION,
            "key": "pack cost sum(L + L^2/4096)",
        }

    def __str__(self) -> str:
        return (
            f"PackPoolSortDataset(pool_size={self.pool_size}, mode={self.mode!r}, "
            f"batch_size={self.batch_size}, seed={self.seed}, dataset={self.dataset})"
        )
