"""PackPoolSortDataset: a pool of packs after Energon's packing, sorted by cost and permuted with
the rank-independent seed.

With sequence packing every micro-batch holds about the same number of tokens; what still
differs across data-parallel ranks is the attention cost inside the packed documents,
``sum(L + L**2 / 4096)`` per pack (:func:`~energon_ordering.pool.pack_order.pack_cost`). This pool
sits between Energon's ``PackingDataset`` and the batcher, collects ``pool_size`` packs, sorts
them by cost and emits them in the order of :mod:`energon_ordering.pool.order` computed on the
costs, with the seed of (ordering seed, pool index, loader worker slot), never the rank: the
i-th pack of every rank comes from the same cost quantile.

Under the sequence-length warmup (``batch_cap`` given) the pool knows where each pack will go:
a pool fills within one micro-batch (the batcher's request for its first pack), then drains in
order, so the pack arriving at position q of the pool being filled is emitted in micro-batch
``b0 + ((offset + q) // batch_size) * num_workers`` of the rank, where ``b0`` is the micro-batch
being built during the fill and ``offset`` the packs it already holds
(:func:`~energon_ordering.pool.pack_order.emission_batch`).
The packer below asks for these positions (:meth:`upcoming_batch_indices`) and builds each pack
to the cap of its emission step; the pool then sorts and permutes only within runs of positions
with one cap (:func:`~energon_ordering.pool.pack_order.cost_order`), so every pack is emitted
under the cap it was built to. After the warmup a pool has one cap and the order is the
uncapped one. Measured (``tools/bench_packing.py``): without this, packs emitted late in a
steep warmup were filled to 41% of their step's cap.

It is the encoded pool (:class:`~energon_ordering.pool.length_pool_sort.LengthPoolSortDataset`)
keyed by pack cost, with its own stamp; pooled packs are saved as Energon's pack restore keys
(the restore keys of the packed samples) and rebuilt by ``PackingDataset.restore_sample``, so
``pack_selected_samples`` must be ``@stateless`` (checked at construction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.worker import WorkerConfig

from energon_ordering.errors import OrderingConfigError, OrderingTypeError
from energon_ordering.pool.length_pool_sort import LengthPoolSortDataset
from energon_ordering.pool.pack_order import cost_order, emission_batch, pack_cost
from energon_ordering.pool.sequence_pack import pack_doc_lengths
from energon_ordering.errors import show

__all__ = ["PackCost", "PackPoolSortDataset"]

T_sample = TypeVar("T_sample")

#: Version of the pack pool's logic (on top of the encoded pool's); bumped on any order change.
#: 2: with ``batch_cap`` (the warmup), packs are sorted only within runs of one cap. Without
#: ``batch_cap`` the order is version 1's and the stamp still says 1.
PACK_STATE_VERSION = 2


class PackCost:
    """Key function: the cost ``sum(L + L**2 / 4096)`` of a pack, from its document lengths."""

    def __init__(self, doc_lengths: Callable[[Any], Sequence[float]] = pack_doc_lengths):
        self.doc_lengths = doc_lengths

    def __call__(self, pack: Any) -> float:
        return pack_cost(self.doc_lengths(pack))

    def __repr__(self) -> str:
        return f"PackCost({show(getattr(self.doc_lengths, '__qualname__', self.doc_lengths))})"


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
        batch_cap: Callable[[int], float | None] | None = None,
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
            batch_cap: The pack cap (tokens) of the rank's micro-batch index b (None: no cap),
                non-decreasing in b; needs ``batch_size``. Given (the sequence-length warmup),
                packs are sorted and permuted only within runs of emission positions with one
                cap, and the packer reads the positions from :meth:`upcoming_batch_indices`.
        """
        if batch_cap is not None and not callable(batch_cap):
            raise OrderingTypeError(
                f"PackPoolSortDataset: batch_cap = {show(batch_cap)} must be callable (micro-batch "
                "index -> pack cap in tokens) or None."
            )
        if batch_cap is not None and batch_size is None:
            raise OrderingConfigError(
                "PackPoolSortDataset: batch_cap needs batch_size (packs per micro-batch) to tell "
                "the micro-batch of each emission position; pass batch_size=<micro-batch size>."
            )
        self.batch_cap = batch_cap
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
        stamp = {
            **super()._expected_stamp(),
            "holds": "packs",
            "pack_state_version": 1 if self.batch_cap is None else PACK_STATE_VERSION,
            "key": "pack cost sum(L + L^2/4096)",
        }
        if self.batch_cap is not None:
            stamp["sorted_within"] = "runs of one cap"
            stamp["batch_size"] = self.batch_size
        return stamp

    def reset_state_own(self) -> None:
        super().reset_state_own()
        # The micro-batch the last pack went into, and how many packs of this pool went into
        # it. Not state: a loader saves between micro-batches, so after a restore the
        # micro-batch being built holds no pack yet, which is what (-1, 0) says.
        self._last_batch = -1
        self._taken = 0

    def restore_state(self, state: Any) -> None:
        super().restore_state(state)
        self._last_batch = -1
        self._taken = 0

    def _fill_origin(self) -> tuple[int, int]:
        """(b0, offset) of the pool being filled: the micro-batch being built (a pool fills
        while the batcher waits for its next pack) and the packs it already holds."""
        b0 = self.worker_config.active_worker_batch_index
        return b0, self._taken if b0 == self._last_batch else 0

    def emission_batch(self, position: int) -> int:
        """The rank's micro-batch index that the pack arriving at ``position`` of the pool being
        filled is emitted in (positions past ``pool_size`` belong to the next pools, which
        drain right after this one). Only during a fill (in a loader worker)."""
        assert self.batch_size is not None
        b0, offset = self._fill_origin()
        return emission_batch(b0, offset, position, self.batch_size, self.worker_config.num_workers)

    def upcoming_batch_indices(self, n: int) -> list[int]:
        """Micro-batch indices the next ``n`` packs to arrive are emitted in, in arrival order
        (non-decreasing); the packer below calls this while the pool fills."""
        start = self._collecting.len_worker()
        return [self.emission_batch(start + k) for k in range(n)]

    def _pool_order(self, lengths: list[float]) -> list[int]:
        if self.batch_cap is None:
            return super()._pool_order(lengths)
        caps = [self.batch_cap(self.emission_batch(q)) for q in range(len(lengths))]
        seed = self.settings.pool_seed(self._pool_index, self.worker_config.rank_worker_id())
        return cost_order(lengths, seed, self.mode, self.batch_size, caps)

    def _drain(self) -> Iterator[T_sample]:
        while self._emitting.len_worker() > 0:
            pack = self._emitting.pop(0)
            batch = self.worker_config.active_worker_batch_index
            self._taken = self._taken + 1 if batch == self._last_batch else 1
            self._last_batch = batch
            yield pack

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "batch_cap": None if self.batch_cap is None else self._function_config(self.batch_cap),
        }

    def __str__(self) -> str:
        return (
            f"PackPoolSortDataset(pool_size={self.pool_size}, mode={show(self.mode)}, "
            f"batch_size={self.batch_size}, seed={self.seed}, "
            f"capped={self.batch_cap is not None}, dataset={self.dataset})"
        )
