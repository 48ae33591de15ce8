"""``advise``: predicted straggler idle, padding and source mix from 8 to 1,024 ranks, and what a
pool costs per loader worker.

Simulating 1,024 real pipelines with pools of a million samples is out of reach, and not needed:
the order depends only on lengths. This module predicts what ``inspect`` would measure, with the
package's own order functions (:data:`energon_ordering.pool.order.POOL_ORDERS`):

1. **Lengths.** The dataset's length distribution (a *population*, sorted by length, with each
   sample's source): every length of the length index of each prepared dataset, mixed by the
   metadataset's blend weights; or, without an index, the lengths ``inspect`` estimates
   (:class:`~energon_ordering.inspect.length_estimate.LengthEstimateTaskEncoder` or the given
   task encoder) over the first samples of a real pipeline.
2. **Order.** A pool of N samples is emitted in the order ``POOL_ORDERS[mode]`` gives. Run on the
   ranks ``0..N-1`` (already sorted), it returns, for every emitted sample, its rank in the sorted
   pool; the permutation seed is :func:`~energon_ordering.pool.order.pool_seed` of (seed, pool
   index, worker slot), exactly as the pools use it, and micro-batch b comes from worker
   ``b % num_workers`` as in Energon's loader. The order is rank-independent, so it is computed
   once and shared by all ranks.
3. **Ranks.** Each rank's pool is N independent draws from the population. Only the sorted
   positions that the first micro-batches use are needed; the order statistics of N uniforms
   at those positions are drawn exactly (sums of exponential spacings, i.e. Gamma increments)
   and mapped through the population's quantile function. A million-sample pool on 1,024 ranks
   costs a few thousand draws per rank instead of a sort of a million.
4. **Measures.** The same definitions as :mod:`energon_ordering.inspect.diagnostics`: straggler
   idle per micro-batch index over the ranks, padding waste per micro-batch, and the source
   histogram dispersion per micro-batch and per optimizer step (all micro-batches of all ranks
   of a step, :func:`~energon_ordering.inspect.diagnostics.sources_by_step`).

Memory per worker and time to first batch are measured on real loaders of the dataset (a small
pool per placement), per pooled sample, and scaled to each pool size.

The model's assumptions: lengths independent of their position in the stream (Energon shuffles
shard slices and samples), a stream longer than the pool (each worker's pool is filled from its
own data), no mixture schedule. ``tests/test_advise.py`` checks the 8-rank prediction against
the idle ``inspect`` measures on real pipelines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from energon_ordering.config import OrderingConfig
from energon_ordering.errors import OrderingConfigError, OrderingError
from energon_ordering.inspect.diagnostics import (
    ATTENTION_CROSSOVER_TOKENS,
    histogram_dispersion,
    sources_by_step,
)
from energon_ordering.length_index.index import LengthIndex, length_index_files
from energon_ordering.pool.order import POOL_ORDERS, pool_seed
from energon_ordering.sqlite_file import connect_readonly

__all__ = [
    "ADVISE_POOL_SIZES",
    "ADVISE_RANKS",
    "Advice",
    "CostPerSample",
    "LengthPopulation",
    "OrderPrediction",
    "advise",
    "load_population",
    "measure_costs",
    "order_positions",
    "plot_advice",
    "predict_order",
    "recommend",
    "source_mix_note",
    "vector_straggler_idle",
]

#: Pool sizes ``advise`` predicts (samples per loader worker; rounded to the micro-batch).
ADVISE_POOL_SIZES = (1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000)
#: Rank counts of the idle curves (the requested ``--ranks`` is added).
ADVISE_RANKS = (8, 64, 256, 1024)
#: Placements and what the pool holds, as ``(placement, holds)``.
PLACEMENTS = (("pre-encode", "keys"), ("pre-encode", "raw"), ("post-encode", "encoded"))


# ---- 1. lengths ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthPopulation:
    """A dataset's lengths, sorted, with each sample's source.

    Attributes:
        lengths: Sample lengths in tokens, ascending.
        sources: Index into ``source_names`` of each sample.
        source_names: Source names (metadataset ``subflavors.source`` or folder names).
        origin: Where the lengths come from (``"length index"`` or an estimate).
    """

    lengths: np.ndarray
    sources: np.ndarray
    source_names: tuple[str, ...]
    origin: str

    def __post_init__(self) -> None:
        if len(self.lengths) == 0:
            raise OrderingConfigError("advise: the dataset has no samples to take lengths from.")


def _entries(path: str | Path) -> list[Any]:
    """Energon's loaded training datasets of a prepared dataset or metadataset."""
    from megatron.energon import WorkerConfig
    from megatron.energon.metadataset import load_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    return load_dataset(path).get_datasets(
        training=True, split_part="train", worker_config=wc, max_samples_per_sequence=None,
        shuffle_over_epochs_multiplier=1,
    ).datasets


