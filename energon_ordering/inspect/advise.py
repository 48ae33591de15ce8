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
4. **Measures.** The same definitions as ``inspect``'s
   (:mod:`energon_ordering.inspect.lost_compute`, :mod:`energon_ordering.inspect.diagnostics`):
   straggler idle per optimizer step (each rank's micro-batches of a step summed: the ranks
   wait at the gradient reduction) and per micro-batch index (the ranks wait at every
   micro-batch: expert parallelism), padding weighted by tokens and the mean of each
   micro-batch's padding share, and the source histogram dispersion per micro-batch and per
   optimizer step (all micro-batches of all ranks of a step,
   :func:`~energon_ordering.inspect.diagnostics.sources_by_step`). A setting's **lost compute**
   is idle per optimizer step + padding by tokens; the recommendation ranks by it.

**Feasible pools.** The package refuses a pool larger than a loader worker's share of repeating
data (``_check_pool_share`` in :mod:`energon_ordering.task_encoder`): Energon splits every source
evenly over the ``ranks x max(1, num_workers)`` loader workers of the job, so a worker's share is
``sum_k floor(samples_k / (ranks x workers))`` (:func:`worker_share`). ``advise`` predicts every
pool size but recommends only those within the share, and adds the largest pool that fits it.

Memory per worker and time to first batch are measured on real in-process loaders of the
dataset, per placement: the first batch at two pool sizes is fitted as start-up + per-sample
seconds, and the fit is checked against a third, measured first batch at the largest pool that
fits (:class:`CostPerSample`).

Inputs are bounded before anything is allocated (:func:`check_inputs`): a dataset too small for
one micro-batch per loader worker, blend weights that are all 0, and a simulation that would
need more memory than ``advise`` allows itself are refused with a typed error.