def _index_lengths(dataset_path: Any) -> np.ndarray:
    index = LengthIndex.open(dataset_path)  # raises if stale or of another version
    con = connect_readonly(index.path)
    try:
        return np.array([r[0] for r in con.execute("SELECT length FROM lengths")], dtype=np.float64)
    finally:
        con.close()


def load_population(
    path: str | Path,
    *,
    task_encoder_factory: Callable[[], Any] | None = None,
    estimate_samples: int = 4000,
    population: int = 400_000,
    seed: int = 0,
) -> LengthPopulation:
    """The length distribution of a prepared dataset or metadataset.

    Args:
        path: Prepared dataset folder or metadataset YAML.
        task_encoder_factory: Estimates lengths where a dataset has no length index (default:
            :class:`~energon_ordering.inspect.length_estimate.LengthEstimateTaskEncoder`).
        estimate_samples: Samples read for the estimate.
        population: Draws that represent a blend of several sources (by blend weight).
        seed: Seed of those draws.
    """
    from energon_ordering.pipeline.sources import source_name as _source_name

    entries = _entries(path)
    paths = [getattr(e.dataset, "path", None) for e in entries]
    if all(p is not None and length_index_files(p) for p in paths):
        names = [_source_name(e) for e in entries]
        lengths = [_index_lengths(p) for p in paths]
        if len(entries) == 1:
            order = np.argsort(lengths[0], kind="stable")
            return LengthPopulation(lengths[0][order], np.zeros(len(order), dtype=np.int64),
                                    (names[0],), "length index")
        weights = np.array([float(e.weight if e.weight is not None else len(l))
                            for e, l in zip(entries, lengths)])
        rng = np.random.default_rng(seed)
        counts = rng.multinomial(population, weights / weights.sum())
        unique = sorted(set(names))
        parts_l, parts_s = [], []
        for name, ls, n in zip(names, lengths, counts):
            parts_l.append(rng.choice(ls, size=n, replace=True))
            parts_s.append(np.full(n, unique.index(name), dtype=np.int64))
        all_l, all_s = np.concatenate(parts_l), np.concatenate(parts_s)
        order = np.argsort(all_l, kind="stable")
        return LengthPopulation(all_l[order], all_s[order], tuple(unique), "length index")
    return _estimated_population(path, task_encoder_factory, estimate_samples)


def _estimated_population(
    path: str | Path, task_encoder_factory: Callable[[], Any] | None, samples: int
) -> LengthPopulation:
    from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder
    from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader

    factory = task_encoder_factory or LengthEstimateTaskEncoder
    loader = build_train_loader(path, ordering=OrderingConfig(), batch_size=64,
                                task_encoder_factory=factory)
    lengths: list[int] = []
    sources: list[str] = []
    from energon_ordering.inspect.rank_simulation import record_batch

    it = iter(loader)
    while len(lengths) < samples:
        rec = record_batch(next(it))
        lengths.extend(rec.lengths)
        sources.extend(rec.sources or ("-",) * len(rec.lengths))
    del it
    close_loader(loader)
    unique = tuple(sorted(set(sources)))
    ls = np.array(lengths, dtype=np.float64)
    order = np.argsort(ls, kind="stable")
    codes = np.array([unique.index(s) for s in sources], dtype=np.int64)
    return LengthPopulation(ls[order], codes[order], unique,
                            f"estimate ({len(ls)} samples, {type(factory()).__name__})")


# ---- 2. order ------------------------------------------------------------------------------


def order_positions(
    mode: str, pool_size: int, batch_size: int, seed: int, pool_index: int, worker_slot: int
) -> list[int]:
    """Sorted-pool rank of every sample a pool emits, in emission order: the package's order
    function run on the ranks ``0..pool_size-1`` with the pool's own seed."""
    if mode not in POOL_ORDERS:
        raise OrderingConfigError(f"advise: mode = {mode!r} is unknown; use one of {sorted(POOL_ORDERS)}.")
    return POOL_ORDERS[mode](range(pool_size), pool_seed(seed, pool_index, worker_slot), batch_size)


# ---- 3 + 4. ranks and measures -------------------------------------------------------------


def vector_straggler_idle(lengths: np.ndarray) -> float:
    """:func:`~energon_ordering.inspect.diagnostics.straggler_idle` of ``lengths[rank, step, i]``."""
    cost = (lengths + lengths * lengths / ATTENTION_CROSSOVER_TOKENS).sum(axis=2)
    peak = cost.max(axis=0)
    idle = np.where(peak > 0, 1.0 - cost.mean(axis=0) / np.where(peak > 0, peak, 1), 0.0)
    return float(idle.mean())


def _padding(lengths: np.ndarray) -> float:
    peak = lengths.max(axis=2)
    b = lengths.shape[2]
    waste = np.where(peak > 0, 1.0 - lengths.sum(axis=2) / (b * np.where(peak > 0, peak, 1)), 0.0)
    return float(waste.mean())


@dataclass(frozen=True)
class OrderPrediction:
    """Predicted diagnostics of one (mode, pool size) at several rank counts.

    Attributes:
        mode: Pool mode (``"off"`` for no pool).
        pool_size: Samples per pool per worker (0 = off).
        idle: ``{ranks: straggler idle fraction}``.
        padding: Padding waste fraction (rank-independent).
        dispersion_batch: Source histogram dispersion per micro-batch (nan: one source).
        dispersion_step: Dispersion per optimizer step at the requested rank count.
    """

    mode: str
    pool_size: int
    idle: dict[int, float]
    padding: float
    dispersion_batch: float
    dispersion_step: float


class _OrderCache:
    def __init__(self) -> None:
        self._orders: dict[tuple, np.ndarray] = {}

    def get(self, mode: str, n: int, b: int, seed: int, k: int, w: int) -> np.ndarray:
        key = (mode, n, b, seed, k, w)
        if key not in self._orders:
            self._orders[key] = np.asarray(order_positions(mode, n, b, seed, k, w), dtype=np.int64)
        return self._orders[key]