**The planned order** (``length_sort_mode: planned``) is a pure function of the lengths, so it
is not modelled but computed: :func:`planned_run` splits the population by source and runs the
plan itself (:func:`energon_ordering.planned.window.plan_window`, windows of each mix's default
length at the rank count's global batch, :mod:`energon_ordering.planned.window_size`) at each
rank count and at
each mix granularity (``planned_mix``: the mix held per optimizer step, or per plan window
with the window's samples free to move between its steps), and :func:`predict_planned`
measures it with the same definitions, plus the worst per-step and per-window deviation of a
source's count from ``weight x global batch`` (in samples) and the seconds ``plan_window``
takes per step. The granularity that loses less compute is compared with the pools
(:func:`best_planned`). It needs a length index for every dataset: ``advise`` recommends it
only then (:func:`recommend`), and says so in one line otherwise (:func:`planned_note`).

The model's assumptions: lengths independent of their position in the stream (Energon shuffles
shard slices and samples), a stream longer than the pool (each worker's pool is filled from its
own data), no mixture schedule. ``tests/test_advise.py`` checks the 8-rank prediction against
the idle ``inspect`` measures on real pipelines.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from energon_ordering.config import PLANNED_MIXES, OrderingConfig
from energon_ordering.errors import OrderingConfigError, OrderingError
from energon_ordering.inspect.diagnostics import (
    ATTENTION_CROSSOVER_TOKENS,
    histogram_dispersion,
    sources_by_step,
)
from energon_ordering.inspect.lost_compute import (
    idle_per_step,
    lost_compute,
    micro_batch_costs,
    padding_by_tokens,
)
from energon_ordering.length_index.index import LengthIndex, length_index_files
from energon_ordering.pool.order import POOL_ORDERS, pool_seed
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.window import DEFAULT_WINDOW_STEPS, plan_window, window_weights
from energon_ordering.planned.window_size import default_window_steps, steps_within_an_epoch
from energon_ordering.pool.ramp import RAMP_MIN_POOL, pool_size_at
from energon_ordering.sqlite_file import connect_readonly
from energon_ordering.errors import show

__all__ = [
    "ADVISE_POOL_SIZES",
    "ADVISE_RANKS",
    "Advice",
    "CostPerSample",
    "LengthPopulation",
    "OrderPrediction",
    "PlannedPrediction",
    "PlannedRun",
    "advise",
    "best_planned",
    "check_inputs",
    "fit_first_batch",
    "step_share_deviation",
    "data_sizes",
    "source_samples",
    "load_population",
    "measure_costs",
    "order_positions",
    "other_mode_note",
    "plot_advice",
    "planned_note",
    "planned_run",
    "predict_order",
    "predict_planned",
    "recommend",
    "source_mix_note",
    "step_straggler_idle",
    "vector_straggler_idle",
    "worker_share",
]

#: Pool sizes ``advise`` predicts (samples per loader worker; rounded to the micro-batch).
ADVISE_POOL_SIZES = (1_000, 3_000, 10_000, 30_000, 100_000, 300_000, 1_000_000)
#: Rank counts of the idle curves (the requested ``--ranks`` is added).
ADVISE_RANKS = (8, 64, 256, 1024)
#: Memory ``advise``'s own simulation may use (bytes); larger runs are refused by check_inputs.
MODEL_MEMORY_LIMIT = 4 * 2**30
#: Bytes the simulation holds per simulated sample (indices, lengths, sources, per-step lists).
_MODEL_BYTES_PER_SAMPLE = 96
#: Idle at the requested ranks below which a pool is good enough; above it, another mode would
#: do better (the planned global order).
GOOD_IDLE = 0.01
#: Samples the planned prediction plans at most per rank count (whole windows, at least one):
#: bounds its time (with one micro-batch per step, 1,024 ranks plan about 50 us per sample on a
#: busy 2-core machine, 8 micro-batches per step 4-6 us; measured at 2**20 the prediction took
#: 90 s at M = 1, at 2**18 about 20 s).
PLANNED_MAX_SAMPLES = 2**18
#: The settings ``length_sort_mode: planned`` needs beside it (``OrderingConfig._check_planned``).
PLANNED_SETTINGS = ("length_sort_mode: planned, length_sort_placement: pre-encode, "
                    "length_sort_pool_holds: keys")
#: Bytes a loader worker holds per sample of the dataset in planned mode (its lengths).
PLANNED_BYTES_PER_SAMPLE = 8
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


def data_sizes(path: str | Path) -> list[tuple[str, int, float | None]]:
    """``(source, samples, blend weight)`` of each entry of a prepared dataset or metadataset
    (from Energon's index: nothing is read)."""
    from energon_ordering.pipeline.sources import source_name as _source_name

    return [(_source_name(e), len(e.dataset), e.weight) for e in _entries(path)]


def source_samples(sizes: Sequence[tuple[str, int, float | None]]) -> dict[str, int]:
    """``{source: samples}`` of :func:`data_sizes` (entries of one source summed)."""
    out: dict[str, int] = {}
    for name, n, _ in sizes:
        out[name] = out.get(name, 0) + int(n)
    return out


def worker_share(sizes: Sequence[int], ranks: int, num_workers: int) -> int:
    """Samples per epoch of one loader worker: Energon splits each source evenly over the
    ``ranks x max(1, num_workers)`` workers of the job (the smallest share, rounded down)."""
    workers = ranks * max(1, num_workers)
    return int(sum(n // workers for n in sizes))


def check_inputs(
    sizes: Sequence[tuple[str, int, float | None]],
    *,
    ranks: int,
    batch_size: int,
    num_workers: int,
    steps: int,
    rank_counts: Sequence[int] = ADVISE_RANKS,
) -> None:
    """Refuses inputs ``advise`` cannot answer, before anything is allocated.

    Raises:
        OrderingConfigError: No samples; blend weights all 0; fewer samples than one
            micro-batch per loader worker of the job; or a simulation larger than
            :data:`MODEL_MEMORY_LIMIT`.
    """
    total = sum(n for _, n, _ in sizes)
    if total == 0:
        raise OrderingConfigError("advise: the dataset has no samples in its train split.")
    weights = [w for _, _, w in sizes if w is not None]
    if weights and len(weights) == len(sizes) and not sum(float(w) for w in weights) > 0:
        raise OrderingConfigError(
            f"advise: every blend weight of the metadataset is 0 ({', '.join(n for n, _, _ in sizes)}"
            "): nothing would be drawn; give at least one entry a positive weight.")
    workers = max(1, num_workers)
    need = ranks * workers * batch_size
    if total < need:
        raise OrderingConfigError(
            f"advise: the dataset has {total:,} samples, fewer than one micro-batch per loader "
            f"worker of the job ({ranks:,} ranks x {workers} worker(s) x micro-batch "
            f"{batch_size:,} = {need:,}); lower --ranks, --num-workers or --micro-batch, or add "
            "data.")
    largest = max([ranks, *rank_counts])
    model = largest * steps * batch_size * _MODEL_BYTES_PER_SAMPLE
    if model > MODEL_MEMORY_LIMIT:
        fit = max(1, MODEL_MEMORY_LIMIT // (largest * batch_size * _MODEL_BYTES_PER_SAMPLE))
        raise OrderingConfigError(
            f"advise: simulating {largest:,} ranks x {steps:,} micro-batches x {batch_size:,} "
            f"samples needs about {model / 2**30:,.1f} GiB, over advise's limit of "
            f"{MODEL_MEMORY_LIMIT / 2**30:.0f} GiB; lower --steps to {fit:,} or less, or "
            "--micro-batch.")


def _index_lengths(dataset_path: Any, name: str | None = None) -> np.ndarray:
    """Every sample's length from the dataset's length index ``name`` (None: its only one)."""
    index = LengthIndex.open(dataset_path, name)  # raises if stale or of another version
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
    length_index: str | None = None,
) -> LengthPopulation:
    """The length distribution of a prepared dataset or metadataset.

    Args:
        path: Prepared dataset folder or metadataset YAML.
        task_encoder_factory: Estimates lengths where a dataset has no length index (default:
            :class:`~energon_ordering.inspect.length_estimate.LengthEstimateTaskEncoder`).
        estimate_samples: Samples read for the estimate.
        population: Draws that represent a blend of several sources (by blend weight).
        seed: Seed of those draws.
        length_index: The name of the length index to read where a dataset has several
            (None: its only one).
    """
    from energon_ordering.pipeline.sources import source_name as _source_name

    entries = _entries(path)
    paths = [getattr(e.dataset, "path", None) for e in entries]
    if all(p is not None and length_index_files(p) for p in paths):
        names = [_source_name(e) for e in entries]
        lengths = [_index_lengths(p, length_index) for p in paths]
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
    total = sum(len(e.dataset) for e in entries)
    return _estimated_population(path, task_encoder_factory, min(estimate_samples, total))


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
    lengths, sources = lengths[:samples], sources[:samples]
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
        raise OrderingConfigError(f"advise: mode = {show(mode)} is unknown; use one of {sorted(POOL_ORDERS)}.")
    return POOL_ORDERS[mode](range(pool_size), pool_seed(seed, pool_index, worker_slot), batch_size)


# ---- 3 + 4. ranks and measures -------------------------------------------------------------


def vector_straggler_idle(lengths: np.ndarray) -> float:
    """:func:`~energon_ordering.inspect.diagnostics.straggler_idle` of ``lengths[rank, step, i]``."""
    cost = (lengths + lengths * lengths / ATTENTION_CROSSOVER_TOKENS).sum(axis=2)
    peak = cost.max(axis=0)
    idle = np.where(peak > 0, 1.0 - cost.mean(axis=0) / np.where(peak > 0, peak, 1), 0.0)
    return float(idle.mean())


def step_straggler_idle(lengths: np.ndarray, micro_batches_per_step: int) -> float:
    """Idle per optimizer step
    (:func:`~energon_ordering.inspect.lost_compute.idle_per_step`) of ``lengths[rank,
    micro-batch, i]``, micro-batch ``k`` of a rank in step ``k // micro_batches_per_step``
    (the whole steps only)."""
    r, n, _ = lengths.shape
    m = micro_batches_per_step
    steps = n // m
    if steps == 0:
        raise OrderingConfigError(
            f"advise: {n} micro-batches per rank fill no optimizer step of "
            f"{m} micro-batches; simulate more steps.")
    costs = micro_batch_costs(lengths[:, : steps * m]).reshape(r, steps, m)
    return idle_per_step(costs.transpose(1, 0, 2))


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
        idle: ``{ranks: straggler idle per micro-batch}`` (the ranks wait at every
            micro-batch, as with expert parallelism).
        padding: Padding waste, the mean over micro-batches of their padding share
            (rank-independent).
        dispersion_batch: Source histogram dispersion per micro-batch (nan: one source).
        dispersion_step: Dispersion per optimizer step at the requested rank count.
        step_share_pp: ``{source: (typical, worst)}``: how far a source's share of an
            optimizer step's samples (all ranks, all micro-batches) lies from its share of the
            data, in percentage points; typical = median over steps, worst = maximum.
        idle_step: ``{ranks: straggler idle per optimizer step}``, each rank's micro-batches
            of a step summed (the ranks wait once a step, at the gradient reduction).
        padding_tokens: Padding waste weighted by tokens, ``sum(B max L - sum L) / sum(B max
            L)`` at the requested rank count.
    """

    mode: str
    pool_size: int
    idle: dict[int, float]
    padding: float
    dispersion_batch: float
    dispersion_step: float
    step_share_pp: dict[str, tuple[float, float]] = field(default_factory=dict)
    idle_step: dict[int, float] = field(default_factory=dict)
    padding_tokens: float = float("nan")

    @property
    def name(self) -> str:
        """The row's name in ``advise``'s tables."""
        return "pool off" if self.pool_size == 0 else f"{self.mode} {self.pool_size:,}"

    def lost(self, ranks: int) -> float:
        """Compute lost at ``ranks``: idle per optimizer step + padding by tokens
        (:func:`~energon_ordering.inspect.lost_compute.lost_compute`)."""
        return lost_compute(self.idle_step[ranks], self.padding_tokens)


def step_share_deviation(step_sources: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``|share - target|`` in percentage points, per step and source.

    Args:
        step_sources: ``[step, sample]`` source codes of every sample of a step.
        target: Each source's expected share (sums to 1).

    Returns:
        ``[step, source]`` deviations, in percentage points.
    """
    k = len(target)
    counts = np.stack([(step_sources == j).sum(axis=1) for j in range(k)], axis=1)
    return 100.0 * np.abs(counts / step_sources.shape[1] - np.asarray(target)[None, :])


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


def _source_mix(pop: LengthPopulation, sources: np.ndarray, micro_batches_per_step: int,
                ) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """The source mix of an order: ``sources`` ``[R, micro-batches, B]`` (rank-major source
    codes of ``pop``) -> dispersion per micro-batch (over at most 64 ranks), dispersion per
    optimizer step, and each source's per-step share deviation ``{name: (typical, worst)}`` in
    percentage points against its share of ``pop``."""
    r, _, batch_size = sources.shape
    names = np.array(pop.source_names, dtype=object)[sources]
    disp_batch = float(np.mean([histogram_dispersion([list(b) for b in rank], pop.source_names)
                                for rank in names[: min(r, 64)]]))
    groups = sources_by_step([[list(b) for b in rank] for rank in names], micro_batches_per_step)
    disp_step = histogram_dispersion(groups, pop.source_names)
    n_steps = sources.shape[1] // micro_batches_per_step
    per_step = sources[:, : n_steps * micro_batches_per_step].reshape(
        r, n_steps, micro_batches_per_step * batch_size).transpose(1, 0, 2).reshape(n_steps, -1)
    target = np.bincount(pop.sources, minlength=len(pop.source_names)) / len(pop.sources)
    dev = step_share_deviation(per_step, target)
    return disp_batch, disp_step, {name: (float(np.median(dev[:, j])), float(dev[:, j].max()))
                                   for j, name in enumerate(pop.source_names)}


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
    """Predicted idle (per micro-batch and per optimizer step) at each rank count, padding
    (mean per micro-batch and by tokens) and source dispersion of one pool setting.

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
        raise OrderingConfigError(f"advise: mode = {show(mode)} with pool_size = {pool_size}.")
    cache = cache or _OrderCache()
    rng = np.random.default_rng(model_seed)
    kw = dict(pool_size=pool_size, mode=mode, batch_size=batch_size, num_workers=num_workers,
              steps=steps, seed=seed, rng=rng, cache=cache)
    idle: dict[int, float] = {}
    idle_step: dict[int, float] = {}
    padding = padding_tokens = float("nan")
    disp_batch = disp_step = float("nan")
    share_pp: dict[str, tuple[float, float]] = {}
    for r in sorted(set(ranks) | {step_ranks}):
        lengths, sources = _draw(pop, r, **kw)
        idle[r] = vector_straggler_idle(lengths)
        idle_step[r] = step_straggler_idle(lengths, micro_batches_per_step)
        if r == step_ranks:
            padding, padding_tokens = _padding(lengths), padding_by_tokens(lengths)
            if len(pop.source_names) > 1:
                disp_batch, disp_step, share_pp = _source_mix(pop, sources, micro_batches_per_step)
    shown = sorted(set(ranks) | {step_ranks})
    return OrderPrediction(mode, pool_size, {r: idle[r] for r in shown}, padding, disp_batch,
                           disp_step, share_pp, {r: idle_step[r] for r in shown}, padding_tokens)


# ---- 5. the planned order: computed from the lengths, not modelled ------------------------


@dataclass(frozen=True)
class PlannedRun:
    """The planned order of some lengths, as every rank computes it.

    Attributes:
        lengths: ``[steps, R, M, B]`` length of every planned sample: optimizer step, rank,
            micro-batch of the step, sample.
        sources: ``[steps, R, M, B]`` source index of each.
        worst_step_samples: The largest ``|count - weight x G|`` over steps and sources, in
            samples (G = R x M x B, the global batch): below 1 for the exact plan of
            ``planned_mix = "step"``.
        plan_seconds_per_step: Seconds :func:`~energon_ordering.planned.window.plan_window`
            took per optimizer step (one process planning all ranks, as each rank does).
        worst_window_samples: The largest ``|count - sum of weight x G|`` over plan windows
            and sources, in samples: below 1 for either mix granularity.
        mix: The plan's ``planned_mix``, ``"step"`` or ``"window"``.
    """

    lengths: np.ndarray
    sources: np.ndarray
    worst_step_samples: float
    plan_seconds_per_step: float
    worst_window_samples: float = 0.0
    mix: str = "step"

    @staticmethod
    def rank_major(a: np.ndarray) -> np.ndarray:
        """``[steps, R, M, B]`` -> ``[R, steps x M, B]`` (micro-batch index = step x M + m), the
        layout of :func:`vector_straggler_idle` and :func:`_padding`."""
        steps, r, m, b = a.shape
        return a.transpose(1, 0, 2, 3).reshape(r, steps * m, b)


def planned_run(
    lengths: Sequence[np.ndarray],
    weights: Sequence[float] | np.ndarray,
    *,
    world_size: int,
    micro_batch: int,
    micro_batches_per_step: int,
    steps: int,
    window_steps: int = DEFAULT_WINDOW_STEPS,
    seed: int = 0,
    mix: str = "step",
) -> PlannedRun:
    """Plans ``steps`` optimizer steps (whole windows of ``window_steps``: at least one, rounded
    up) of the sources ``lengths`` (per source, each sample's length) blended by ``weights``,
    for ``world_size`` ranks of ``micro_batches_per_step`` micro-batches of ``micro_batch``,
    holding the mix per step or per window (``mix``, ``OrderingConfig.planned_mix``).

    Shared with ``tools/bench_planned.py``.
    """
    if mix not in PLANNED_MIXES:
        raise OrderingConfigError(
            f"planned_run: mix = {show(mix)} is unknown; use one of {list(PLANNED_MIXES)} "
            "(OrderingConfig.planned_mix).")
    cursor = PlanCursor.start(len(lengths))
    g = world_size * micro_batches_per_step * micro_batch
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    flat = np.concatenate([np.asarray(x) for x in lengths])
    offsets = np.cumsum([0] + [len(x) for x in lengths[:-1]])
    k = window_steps
    out_l, out_s, worst, worst_window, seconds = [], [], 0.0, 0.0, 0.0
    windows = max(1, -(-steps // k))
    # "step" is plan_window's only behaviour until it takes the mix: passed only when asked
    granularity = {} if mix == "step" else {"mix": mix}
    for window in range(windows):
        t0 = time.perf_counter()
        plan = plan_window(lengths, seed=seed, cursor=cursor, weights=window_weights(w, window, k),
                           window_steps=k, world_size=world_size, micro_batch=micro_batch,
                           micro_batches_per_step=micro_batches_per_step, **granularity)
        seconds += time.perf_counter() - t0
        cursor = plan.next_cursor
        src = np.searchsorted(offsets, plan.ids, side="right") - 1
        counts = np.stack([np.bincount(src[t].ravel(), minlength=len(lengths)) for t in range(k)])
        worst = max(worst, float(np.abs(counts - w * g).max()))
        worst_window = max(worst_window, float(np.abs(counts.sum(axis=0) - k * w * g).max()))
        out_l.append(flat[plan.ids])
        out_s.append(src)
    return PlannedRun(np.concatenate(out_l).astype(np.float64), np.concatenate(out_s), worst,
                      seconds / (windows * k), worst_window, mix)


@dataclass(frozen=True)
class PlannedPrediction:
    """The planned order's diagnostics at several rank counts, computed from the population.

    Attributes:
        window_steps: K, optimizer steps per plan window.
        idle: ``{ranks: straggler idle per micro-batch}``.
        padding: Padding waste, mean per micro-batch, at the requested rank count.
        dispersion_batch: Source histogram dispersion per micro-batch (nan: one source).
        dispersion_step: Dispersion per optimizer step at the requested rank count.
        step_share_pp: ``{source: (typical, worst)}`` in percentage points, as
            :attr:`OrderPrediction.step_share_pp`.
        worst_step_samples: ``{ranks: largest |count - weight x G|}`` over steps and sources,
            in samples (below 1: the plan is exact per step).
        plan_seconds: ``{ranks: seconds plan_window takes per optimizer step}`` (measured here).
        steps: ``{ranks: optimizer steps planned}`` (whole windows, bounded by
            :data:`PLANNED_MAX_SAMPLES`).
        has_index: Every dataset has a length index (planned mode needs one).
        idle_step: ``{ranks: straggler idle per optimizer step}``.
        padding_tokens: Padding waste weighted by tokens at the requested rank count.
        worst_window_samples: ``{ranks: largest |count - sum of weight x G|}`` over plan
            windows and sources, in samples.
        mix: ``planned_mix``: the mix held per optimizer step (``"step"``) or per plan window
            (``"window"``).
    """

    window_steps: int
    idle: dict[int, float]
    padding: float
    dispersion_batch: float
    dispersion_step: float
    step_share_pp: dict[str, tuple[float, float]]
    worst_step_samples: dict[int, float]
    plan_seconds: dict[int, float]
    steps: dict[int, int]
    has_index: bool
    mode: str = "planned"
    pool_size: int = 0
    idle_step: dict[int, float] = field(default_factory=dict)
    padding_tokens: float = float("nan")
    worst_window_samples: dict[int, float] = field(default_factory=dict)
    mix: str = "step"

    @property
    def name(self) -> str:
        """The row's name: the mode, its window and its mix granularity (as ``inspect``'s)."""
        return f"planned (K={self.window_steps}, {self.mix})"

    def lost(self, ranks: int) -> float:
        """Compute lost at ``ranks``: idle per optimizer step + padding by tokens."""
        return lost_compute(self.idle_step[ranks], self.padding_tokens)

    @property
    def worst_mix_samples(self) -> dict[int, float]:
        """``{ranks: worst deviation}`` where the mix is held: per step or per window."""
        return self.worst_step_samples if self.mix == "step" else self.worst_window_samples


def planned_window_steps(mix: str, draws_per_step: int, window_steps: int | None,
                         sizes: Sequence[int] | None = None,
                         weights: Sequence[float] | None = None) -> int:
    """K of a planned prediction: ``window_steps``, or ``mix``'s default for a global batch of
    ``draws_per_step`` samples (:func:`~energon_ordering.planned.window_size.
    default_window_steps`), at most the steps in which no source of ``sizes`` samples is drawn
    beyond its size at ``weights`` (the build's bound on repeating data:
    :func:`~energon_ordering.planned.window_size.steps_within_an_epoch`)."""
    if window_steps is not None:
        return window_steps
    k = default_window_steps(mix, draws_per_step)
    if sizes is not None and weights is not None:
        k = min(k, steps_within_an_epoch(sizes, [weights], draws_per_step))
    return k


def predict_planned(
    pop: LengthPopulation,
    *,
    batch_size: int,
    ranks: Sequence[int],
    step_ranks: int,
    micro_batches_per_step: int = 1,
    steps: int = 1000,
    window_steps: int | None = None,
    seed: int = 0,
    has_index: bool | None = None,
    mix: str = "step",
    source_sizes: Mapping[str, int] | None = None,
) -> PlannedPrediction:
    """The planned order of ``pop``'s lengths (split by source, blended by each source's share
    of the population) at each rank count, measured like :func:`predict_order`.

    Args:
        pop: The length population.
        batch_size: Micro-batch size, in samples.
        ranks: Rank counts to plan for.
        step_ranks: The run's data-parallel size (padding, dispersion and the per-step mix).
        micro_batches_per_step: Micro-batches per rank per optimizer step (M).
        steps: Micro-batches per rank, as ``predict_order``'s: ``steps // M`` optimizer steps
            are planned (whole windows, at most :data:`PLANNED_MAX_SAMPLES` samples per rank
            count, at least one window).
        window_steps: K, ``plan_window_steps``; None: the default of ``mix`` at each rank
            count's global batch (:func:`~energon_ordering.planned.window_size.
            default_window_steps`).
        seed: The ordering seed.
        has_index: Whether every dataset has a length index (default: the population's lengths
            come from one).
        mix: ``planned_mix``, ``"step"`` or ``"window"``.
        source_sizes: ``{source: samples}`` of the data (:func:`data_sizes`): the default K
            draws no source beyond its size, as the build's does (None: not bounded).
    """
    m = micro_batches_per_step
    present = [j for j in range(len(pop.source_names)) if (pop.sources == j).any()]
    per_source = [pop.lengths[pop.sources == j] for j in present]
    weights = np.array([len(x) for x in per_source], dtype=np.float64)
    sizes = (None if source_sizes is None else
             [int(source_sizes.get(pop.source_names[j], 0)) for j in present])
    idle: dict[int, float] = {}
    idle_step: dict[int, float] = {}
    worst: dict[int, float] = {}
    worst_window: dict[int, float] = {}
    plan_seconds: dict[int, float] = {}
    planned_steps: dict[int, int] = {}
    padding = padding_tokens = disp_batch = disp_step = float("nan")
    share_pp: dict[str, tuple[float, float]] = {}
    for r in sorted(set(ranks) | {step_ranks}):
        g = r * m * batch_size
        k = planned_window_steps(mix, g, window_steps, sizes, weights)
        windows = max(1, min(-(-max(1, steps // m) // k), PLANNED_MAX_SAMPLES // (k * g)))
        run = planned_run(per_source, weights, world_size=r, micro_batch=batch_size,
                          micro_batches_per_step=m, steps=windows * k,
                          window_steps=k, seed=seed, mix=mix)
        lengths = PlannedRun.rank_major(run.lengths)
        idle[r] = vector_straggler_idle(lengths)
        idle_step[r] = step_straggler_idle(lengths, m)
        worst[r] = run.worst_step_samples
        worst_window[r] = run.worst_window_samples
        plan_seconds[r] = run.plan_seconds_per_step
        planned_steps[r] = windows * k
        if r != step_ranks:
            continue
        padding, padding_tokens = _padding(lengths), padding_by_tokens(lengths)
        if len(pop.source_names) > 1:
            codes = np.asarray(present)[run.sources]  # population source codes
            disp_batch, disp_step, share_pp = _source_mix(pop, PlannedRun.rank_major(codes), m)
    return PlannedPrediction(
        planned_window_steps(mix, step_ranks * m * batch_size, window_steps, sizes, weights),
        {r: idle[r] for r in sorted(idle)}, padding, disp_batch, disp_step,
        share_pp, worst, plan_seconds, planned_steps,
        pop.origin == "length index" if has_index is None else has_index,
        idle_step={r: idle_step[r] for r in sorted(idle_step)}, padding_tokens=padding_tokens,
        worst_window_samples=worst_window, mix=mix)


# ---- cost of a pool per worker: measured on real loaders -----------------------------------


@dataclass(frozen=True)
class CostPerSample:
    """What a pool costs, measured on real in-process loaders of one placement.

    The time to the first micro-batch is measured at two pool sizes (``measured_pools``) and
    fitted as ``startup_seconds + fill_seconds * pool_size`` (the start-up, building the loader
    and opening the shards, does not grow with the pool); then measured once more at
    ``check_pool``, the largest pool that fits, to check the fit (``check_seconds``).

    Attributes:
        placement: ``"pre-encode"`` or ``"post-encode"``.
        holds: ``"keys"``, ``"raw"`` or ``"encoded"``.
        startup_seconds: Seconds to the first micro-batch that do not depend on the pool.
        fill_seconds: Seconds to the first micro-batch per pooled sample.
        bytes_per_sample: Resident bytes the pool holds per pooled sample (larger measurement).
        measured_pools: The two pool sizes of the fit.
        check_pool: Pool size of the check (0: none, the data fits no larger pool).
        check_seconds: Measured first batch at ``check_pool`` (nan without a check).
        note: Why it could not be measured (then the figures are nan).
    """

    placement: str
    holds: str
    startup_seconds: float
    fill_seconds: float
    bytes_per_sample: float
    measured_pools: tuple[int, int]
    check_pool: int = 0
    check_seconds: float = float("nan")
    note: str = ""

    @property
    def measured_pool(self) -> int:
        """The larger pool of the fit."""
        return self.measured_pools[-1]

    def fill_seconds_at(self, pool_size: int) -> float:
        """Predicted seconds to the first micro-batch when the first pool holds ``pool_size``
        samples (no ramp: the fitted model itself)."""
        return self.startup_seconds + self.fill_seconds * pool_size

    def first_batch_seconds(self, pool_size: int) -> float:
        """Predicted seconds to the first micro-batch with ``length_sort_pool_size = pool_size``
        as the package builds it: a pool of 10,000 or more ramps by default
        (:mod:`energon_ordering.pool.ramp`), so its first batch waits for the first, smaller
        pool only."""
        first = pool_size_at(0, pool_size, ramp=pool_size >= RAMP_MIN_POOL)
        return self.fill_seconds_at(first)

    def memory_bytes(self, pool_size: int) -> float:
        return self.bytes_per_sample * pool_size

    @property
    def check_ratio(self) -> float:
        """Predicted over measured first batch at ``check_pool`` (nan without a check)."""
        if not self.check_pool or not self.check_seconds > 0:
            return float("nan")
        return self.fill_seconds_at(self.check_pool) / self.check_seconds


def fit_first_batch(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """``(startup, per_sample)`` of a least-squares line through ``(size, seconds)``, both
    clamped at 0 (noise can tilt a line through two close points)."""
    x, y = np.asarray(sizes, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    slope = float(np.polyfit(x, y, 1)[0]) if len(set(sizes)) > 1 else 0.0
    slope = max(0.0, slope)
    startup = max(0.0, float(np.mean(y - slope * x)))
    return startup, slope


def _first_batch(path: str | Path, cfg: OrderingConfig, batch_size: int,
                 factory: Callable[[], Any]) -> tuple[float, float]:
    """CPU seconds (this process's) from building a real in-process loader to its first
    micro-batch, and the bytes its pool holds per pooled sample at that moment. CPU time, not
    wall time: a loader without workers runs on this process alone, so on a dedicated core the
    two agree, and the machine's other load (other ranks, a busy CI) does not enter the fit."""
    import gc

    from energon_ordering.inspect.pool_memory import find_stage, pool_holdings, resident_bytes
    from energon_ordering.inspect.rank_simulation import TRAINING_GC, build_train_loader, close_loader
    from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset
    from energon_ordering.pool.length_pool_sort import LengthPoolSortDataset

    gc.collect()
    t0 = time.process_time()
    # Energon's default garbage collection, as in training: its first full collect is part of
    # a training loader's first batch (simulations turn it off, rank_simulation.SIMULATION_GC)
    loader = build_train_loader(path, ordering=cfg, batch_size=batch_size,
                                task_encoder_factory=factory, **TRAINING_GC)
    it = iter(loader)
    next(it)
    seconds = time.process_time() - t0
    pool = find_stage(loader.dataset, (KeyPoolSortDataset, LengthPoolSortDataset))
    n, held = pool_holdings(pool)
    held_bytes = resident_bytes(held)
    del it, pool, held
    close_loader(loader)
    return seconds, held_bytes / max(1, n)


def measure_costs(
    path: str | Path,
    *,
    batch_size: int,
    task_encoder_factory: Callable[[], Any] | None = None,
    pool_sizes: tuple[int, int] = (128, 512),
    check_pool: int = 0,
    repeats: int = 3,
    length_index: str | None = None,
) -> list[CostPerSample]:
    """Time to first batch (fitted over ``pool_sizes``, checked at ``check_pool`` if it is
    larger) and pool memory per pooled sample, for each placement, on real in-process loaders
    of ``path``. Pool sizes are rounded down to the micro-batch; every time is the fastest of
    ``repeats`` loaders (the others were slowed by the rest of the machine)."""
    from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder

    factory = task_encoder_factory or LengthEstimateTaskEncoder
    fit_sizes = tuple(max(batch_size, n // batch_size * batch_size) for n in pool_sizes)
    check_pool = check_pool // batch_size * batch_size
    if check_pool <= max(fit_sizes):
        check_pool = 0
    costs = []
    warm = True  # the process's first loader pays one-off imports and caches: not the pool's
    for placement, holds in PLACEMENTS:
        def cfg(n: int) -> OrderingConfig:
            return OrderingConfig(
                length_sort_pool_size=n, length_sort_mode="batch", length_sort_placement=placement,
                length_sort_pool_holds=holds if placement == "pre-encode" else "raw",
                length_sort_pool_ramp=False,  # the fit models a full first pool of n
                length_index=length_index)

        try:
            if warm:
                _first_batch(path, cfg(fit_sizes[0]), batch_size, factory)
                warm = False
            def fastest(n: int) -> tuple[float, float]:
                runs = [_first_batch(path, cfg(n), batch_size, factory)
                        for _ in range(max(1, repeats))]
                return min(t for t, _ in runs), runs[-1][1]

            runs = [fastest(n) for n in fit_sizes]
            check = fastest(check_pool)[0] if check_pool else float("nan")
        except OrderingError as e:  # reported per placement, e.g. no length index
            costs.append(CostPerSample(placement, holds, float("nan"), float("nan"), float("nan"),
                                       fit_sizes, note=str(e).split("\n")[0][:160]))
            continue
        startup, per_sample = fit_first_batch(fit_sizes, [t for t, _ in runs])
        costs.append(CostPerSample(placement, holds, startup, per_sample, runs[-1][1], fit_sizes,
                                   check_pool, check))
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
        rank_counts: Rank counts of the idle predictions.
        num_workers: Loader workers per rank.
        total_samples: Samples in the dataset's train split.
        share: A loader worker's share of the data (samples per epoch): the largest pool the
            package accepts at ``ranks`` x ``num_workers``.
        other_mode: Set when no feasible pool reaches :data:`GOOD_IDLE` idle per optimizer
            step at ``ranks``: what another mode would gain.
        planned: The planned order's prediction compared with the pools: of
            ``planned_mixes``, the mix granularity that loses the least compute at ``ranks``
            (None: not predicted).
        micro_batches_per_step: Micro-batches per rank per optimizer step.
        planned_mixes: The planned order's prediction at every mix granularity
            (``planned_mix``: ``"step"``, ``"window"``), a table row each.
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
    num_workers: int = 0
    total_samples: int = 0
    share: int = 0
    other_mode: str | None = None
    planned: PlannedPrediction | None = None
    micro_batches_per_step: int = 1
    planned_mixes: tuple[PlannedPrediction, ...] = ()

    def samples_needed(self, pool_size: int) -> int:
        """Samples the dataset needs for a pool of ``pool_size`` at this job's ranks and workers."""
        return pool_size * self.ranks * max(1, self.num_workers)


def best_planned(planned: Sequence[PlannedPrediction], ranks: int) -> PlannedPrediction | None:
    """Of the planned order's predictions (one per mix granularity), the one that loses the
    least compute at ``ranks`` (the first on a tie: ``"step"``, the default); None for none."""
    return min(planned, key=lambda p: p.lost(ranks), default=None)


def recommend(
    predictions: Sequence[OrderPrediction],
    costs: Sequence[CostPerSample],
    *,
    ranks: int,
    memory_budget: float,
    share: int | None = None,
    tolerance: float = 0.002,
    planned: PlannedPrediction | Sequence[PlannedPrediction] | None = None,
) -> tuple[tuple[str, str, str, int] | None, str]:
    """The setting that loses the least compute at ``ranks`` (straggler idle per optimizer step
    + padding by tokens, :func:`~energon_ordering.inspect.lost_compute.lost_compute`) among the
    pools the package accepts (``pool_size <= share``, a loader worker's share of the data)
    within the memory budget; among those within ``tolerance`` of the best, the smallest pool
    (fastest start), then the leanest placement.

    ``planned`` is the planned order's prediction, or one per mix granularity (of which the one
    that loses the least, :func:`best_planned`, is compared; the reason names its
    ``planned_mix`` and the other's figure). With a length index for every dataset
    (``has_index``), the planned order, ``("pre-encode", "keys", "planned", 0)``, when it loses
    less than that pool by more than ``tolerance`` (within it, the pool: no index needed, the
    reading path unchanged), or when no pool fits the share or the budget (it needs no pool
    memory). Without an index it is never recommended (:func:`planned_note` says so).

    Without ``costs`` (``advise --no-measure``) the choice rests on idle and padding alone: no
    memory budget applies, and the placement is the default one (post-encode, raw), which the
    reason says.
    """
    rec, reason, lost = _recommend_pool(predictions, costs, ranks=ranks,
                                        memory_budget=memory_budget, share=share,
                                        tolerance=tolerance)
    mixes = [planned] if isinstance(planned, PlannedPrediction) else list(planned or ())
    best = best_planned([p for p in mixes if p.has_index], ranks)
    if best is None:
        return rec, reason
    lost_planned = best.lost(ranks)
    if lost is not None and lost_planned >= lost - tolerance:
        return rec, reason
    versus = (f"{100 * lost:.1f}% for the best pool setting, {rec[2]} {rec[3]:,} {rec[0]}/"
              f"{rec[1]}" if lost is not None and rec is not None else f"no pool: {reason}")
    others = "".join(f", planned_mix: {p.mix} {100 * p.lost(ranks):.1f}%" for p in mixes
                     if p is not best)
    held = ("every step holds each source's weight x global batch" if best.mix == "step" else
            f"every window of {best.window_steps} steps holds each source's weights x global "
            "batch")
    return ("pre-encode", "keys", "planned", 0), (
        f"planned_mix: {best.mix} {_loses(best, ranks)}; against {versus}{others}; {held} within "
        f"{best.worst_mix_samples[ranks]:.1f} samples; no pool memory; planning takes "
        f"{1e3 * best.plan_seconds[ranks]:,.1f} ms per step per rank"
        + ("" if costs else " (--no-measure: from idle and padding alone)")
    )


def _loses(p: OrderPrediction | PlannedPrediction, ranks: int) -> str:
    """What a setting loses at ``ranks``, and of what."""
    return (f"loses {100 * p.lost(ranks):.1f}% of compute at {ranks:,} ranks (idle per optimizer "
            f"step {100 * p.idle_step[ranks]:.1f}% + padding by tokens "
            f"{100 * p.padding_tokens:.1f}%)")


def _recommend_pool(
    predictions: Sequence[OrderPrediction],
    costs: Sequence[CostPerSample],
    *,
    ranks: int,
    memory_budget: float,
    share: int | None,
    tolerance: float,
) -> tuple[tuple[str, str, str, int] | None, str, float | None]:
    """:func:`recommend` among the pools: the setting, why, and the compute it loses."""
    feasible = [p for p in predictions if 0 < p.pool_size and (share is None or p.pool_size <= share)]
    if not feasible:
        return None, (f"no pool fits a loader worker's share of the data ({share:,} samples); "
                      "add data, or lower --ranks or --num-workers"), None
    within = f" and a loader worker's share ({share:,} samples)" if share is not None else ""
    if not costs:  # --no-measure: idle and padding alone, the default placement
        options = [(p.lost(ranks), p) for p in feasible]
        best = min(o[0] for o in options)
        lost, p = min((o for o in options if o[0] <= best + tolerance),
                      key=lambda o: o[1].pool_size)
        return ("post-encode", "raw", p.mode, p.pool_size), (
            f"--no-measure: chosen from idle and padding alone, memory and time to first batch "
            f"not measured, so the placement is the default (measure to choose it); "
            f"{_loses(p, ranks)} (best {100 * best:.1f}%), the smallest pool within {100 * tolerance:.1f} points of the "
            f"best" + (f" within a loader worker's share ({share:,} samples)" if share else "")
        ), lost
    options = []
    for p in feasible:
        for c in costs:
            if math.isnan(c.bytes_per_sample) or c.memory_bytes(p.pool_size) > memory_budget:
                continue
            options.append((p.lost(ranks), p, c))
    if not options:
        return None, "no pool fits the memory budget; raise --memory-per-worker", None
    best = min(o[0] for o in options)
    near = [o for o in options if o[0] <= best + tolerance]
    lost, p, c = min(near, key=lambda o: (o[1].pool_size, o[2].memory_bytes(o[1].pool_size)))
    return (c.placement, c.holds, p.mode, p.pool_size), (
        f"{_loses(p, ranks)} (best {100 * best:.1f}%), the smallest pool within "
        f"{100 * tolerance:.1f} points of the best that fits {memory_budget / 2**20:,.0f} MiB per worker{within}"
    ), lost


def planned_note(advice: Advice) -> str | None:
    """One line about the planned order when ``advise`` does not recommend it for want of a
    length index (planned mode plans from one); None otherwise."""
    p = advice.planned
    if p is None or p.has_index:
        return None
    r = advice.ranks
    return (f"planned order: not recommended, it needs a length index for every dataset (the "
            f"lengths here: {advice.population.origin}); with planned_mix: {p.mix} it would "
            f"lose {100 * p.lost(r):.1f}% of compute at {r:,} ranks (idle per optimizer step + "
            "padding by tokens); build the indexes with "
            "`energon-ordering index DATASET`, then run advise again.")


def planned_requirements() -> str:
    """What a recommended planned order needs beside ``length_sort_mode: planned``."""
    return ("planned mode needs length_sort_placement: pre-encode, length_sort_pool_holds: keys "
            "and a length index for every dataset (with packing also pack_seq_length: the plan "
            "builds the packs); plan_window_steps defaults to about 2^19 samples' worth of steps "
            f"({DEFAULT_WINDOW_STEPS}-128) with planned_mix: step, which holds each source's "
            "share in every optimizer step, and to about 2^22 samples' worth (2^20 under a "
            "sequence-length warmup; at most 4,096) with "
            "planned_mix: window, which holds it in every plan window (its steps free to take one "
            "band of lengths each).")


def other_mode_note(advice: Advice, good: float = GOOD_IDLE) -> str | None:
    """A line when no pool the package accepts reaches ``good`` idle per optimizer step at the
    requested ranks: what the best feasible pool gives, what a larger pool would need, and that
    a global order across ranks (the planned mode) would do better."""
    r = advice.ranks
    feasible = [p for p in advice.predictions if 0 < p.pool_size <= advice.share]
    larger = [p for p in advice.predictions if p.pool_size > advice.share]
    best = min(feasible, key=lambda p: p.idle_step[r], default=None)
    if best is not None and best.idle_step[r] <= good:
        return None
    have = (f"the best pool the package accepts here ({best.mode} {best.pool_size:,}) leaves "
            f"{100 * best.idle_step[r]:.1f}% idle per optimizer step" if best
            else "no pool fits a loader worker's share")
    reach = min((p for p in larger if p.idle_step[r] <= good), key=lambda p: p.pool_size,
                default=None)
    need = (f"; a {reach.mode} pool of {reach.pool_size:,} would reach "
            f"{100 * reach.idle_step[r]:.1f}% but needs "
            f"{advice.samples_needed(reach.pool_size):,} samples" if reach else "")
    planned = advice.planned
    if planned is None or r not in planned.idle:
        other = ("Another mode would do better: a global order planned across all ranks "
                 "(length_sort_mode: planned) needs no per-worker pool.")
    else:
        better = best is None or planned.lost(r) < best.lost(r)
        other = (("Another mode would do better: " if better else "Another mode: ")
                 + f"the planned order (row {planned.name}) leaves "
                 f"{100 * planned.idle_step[r]:.1f}% idle per optimizer step and "
                 f"{100 * planned.padding_tokens:.1f}% padding by tokens with no per-worker pool"
                 + ("." if better else f", {100 * planned.lost(r):.1f}% of compute lost "
                    f"against {100 * best.lost(r):.1f}% (more micro-batches per step give the "
                    "plan more to balance)."))
    return (f"no feasible pool reaches {100 * good:.0f}% idle per optimizer step at {r:,} ranks: "
            f"{have}{need}. "
            + other)


def source_mix_note(advice: Advice, limit: float = 1.5) -> str | None:
    """The per-step source mix of the recommended setting, of no pool and of ``stratified`` at
    the same size, in absolute terms (percentage points) beside dispersion, with both defined;
    None with one source or nothing recommended."""
    if advice.recommended is None:
        return None
    _, _, mode, size = advice.recommended
    pick: dict[tuple[str, int], Any] = {(p.mode, p.pool_size): p for p in advice.predictions}
    if advice.planned is not None:
        pick[("planned", 0)] = advice.planned
    rec = pick.get((mode, size))
    if rec is None or not rec.step_share_pp:
        return None
    off = pick.get(("off", 0))
    alt = pick.get(("stratified", size))
    r = advice.ranks

    def mix(p: OrderPrediction) -> str:
        parts = ", ".join(f"{s} {t:.1f}/{w:.1f}" for s, (t, w) in p.step_share_pp.items())
        return f"dispersion {p.dispersion_step:.2f}; pp typical/worst: {parts}"

    lines = [
        "per-step source mix: a step is every sample of all ranks' micro-batches of one optimizer "
        "step. pp = how far a source's share of a step lies from its share of the data, in "
        "percentage points: typical = median step, worst = worst step. dispersion = variance of "
        "the per-step counts over that of independent draws (1 = as random, higher = clumped).",
        f"  {rec.name if mode == 'planned' else f'{mode} {size:,}'}: {mix(rec)}",
    ]
    if off is not None and off.step_share_pp:
        lines.append(f"  no pool: {mix(off)}")
    if alt is not None and mode != "stratified" and rec.dispersion_step > limit:
        lines.append(
            f"  stratified {size:,}: {mix(alt)}; at {r:,} ranks idle per optimizer step "
            f"{100 * alt.idle_step[r]:.1f}%, padding by tokens {100 * alt.padding_tokens:.1f}%. "
            "stratified builds every micro-batch from one "
            "sample of each length band, so each micro-batch spans the length range; every rank "
            "takes the same bands, so a step repeats one micro-batch's mix across the ranks: it "
            "evens the mix only as far as sources differ in length.")
    return "\n".join(lines)


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
    window_steps: int | None = None,
    length_index: str | None = None,
) -> Advice:
    """Predicts every (mode, pool size) and the planned order, measures every placement;
    recommends one setting the package accepts.

    Args:
        path: Prepared dataset or metadataset.
        ranks: Data-parallel ranks of the run.
        batch_size: Micro-batch size.
        num_workers: Loader workers per rank.
        memory_per_worker: Bytes a pool may hold per loader worker.
        micro_batches_per_step: Micro-batches per rank per optimizer step.
        pool_sizes: Pool sizes to predict (rounded down to the micro-batch); the largest pool
            within a loader worker's share is added.
        rank_counts: Rank counts of the idle curves (``ranks`` is added).
        steps: Micro-batches simulated per rank.
        seed: Ordering seed.
        task_encoder_factory: Length estimate without a length index, and the encoder of the
            measured loaders.
        measure: Measure time to first batch and memory on real loaders.
        progress: Called with a line of text per stage.
        window_steps: ``plan_window_steps`` of the planned order's prediction; None: each
            ``planned_mix``'s default at the run's global batch.
        length_index: The length index to read where a dataset has several (None: its only
            one; ``OrderingConfig.length_index``).

    Raises:
        OrderingConfigError: See :func:`check_inputs` (checked before anything is allocated).
    """
    say = progress or (lambda _: None)
    if ranks < 1 or batch_size < 1 or steps < 1:
        raise OrderingConfigError(f"advise: ranks = {ranks}, batch_size = {batch_size}, "
                                  f"steps = {steps}; all must be >= 1.")
    sizes = data_sizes(path)
    check_inputs(sizes, ranks=ranks, batch_size=batch_size, num_workers=num_workers, steps=steps,
                 rank_counts=rank_counts)
    total = sum(n for _, n, _ in sizes)
    share = worker_share([n for _, n, _ in sizes], ranks, num_workers)
    say("lengths")
    pop = load_population(path, task_encoder_factory=task_encoder_factory, seed=seed,
                          length_index=length_index)
    counts = tuple(sorted(set(rank_counts) | {ranks}))
    cache = _OrderCache()
    sizes_to_predict = sorted({max(batch_size, n // batch_size * batch_size) for n in pool_sizes})
    largest_fit = share // batch_size * batch_size
    if batch_size <= largest_fit < sizes_to_predict[-1]:
        sizes_to_predict = sorted(set(sizes_to_predict) | {largest_fit})
    predictions = []
    common = dict(batch_size=batch_size, ranks=counts, step_ranks=ranks, num_workers=num_workers,
                  micro_batches_per_step=micro_batches_per_step, steps=steps, seed=seed, cache=cache)
    say("pool off")
    predictions.append(predict_order(pop, mode="off", pool_size=0, **common))
    for mode in POOL_ORDERS:
        for size in sizes_to_predict:
            say(f"{mode} pool {size:,}")
            predictions.append(predict_order(pop, mode=mode, pool_size=size, **common))
    mixes = []
    source_sizes = source_samples(sizes)
    for mix in PLANNED_MIXES:
        say(f"planned order (planned_mix: {mix})")
        mixes.append(predict_planned(pop, batch_size=batch_size, ranks=counts, step_ranks=ranks,
                                     micro_batches_per_step=micro_batches_per_step, steps=steps,
                                     window_steps=window_steps, seed=seed, mix=mix,
                                     source_sizes=source_sizes))
    planned = best_planned(mixes, ranks)
    costs = []
    if measure:
        say("measuring time to first batch and memory on real loaders")
        # The measuring loader is one in-process rank: its share is the whole dataset.
        check = min(total, max([p.pool_size for p in predictions if p.pool_size <= share],
                               default=0))
        # Fit below the largest pool that fits, check at it; with too little data for that,
        # fit at small pools and say that there is no check.
        fit = (check // 8, check // 2) if check >= 512 else (min(128, total), min(512, total))
        costs = measure_costs(path, batch_size=batch_size, task_encoder_factory=task_encoder_factory,
                              pool_sizes=fit, check_pool=check, length_index=length_index)
    recommended, reason = recommend(predictions, costs, ranks=ranks,
                                    memory_budget=memory_per_worker, share=share,
                                    planned=mixes)
    adv = Advice(pop, ranks, batch_size, predictions, costs, memory_per_worker, recommended,
                 reason, counts, num_workers, total, share, planned=planned,
                 micro_batches_per_step=micro_batches_per_step, planned_mixes=tuple(mixes))
    return dataclasses.replace(adv, other_mode=other_mode_note(adv))


#: Line styles of the pool modes in ``advise.png``, and of the planned order's mixes.
_MODE_STYLES = (("batch", "-"), ("sample", "--"), ("stratified", "-."))
_MIX_STYLES = {"step": (0, (6, 2)), "window": (0, (1, 1.5))}


def _pool_axis(sizes: list[int], share: int) -> tuple[float, float]:
    """The pool-size axis of ``advise.png``: the predicted pools, widened to the left so that
    the accepted pools (up to ``share``) take at least a quarter of the (log) width."""
    x_hi = sizes[-1] * 1.5
    x_lo = sizes[0] / 2
    if sizes[0] <= share < x_hi:
        x_lo = min(x_lo, math.exp((math.log(share) - 0.25 * math.log(x_hi)) / 0.75))
    return x_lo, x_hi


def _accepted_band(ax: Any, share: int, x_lo: float, x_hi: float, first: int,
                   legend: bool) -> None:
    """The pools the package accepts, a green band from the axis' left edge to a worker's share
    edged by a line at the share, and the refused ones hatched, each named inside the panel."""
    if share < first:
        if legend:
            ax.plot([], [], " ", label=f"no pool accepted: a worker's share is {share:,} samples")
        ax.axvspan(x_lo, x_hi, facecolor="none", edgecolor="grey", hatch="//", lw=0, alpha=0.5)
        return
    edge = min(share, x_hi)
    ax.axvspan(x_lo, edge, color="tab:green", alpha=0.25, lw=0,
               label=f"accepted pools: up to {share:,} samples (a worker's share)"
               if legend else None)
    ax.axvline(edge, color="tab:green", lw=2)
    where = ax.get_xaxis_transform()  # x in data, y in axes
    box = {"facecolor": "white", "alpha": 0.8, "lw": 0}
    ax.text(math.sqrt(x_lo * edge), 0.97, "accepted", transform=where, ha="center", va="top",
            color="darkgreen", fontsize=9, fontweight="bold", bbox=box)
    if edge < x_hi:
        ax.axvspan(edge, x_hi, facecolor="none", edgecolor="grey", hatch="//", lw=0, alpha=0.5,
                   label="refused: needs more data (pool x ranks x workers)" if legend else None)
        ax.text(math.sqrt(edge * x_hi), 0.97, "refused: needs more data", transform=where,
                ha="center", va="top", color="dimgrey", fontsize=8, bbox=box)


def plot_advice(path: str | Path, advice: Advice) -> Path:
    """``advise.png``. Left: predicted straggler idle per optimizer step (log axis) against pool
    size, one colour per rank count (batch solid, sample dashed, stratified dash-dot), the idle
    per micro-batch of batch pools at the requested ranks dotted, the no-pool level and the
    planned order's (each mix granularity) at the requested ranks as labelled reference lines.
    Middle: lost compute at the requested ranks (idle per optimizer step + padding by tokens,
    what the recommendation ranks by) of each mode, the no-pool and planned levels, and the
    recommended setting starred (the planned order's at the right edge). On both, the pools the
    package accepts are a green band, the refused ones hatched. Right: predicted time to first
    batch and memory per loader worker of each placement, with the measured check."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, lost_ax, cost_ax) = plt.subplots(1, 3, figsize=(18, 5.2), layout="constrained")
    floor = 1e-2  # percent: a log axis needs a floor for exact zeros
    r = advice.ranks
    off = next(p for p in advice.predictions if p.pool_size == 0)
    sizes = sorted({p.pool_size for p in advice.predictions if p.pool_size})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    x_lo, x_hi = _pool_axis(sizes, advice.share)
    pct = lambda v: max(floor, 100 * v)  # noqa: E731
    for i, n in enumerate(advice.rank_counts):
        color = colors[i % len(colors)]
        for mode, style in _MODE_STYLES:
            pts = sorted((p.pool_size, p.idle_step[n]) for p in advice.predictions
                         if p.mode == mode)
            if pts:
                xs, ys = zip(*pts)
                label = f"{n:,} ranks" + (" (requested)" if n == r else "")
                ax.plot(xs, [pct(y) for y in ys], style, color=color, marker="o", ms=3,
                        lw=2 if n == r else 1, label=label if mode == "batch" else None)
    mb = sorted((p.pool_size, p.idle[r]) for p in advice.predictions if p.mode == "batch")
    if mb and advice.micro_batches_per_step > 1:
        xs, ys = zip(*mb)
        ax.plot(xs, [pct(y) for y in ys], "-", color="grey", lw=1, marker="x", ms=5,
                label=f"batch, {r:,} ranks: idle per micro-batch")
    ax.axhline(pct(off.idle_step[r]), color="black", lw=1, ls=":",
               label=f"no pool, {r:,} ranks: {100 * off.idle_step[r]:.1f}%")
    planned = list(advice.planned_mixes) or ([advice.planned] if advice.planned else [])
    for p in planned:
        if r in p.idle_step:
            ax.axhline(pct(p.idle_step[r]), color="black", lw=1.2, ls=_MIX_STYLES[p.mix],
                       label=f"{p.name}, {r:,} ranks: {100 * p.idle_step[r]:.2f}%"
                       + ("" if p.has_index else " (needs a length index)"))
    ax.axhline(100 * GOOD_IDLE, color="grey", lw=0.6)
    ax.set_ylabel("predicted straggler idle per optimizer step (%), log")
    ax.set_title(f"idle per optimizer step (micro-batch {advice.batch_size}, "
                 f"{advice.micro_batches_per_step} per step)\nbatch solid, sample dashed, "
                 "stratified dash-dot", fontsize=9)

    for mode, style in _MODE_STYLES:
        pts = sorted((p.pool_size, p.lost(r)) for p in advice.predictions if p.mode == mode)
        if pts:
            xs, ys = zip(*pts)
            lost_ax.plot(xs, [pct(y) for y in ys], style, color="black", marker="o", ms=3,
                         label=f"{mode} pools")
    lost_ax.axhline(pct(off.lost(r)), color="black", lw=1, ls=":",
                    label=f"no pool: {100 * off.lost(r):.1f}%")
    for p in planned:
        lost_ax.axhline(pct(p.lost(r)), color="tab:purple", lw=1.5, ls=_MIX_STYLES[p.mix],
                        label=f"{p.name}: {100 * p.lost(r):.1f}%"
                        + ("" if p.has_index else " (needs a length index)"))
    if advice.recommended is not None:
        _, _, mode, size = advice.recommended
        if mode == "planned" and advice.planned is not None:
            lost_ax.plot([sizes[-1]], [pct(advice.planned.lost(r))], "*", color="red", ms=14,
                         label=f"recommended: {advice.planned.name} (no pool)")
        else:
            rec = next(p for p in advice.predictions if (p.mode, p.pool_size) == (mode, size))
            lost_ax.plot([size], [pct(rec.lost(r))], "*", color="red", ms=14,
                         label=f"recommended: {mode} {size:,}")
    lost_ax.set_ylabel("predicted lost compute (%), log")
    lost_ax.set_title(f"lost compute at {r:,} ranks = idle per optimizer step + padding by "
                      "tokens\nwhat the recommendation ranks by", fontsize=9)
    for i, a in enumerate((ax, lost_ax)):
        _accepted_band(a, advice.share, x_lo, x_hi, sizes[0], legend=i == 0)
        a.set_xlim(x_lo, x_hi)
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("pool size (samples per loader worker)")
        a.legend(fontsize=7, loc="lower left")
        a.grid(True, which="both", alpha=0.3)

    mem_ax = cost_ax.twinx()
    if not advice.costs:
        cost_ax.text(0.5, 0.5, "not measured (--no-measure)", ha="center", va="center",
                     transform=cost_ax.transAxes)
    for i, c in enumerate(advice.costs):
        if c.note:
            continue
        color = colors[i % len(colors)]
        label = f"{c.placement}/{c.holds}"
        cost_ax.plot(sizes, [c.first_batch_seconds(n) for n in sizes], "-", color=color,
                     label=f"{label}: first batch")
        mem_ax.plot(sizes, [c.memory_bytes(n) / 2**20 for n in sizes], "--", color=color,
                    label=f"{label}: memory")
        if c.check_pool:
            cost_ax.plot([c.check_pool], [c.check_seconds], "x", color=color, ms=8,
                         label=f"{label}: measured at {c.check_pool:,}")
    mem_ax.axhline(advice.memory_budget / 2**20, color="grey", lw=0.6, ls=":",
                   label=f"memory budget {advice.memory_budget / 2**20:,.0f} MiB")
    for a in (cost_ax, mem_ax):
        a.set_xscale("log")
        a.set_yscale("log")
    cost_ax.set_xlabel("pool size (samples per loader worker)")
    cost_ax.set_ylabel("predicted time to first batch (s), solid")
    mem_ax.set_ylabel("memory per loader worker (MiB), dashed")
    cost_ax.set_title("cost per loader worker: start-up + per-sample fit", fontsize=9)
    handles = [h for a in (cost_ax, mem_ax) for h in a.get_legend_handles_labels()[0]]
    labels = [t for a in (cost_ax, mem_ax) for t in a.get_legend_handles_labels()[1]]
    if handles:
        cost_ax.legend(handles, labels, fontsize=6, loc="upper left")
    cost_ax.grid(True, which="both", alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