def _draw(
    pop: LengthPopulation,
    ranks: int,
    *,
    pool_size: int,
    mode: str,
    batch_size: int,
    num_workers: int,
    steps: int,
    seed: int,
    rng: np.random.Generator,
    cache: _OrderCache,
) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, sources)``, each ``[rank, micro_batch, sample]``."""
    m = len(pop.lengths)
    if pool_size == 0:
        idx = np.minimum((rng.random((ranks, steps, batch_size)) * m).astype(np.int64), m - 1)
        return pop.lengths[idx], pop.sources[idx]
    workers = max(1, num_workers)
    idx = np.empty((ranks, steps, batch_size), dtype=np.int64)
    for w in range(workers):
        batches = list(range(w, steps, workers))  # Energon: micro-batch b from worker b % W
        if not batches:
            continue
        n_samples = len(batches) * batch_size
        stream = np.empty((ranks, n_samples), dtype=np.int64)
        for k in range(math.ceil(n_samples / pool_size)):
            lo, hi = k * pool_size, min(n_samples, (k + 1) * pool_size)
            pos = cache.get(mode, pool_size, batch_size, seed, k, w)[: hi - lo]
            ks, inverse = np.unique(pos + 1, return_inverse=True)  # 1-based order statistics
            inc = np.diff(np.concatenate(([0], ks))).astype(np.float64)
            gam = rng.gamma(inc, size=(ranks, len(ks)))
            tail = rng.gamma(float(pool_size + 1 - ks[-1]), size=(ranks, 1))
            cum = np.cumsum(gam, axis=1)
            u = cum / (cum[:, -1:] + tail)
            stream[:, lo:hi] = np.minimum((u * m).astype(np.int64), m - 1)[:, inverse]
        idx[:, batches, :] = stream.reshape(ranks, len(batches), batch_size)
    return pop.lengths[idx], pop.sources[idx]


def predict_order(
    pop: LengthPopulation,
    *,
    mode: str,
    pool_size: int,
    batch_size: int,
    ranks: Sequence[int],
    step_ranks: int,
    num_workers: int = 0,
    micro_batches_per_step: int = 1,
    steps: int = 1000,
    seed: int = 0,
    model_seed: int = 0,
    cache: Any = None,
) -> OrderPrediction:
    """Predicted idle at each rank count, padding and source dispersion of one pool setting.

    Args:
        pop: The length population.
        mode: A pool mode, or ``"off"`` (then ``pool_size`` must be 0).
        pool_size: Samples per pool per loader worker.
        batch_size: Micro-batch size, in samples.
        ranks: Rank counts to predict the idle for.
        step_ranks: Rank count of the per-step dispersion (the run's data-parallel size).
        num_workers: Loader workers per rank (0 = in-process, as 1).
        micro_batches_per_step: Micro-batches per rank per optimizer step.
        steps: Micro-batches simulated per rank (more = less sampling noise).
        seed: The ordering seed.
        model_seed: Seed of the simulated draws.
        cache: Share orders between calls (an object returned by ``_OrderCache()``).
    """
    if (mode == "off") != (pool_size == 0):
        raise OrderingConfigError(f"advise: mode = {mode!r} with pool_size = {pool_size}.")
    cache = cache or _OrderCache()
    rng = np.random.default_rng(model_seed)
    kw = dict(pool_size=pool_size, mode=mode, batch_size=batch_size, num_workers=num_workers,
              steps=steps, seed=seed, rng=rng, cache=cache)
    idle: dict[int, float] = {}
    padding = float("nan")
    disp_batch = disp_step = float("nan")
    for r in sorted(set(ranks) | {step_ranks}):
        lengths, sources = _draw(pop, r, **kw)
        idle[r] = vector_straggler_idle(lengths)
        if r == step_ranks:
            padding = _padding(lengths)
            if len(pop.source_names) > 1:
                names = np.array(pop.source_names, dtype=object)[sources]
                per_rank = [[list(b) for b in rank] for rank in names[: min(r, 64)]]
                disp_batch = float(np.mean([histogram_dispersion(rb, pop.source_names)
                                            for rb in per_rank]))
                groups = sources_by_step([[list(b) for b in rank] for rank in names],
                                         micro_batches_per_step)
                disp_step = histogram_dispersion(groups, pop.source_names)
    return OrderPrediction(mode, pool_size, {r: idle[r] for r in ranks if r in idle} | {
        step_ranks: idle[step_ranks]}, padding, disp_batch, disp_step)


# ---- cost of a pool per worker: measured on real loaders -----------------------------------


@dataclass(frozen=True)
class CostPerSample:
    """What a pool costs per pooled sample, measured on a real loader.

    Attributes:
        placement: ``"pre-encode"`` or ``"post-encode"``.
        holds: ``"keys"``, ``"raw"`` or ``"encoded"``.
        fill_seconds: Seconds to the first micro-batch, per pooled sample.
        bytes_per_sample: Resident bytes the pool holds per pooled sample.
        measured_pool: The pool size measured.
        note: Why it could not be measured (then the figures are nan).
    """

    placement: str
    holds: str
    fill_seconds: float
    bytes_per_sample: float
    measured_pool: int
    note: str = ""

    def first_batch_seconds(self, pool_size: int) -> float:
        return self.fill_seconds * pool_size

    def memory_bytes(self, pool_size: int) -> float:
        return self.bytes_per_sample * pool_size


def measure_costs(
    path: str | Path,
    *,
    batch_size: int,
    task_encoder_factory: Callable[[], Any] | None = None,
    pool_size: int = 512,
) -> list[CostPerSample]:
    """Time to first batch and pool memory per pooled sample, for each placement, on real
    in-process loaders of ``path`` with a pool of ``pool_size``."""
    import gc

    from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder
    from energon_ordering.inspect.pool_memory import find_stage, pool_holdings, resident_bytes
    from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
    from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset
    from energon_ordering.pool.length_pool_sort import LengthPoolSortDataset

    factory = task_encoder_factory or LengthEstimateTaskEncoder
    pool_size = max(batch_size, pool_size // batch_size * batch_size)
    costs = []
    for placement, holds in PLACEMENTS:
        cfg = OrderingConfig(
            length_sort_pool_size=pool_size, length_sort_mode="batch",
            length_sort_placement=placement,
            length_sort_pool_holds=holds if placement == "pre-encode" else "raw",
        )
        try:
            loader = build_train_loader(path, ordering=cfg, batch_size=batch_size,
                                        task_encoder_factory=factory)
        except OrderingError as e:  # reported per placement, e.g. no length index
            costs.append(CostPerSample(placement, holds, float("nan"), float("nan"), pool_size,
                                       note=str(e).split("\n")[0][:160]))
            continue
        gc.collect()
        t0 = time.perf_counter()
        it = iter(loader)
        next(it)
        fill = time.perf_counter() - t0
        pool = find_stage(loader.dataset, (KeyPoolSortDataset, LengthPoolSortDataset))
        n, held = pool_holdings(pool)
        held_bytes = resident_bytes(held)
        del it, pool, held
        close_loader(loader)
        costs.append(CostPerSample(placement, holds, fill / pool_size,
                                   held_bytes / max(1, n), pool_size))
    return costs


# ---- the advice ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Advice:
    """Everything ``advise`` prints.

    Attributes:
        population: The lengths the predictions used.
        ranks: The requested rank count.
        batch_size: Micro-batch size.
        predictions: One per (mode, pool size), plus ``"off"``.
        costs: Per placement, measured.
        memory_budget: Bytes per loader worker allowed.
        recommended: ``(placement, holds, mode, pool_size)``, or None if nothing fits.
        reason: Why that one.
    """

    population: LengthPopulation
    ranks: int
    batch_size: int
    predictions: list[OrderPrediction]
    costs: list[CostPerSample]
    memory_budget: float
    recommended: tuple[str, str, str, int] | None
    reason: str
    rank_counts: tuple[int, ...] = field(default=ADVISE_RANKS)


def _lost(p: OrderPrediction, ranks: int) -> float:
    """Compute lost to waiting and to padding: ``1 - (1 - idle)(1 - padding)``."""
    return 1.0 - (1.0 - p.idle[ranks]) * (1.0 - p.padding)


def recommend(
    predictions: Sequence[OrderPrediction],
    costs: Sequence[CostPerSample],
    *,
    ranks: int,
    memory_budget: float,
    tolerance: float = 0.002,
) -> tuple[tuple[str, str, str, int] | None, str]:
    """The setting that loses the least compute (idle and padding) at ``ranks`` within the memory
    budget; among those within ``tolerance`` of the best, the smallest pool (fastest start),
    then the leanest placement."""
    if not costs:
        return None, "memory and time to first batch were not measured (--no-measure)"
    options = []
    for p in predictions:
        if p.pool_size == 0:
            continue
        for c in costs:
            if math.isnan(c.bytes_per_sample) or c.memory_bytes(p.pool_size) > memory_budget:
                continue
            options.append((_lost(p, ranks), p, c))
    if not options:
        return None, "no pool fits the memory budget; raise --memory-per-worker"
    best = min(o[0] for o in options)
    near = [o for o in options if o[0] <= best + tolerance]
    lost, p, c = min(near, key=lambda o: (o[1].pool_size, o[2].memory_bytes(o[1].pool_size)))
    return (c.placement, c.holds, p.mode, p.pool_size), (
        f"loses {100 * lost:.1f}% of compute to idle + padding at {ranks} ranks (best "
        f"{100 * best:.1f}%), the smallest pool within {100 * tolerance:.1f} points of the best "
        f"that fits {memory_budget / 2**20:,.0f} MiB per worker"
    )


def source_mix_note(advice: Advice, limit: float = 1.5) -> str | None:
    """If the recommended setting clusters sources per optimizer step (dispersion above
    ``limit``), the ``stratified`` alternative at the same pool size and its cost in idle."""
    if advice.recommended is None:
        return None
    _, _, mode, size = advice.recommended
    pick = {(p.mode, p.pool_size): p for p in advice.predictions}
    rec, alt = pick.get((mode, size)), pick.get(("stratified", size))
    if rec is None or alt is None or not rec.dispersion_step > limit or mode == "stratified":
        return None
    r = advice.ranks
    return (
        f"sources cluster per optimizer step: dispersion {rec.dispersion_step:.2f} per step "
        f"(> {limit}) with {mode} mode. length_sort_mode: stratified keeps the ranks in sync and "
        f"mixes sources: dispersion {alt.dispersion_step:.2f} per step, idle at {r} ranks "
        f"{100 * alt.idle[r]:.1f}% instead of {100 * rec.idle[r]:.1f}%, padding "
        f"{100 * alt.padding:.1f}% instead of {100 * rec.padding:.1f}% (use it with packing)."
    )


def advise(
    path: str | Path,
    *,
    ranks: int,
    batch_size: int,
    num_workers: int = 0,
    memory_per_worker: float = 2 * 2**30,
    micro_batches_per_step: int = 1,
    pool_sizes: Sequence[int] = ADVISE_POOL_SIZES,
    rank_counts: Sequence[int] = ADVISE_RANKS,
    steps: int = 1000,
    seed: int = 0,
    task_encoder_factory: Callable[[], Any] | None = None,
    measure: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Advice:
    """Predicts every (mode, pool size) and measures every placement; recommends one setting.

    Args:
        path: Prepared dataset or metadataset.
        ranks: Data-parallel ranks of the run.
        batch_size: Micro-batch size.
        num_workers: Loader workers per rank.
        memory_per_worker: Bytes a pool may hold per loader worker.
        micro_batches_per_step: Micro-batches per rank per optimizer step.
        pool_sizes: Pool sizes to predict (rounded down to the micro-batch).
        rank_counts: Rank counts of the idle curves (``ranks`` is added).
        steps: Micro-batches simulated per rank.
        seed: Ordering seed.
        task_encoder_factory: Length estimate without a length index, and the encoder of the
            measured loaders.
        measure: Measure time to first batch and memory on real loaders.
        progress: Called with a line of text per stage.
    """
    say = progress or (lambda _: None)
    if ranks < 1 or batch_size < 1:
        raise OrderingConfigError(f"advise: ranks = {ranks}, batch_size = {batch_size}; both >= 1.")
    say("lengths")
    pop = load_population(path, task_encoder_factory=task_encoder_factory, seed=seed)
    counts = tuple(sorted(set(rank_counts) | {ranks}))
    cache = _OrderCache()
    predictions = []
    common = dict(batch_size=batch_size, ranks=counts, step_ranks=ranks, num_workers=num_workers,
                  micro_batches_per_step=micro_batches_per_step, steps=steps, seed=seed, cache=cache)
    say("pool off")
    predictions.append(predict_order(pop, mode="off", pool_size=0, **common))
    for mode in POOL_ORDERS:
        for size in pool_sizes:
            size = max(batch_size, size // batch_size * batch_size)
            say(f"{mode} pool {size:,}")
            predictions.append(predict_order(pop, mode=mode, pool_size=size, **common))
    costs = []
    if measure:
        say("measuring time to first batch and memory on real loaders")
        costs = measure_costs(path, batch_size=batch_size, task_encoder_factory=task_encoder_factory)
    recommended, reason = recommend(predictions, costs, ranks=ranks,
                                    memory_budget=memory_per_worker)
    return Advice(pop, ranks, batch_size, predictions, costs, memory_per_worker, recommended,
                  reason, counts)


def plot_advice(path: str | Path, advice: Advice) -> Path:
    """Idle against pool size, one line per rank count (batch mode solid, sample mode dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    off = next(p for p in advice.predictions if p.pool_size == 0)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(advice.rank_counts):
        color = colors[i % len(colors)]
        for mode, style in (("batch", "-"), ("sample", "--"), ("stratified", "-.")):
            pts = sorted((p.pool_size, p.idle[r]) for p in advice.predictions if p.mode == mode)
            if pts:
                xs, ys = zip(*pts)
                label = f"{r} ranks" + (" (requested)" if r == advice.ranks else "")
                ax.plot(xs, [100 * y for y in ys], style, color=color, marker="o", ms=3,
                        label=label if mode == "batch" else None)
        ax.axhline(100 * off.idle[r], color=color, lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("pool size (samples per loader worker)")
    ax.set_ylabel("predicted straggler idle (%)")
    ax.set_title(f"micro-batch {advice.batch_size}: batch (solid), sample (dashed), stratified "
                 "(dash-dot), no pool (dotted)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
