"""Run an ordering configuration on simulated ranks and measure it (used by the CLI).

Everything here runs real Energon pipelines (``rank_simulation``) and reduces the recorded
batches with the pure functions of :mod:`energon_ordering.inspect.diagnostics`.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from energon_ordering.config import PLANNED, OrderingConfig
from energon_ordering.inspect.diagnostics import (
    batch_cost,
    detect_sawtooth,
    histogram_dispersion,
    padding_waste,
    rank_overlap,
    sources_by_step,
    straggler_idle,
)
from energon_ordering.errors import OrderingConfigError, show
from energon_ordering.inspect.lost_compute import idle_per_step, lost_compute, padding_by_tokens
from energon_ordering.inspect.model_steps import StepMismatch, compare_model_steps, model_steps
from energon_ordering.mixture.schedule import MixtureSchedule
from energon_ordering.inspect.rank_simulation import (
    BatchRecord,
    build_train_loader,
    lengths_by_step,
    planned_window_steps,
    resume,
    run_with_cuts,
)

__all__ = [
    "Measurement",
    "ElasticMismatch",
    "ElasticResumeCheck",
    "ResumeCheck",
    "check_elastic_resume",
    "check_resume",
    "compare_elastic_steps",
    "measure",
    "shard_length",
    "source_lengths_from_indexes",
    "source_sizes_from_metadataset",
]


@dataclass(frozen=True)
class Measurement:
    """Diagnostics of one simulated run (``records[rank][step]``).

    Lost compute (:mod:`energon_ordering.inspect.lost_compute`): ``idle_per_step`` is the
    straggler idle per optimizer step, each rank's micro-batches of a step summed (the ranks
    wait once a step, at the gradient reduction: what pure data parallelism pays; over the
    whole steps every rank ran); ``straggler_idle`` is per micro-batch, the mean over
    micro-batch indexes of the share the ranks wait for the slowest rank's micro-batch (what
    expert parallelism pays, waiting at every micro-batch). ``padding_by_tokens`` is the padding
    weighted by tokens, ``sum(B max L - sum L) / sum(B max L)`` over the micro-batches (the
    GPU computes padding as it computes tokens); ``padding_waste`` the mean over micro-batches
    of their padding ratio, which understates it when long micro-batches hold most tokens.
    ``lost_compute`` is ``idle_per_step + padding_by_tokens``.

    The dispersions are NaN where they cannot be measured (no source names, too few steps) and
    meaningless with one source (the tables print ``-`` then).

    ``histogram_dispersion`` is :func:`~energon_ordering.inspect.diagnostics.histogram_dispersion`
    over each rank's micro-batches (averaged over ranks); ``step_histogram_dispersion`` the same
    over optimizer steps, a step's group being every micro-batch of every rank in that step
    (:func:`~energon_ordering.inspect.diagnostics.sources_by_step`), against the schedule's
    weights at each step when there is one. Both are 1 for independent draws, higher when
    groups are clumped by source.

    With packing, both paddings pad each micro-batch's packs to its longest pack, the costs
    behind both idles sum over documents (attention does not cross documents), and
    ``docs_per_pack`` is the mean number of documents in a pack (NaN without packing).
    """

    straggler_idle: float
    padding_waste: float
    tokens_per_step: float
    histogram_dispersion: float
    step_histogram_dispersion: float
    overlapping_keys: int
    sawtooth: bool
    sawtooth_autocorrelation: dict[str, float]
    sources: tuple[str, ...]
    docs_per_pack: float = float("nan")
    idle_per_step: float = float("nan")
    padding_by_tokens: float = float("nan")
    lost_compute: float = float("nan")


def measure(
    records: list[list[BatchRecord]],
    period_batches: int,
    micro_batches_per_step: int = 1,
    schedule: MixtureSchedule | None = None,
) -> Measurement:
    """Computes the diagnostics table of a run.

    Args:
        records: ``records[rank][micro_batch]``.
        period_batches: The shard length in micro-batches (the sawtooth's period).
        micro_batches_per_step: Groups micro-batches into optimizer steps for the idle per
            step and the per-step dispersion.
        schedule: The mixture schedule; the per-step dispersion then measures the counts
            against its weights at each step (else against the run's overall shares).
    """
    step_lengths = lengths_by_step(records)
    steps = len(step_lengths)
    sources = tuple(sorted({s for rank in records for b in rank for s in b.sources}))
    all_batches = [b for rank in records for b in rank[:steps]]
    per_rank_sources = [[b.sources for b in rank[:steps]] for rank in records]
    if sources and steps > 4:
        period = max(1, min(period_batches, steps // 4))
        flags = [detect_sawtooth(rs, sources, period) for rs in per_rank_sources]
        sawtooth = any(f for f, _ in flags)
        ac = {s: float(np.mean([a[s] for _, a in flags])) for s in sources}
        dispersion = float(np.mean([histogram_dispersion(rs, sources) for rs in per_rank_sources]))
    else:
        sawtooth, ac, dispersion = False, {}, float("nan")
    step_groups = sources_by_step([[b.sources for b in rank] for rank in records], micro_batches_per_step)
    expected = None
    if schedule is not None and set(schedule.sources) >= set(sources):
        table = schedule.weights_table(np.arange(len(step_groups)))
        expected = table[:, [schedule.sources.index(s) for s in sources]]
    packs = [p for b in all_batches for p in b.pack_lengths]
    if packs:
        rows = [[sum(p) for p in b.pack_lengths] for b in all_batches if b.pack_lengths]
        docs_per_pack = float(np.mean([len(p) for p in packs]))
    else:
        rows, docs_per_pack = [list(b.lengths) for b in all_batches], float("nan")
    padding, padding_tokens = padding_waste(rows), padding_by_tokens(_rectangular(rows))
    idle_step = _idle_per_step(records, steps, micro_batches_per_step)
    step_dispersion = (histogram_dispersion(step_groups, sources, expected)
                       if sources and len(step_groups) > 1 else float("nan"))
    return Measurement(
        straggler_idle=straggler_idle(step_lengths),
        padding_waste=padding,
        tokens_per_step=float(np.mean([sum(sum(x) for x in st) for st in step_lengths])),
        histogram_dispersion=dispersion,
        step_histogram_dispersion=step_dispersion,
        overlapping_keys=len(rank_overlap([[k for b in rank for k in b.keys] for rank in records])),
        sawtooth=sawtooth,
        sawtooth_autocorrelation=ac,
        sources=sources,
        docs_per_pack=docs_per_pack,
        idle_per_step=idle_step,
        padding_by_tokens=padding_tokens,
        lost_compute=(lost_compute(idle_step, padding_tokens) if idle_step == idle_step
                      else float("nan")),
    )


def _rectangular(rows: list[list[float]]) -> np.ndarray:
    """Ragged rows as one array, zero-filled (an empty slot to the lost-compute measures)."""
    out = np.zeros((len(rows), max((len(r) for r in rows), default=0)))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _idle_per_step(records: list[list[BatchRecord]], micro_batches: int, m: int) -> float:
    """Idle per optimizer step over the first ``micro_batches`` micro-batches of every rank,
    grouped by ``m`` into steps (NaN when they fill no whole step)."""
    steps = micro_batches // m
    if steps == 0:
        return float("nan")
    costs = np.array([[batch_cost(rank[k].lengths) for rank in records]
                      for k in range(steps * m)])  # [micro-batch, rank]
    return idle_per_step(costs.reshape(steps, m, len(records)).transpose(0, 2, 1))


@dataclass(frozen=True)
class ResumeCheck:
    """Outcome of :func:`check_resume`: ``mismatch`` is None when the streams agree."""

    cut: int
    steps: int
    mismatch: int | None
    expected: BatchRecord | None
    got: BatchRecord | None


def check_resume(
    path: str | Path,
    ordering: OrderingConfig,
    *,
    cut: int,
    steps: int,
    num_workers: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    task_encoder_factory: Callable[[], Any] | None = None,
) -> ResumeCheck:
    """Runs ``steps`` micro-batches uninterrupted and again cut at ``cut`` then restored from
    ``save_state_rank()`` in a fresh loader; compares the sample keys batch by batch."""
    if not 0 <= cut < steps:
        raise OrderingConfigError(f"check_resume: cut = {cut} must lie in [0, steps = {steps}).")

    def make():
        return build_train_loader(path, ordering=ordering, rank=rank, world_size=world_size,
                                  num_workers=num_workers, batch_size=batch_size,
                                  task_encoder_factory=task_encoder_factory)

    full, states = run_with_cuts(make, steps, [cut])
    resumed = resume(make, states[cut], steps - cut)
    for step, got in enumerate(resumed, start=cut):
        if got.keys != full[step].keys:
            return ResumeCheck(cut, steps, step, full[step], got)
    return ResumeCheck(cut, steps, None, None, None)



#: One optimizer step over all ranks: (sample key, source) of every sample, ranks in order.
StepSamples = list[tuple[str, str]]


@dataclass(frozen=True)
class ElasticMismatch:
    """Where an elastic resume differs from the uninterrupted run: the optimizer steps compared
    as one group (one step, or a plan window's part after the cut) and what differs."""

    first_step: int
    last_step: int
    reason: str


@dataclass(frozen=True)
class ElasticResumeCheck:
    """Outcome of :func:`check_elastic_resume`: ``mismatch`` is None when the model sees the
    same after the cut (see :func:`~energon_ordering.inspect.model_steps.compare_model_steps`).

    Steps count optimizer steps; ``samples`` is the number of samples compared after the cut.
    """

    cut_step: int
    end_step: int
    world_size: int
    resume_world_size: int
    micro_batches_per_step: int
    resume_micro_batches_per_step: int
    window_steps: int
    samples: int
    mismatch: StepMismatch | None


def compare_elastic_steps(
    expected: list[StepSamples],
    got: list[StepSamples],
    *,
    first_step: int,
    window_steps: int,
) -> ElasticMismatch | None:
    """Compares the optimizer steps after an elastic resume with the uninterrupted run's.

    A planned resume at another data-parallel size re-plans the rest of its window for the new
    shape from the same samples: which step and rank a sample lands on may change, but every
    plan window (from ``first_step`` on, windows being ``[w * window_steps, (w + 1) *
    window_steps)``) must hold the same multiset of samples (nothing lost, nothing twice) and
    every step the same number of samples from each source.

    Args:
        expected: The uninterrupted run's samples, one entry per optimizer step from
            ``first_step`` on.
        got: The resumed run's, the same steps.
        first_step: The optimizer step of ``expected[0]`` (the cut).
        window_steps: Optimizer steps per plan window.

    Returns:
        The first difference, in step order; None if there is none.
    """
    last = first_step + len(expected) - 1
    if len(got) != len(expected):
        return ElasticMismatch(first_step, last, f"{len(got)} optimizer steps resumed, "
                                                 f"{len(expected)} expected")
    start = 0
    while start < len(expected):
        window = (first_step + start) // window_steps
        stop = min(len(expected), (window + 1) * window_steps - first_step)
        for i in range(start, stop):
            want, have = (Counter(src for _, src in steps[i]) for steps in (expected, got))
            if want != have:
                return ElasticMismatch(
                    first_step + i, first_step + i,
                    f"optimizer step {first_step + i}: samples per source "
                    f"{dict(sorted(want.items()))} expected, got {dict(sorted(have.items()))}")
        want, have = (Counter(k for step in steps[start:stop] for k, _ in step)
                      for steps in (expected, got))
        if want != have:
            missing, extra = sorted((want - have).elements()), sorted((have - want).elements())
            return ElasticMismatch(
                first_step + start, first_step + stop - 1,
                f"plan window {window} (optimizer steps {first_step + start}-"
                f"{first_step + stop - 1}): {len(missing)} samples missing {missing[:4]}, "
                f"{len(extra)} extra or repeated {extra[:4]}")
        start = stop
    return None


def check_elastic_resume(
    path: str | Path,
    ordering: OrderingConfig,
    *,
    cut_step: int,
    end_step: int,
    world_size: int,
    resume_world_size: int,
    num_workers: int,
    batch_size: int,
    task_encoder_factory: Callable[[], Any] | None = None,
) -> ElasticResumeCheck:
    """Runs ``world_size`` ranks uninterrupted to optimizer step ``end_step``, saving each
    rank's ``save_state_rank()`` before step ``cut_step``; restores ``resume_world_size`` fresh
    ranks from those states (rank r from the saved rank r, the ranks beyond the saved size
    from rank 0's, as Megatron-LM reads them) with ``micro_batches_per_step`` scaled to keep the
    global batch, and compares the steps after the cut by what the model sees
    (:func:`~energon_ordering.inspect.model_steps.compare_model_steps`: every step the same
    samples, cut to the same token lengths, in the same packs; the rank and micro-batch a
    sample lands on may differ).

    Only ``length_sort_mode = 'planned'``. Any ``end_step`` after the cut compares: an elastic
    resume keeps every step's samples (each window is composed for the run's first shape, its
    steps dealt onto the new ranks: DESIGN.md, contract 13).
    """
    if ordering.length_sort_mode != PLANNED:
        raise OrderingConfigError(
            f"check_elastic_resume: length_sort_mode = {show(ordering.length_sort_mode)}; only a "
            "'planned' state continues at another data-parallel size: set "
            "length_sort_mode = 'planned', or use check_resume.")
    M = ordering.micro_batches_per_step
    if (world_size * M) % resume_world_size:
        raise OrderingConfigError(
            f"check_elastic_resume: {world_size} ranks x {M} micro-batches per step do not split "
            f"over resume_world_size = {resume_world_size} ranks; it must divide {world_size * M}.")
    M2 = world_size * M // resume_world_size
    if not 0 <= cut_step < end_step:
        raise OrderingConfigError(
            f"check_elastic_resume: cut_step = {cut_step}, end_step = {end_step}: need "
            "0 <= cut_step < end_step (optimizer steps).")
    # as the build settles it (a packed window's default reads the length index)
    K = planned_window_steps(path, ordering, world_size=world_size, batch_size=batch_size,
                             task_encoder_factory=task_encoder_factory)

    def make(cfg: OrderingConfig, rank: int, size: int) -> Callable[[], Any]:
        return lambda: build_train_loader(path, ordering=cfg, rank=rank, world_size=size,
                                          num_workers=num_workers, batch_size=batch_size,
                                          task_encoder_factory=task_encoder_factory)

    full, states = [], []
    for rank in range(world_size):
        records, saved = run_with_cuts(make(ordering, rank, world_size), end_step * M,
                                       [cut_step * M])
        full.append(records)
        states.append(saved[cut_step * M])
    resumed_cfg = dataclasses.replace(ordering, micro_batches_per_step=M2)
    resumed = [resume(make(resumed_cfg, rank, resume_world_size),
                      states[rank if rank < world_size else 0], (end_step - cut_step) * M2)
               for rank in range(resume_world_size)]
    expected = model_steps(full, M)[cut_step:]
    got = model_steps(resumed, M2)
    return ElasticResumeCheck(
        cut_step, end_step, world_size, resume_world_size, M, M2, K,
        sum(len(p.unit) for step in expected for p in step),
        compare_model_steps(expected, got, first_step=cut_step))


def _loaded(path: str | Path) -> list[Any]:
    from megatron.energon import WorkerConfig
    from megatron.energon.metadataset import load_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    return load_dataset(path).get_datasets(
        training=True, split_part="train", worker_config=wc, max_samples_per_sequence=None,
        shuffle_over_epochs_multiplier=1,
    ).datasets


def source_sizes_from_metadataset(path: str | Path) -> dict[str, int]:
    """Samples per source of a metadataset (sources named as the task encoder names them)."""
    from energon_ordering.pipeline.sources import source_name as _source_name

    sizes: dict[str, int] = {}
    for d in _loaded(path):
        name = _source_name(d)
        sizes[name] = sizes.get(name, 0) + len(d.dataset)
    return sizes


def source_lengths_from_indexes(
    path: str | Path, *, name: str | None = None, index_dir: str | Path | None = None,
    max_rows: int = 200_000,
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Document lengths per source from the length indexes of a metadataset's datasets.

    Returns:
        ``({source: lengths}, {source: why it has none})``: a source whose dataset has no
        usable index (missing, stale, ambiguous) is in the second dict, with the reason.
    """
    from energon_ordering.errors import LengthIndexError
    from energon_ordering.length_index.index import LengthIndex, local_dataset_path
    from energon_ordering.pipeline.sources import source_name as _source_name

    lengths: dict[str, list[float]] = {}
    missing: dict[str, str] = {}
    for d in _loaded(path):
        source = _source_name(d)
        try:
            index = LengthIndex.open(local_dataset_path(d.dataset.path), name, index_dir=index_dir)
            lengths.setdefault(source, []).extend(index.lengths(max_rows))
        except LengthIndexError as e:
            missing[source] = str(e)
    for source in missing:
        lengths.pop(source, None)
    return lengths, missing


def shard_length(path: str | Path) -> int:
    """Mean samples per shard over the prepared datasets of ``path`` (a metadataset or one
    dataset folder), from Energon's ``.nv-meta/.info.json``; 0 if unknown."""
    roots = [Path(str(getattr(d.dataset, "path", ""))) for d in _loaded(path)]
    counts: list[int] = []
    for root in roots:
        info = root / ".nv-meta" / ".info.json"
        if info.is_file():
            data = json.loads(info.read_text())
            counts.extend(int(c) for c in (data.get("shard_counts") or {}).values())
    return int(round(float(np.mean(counts)))) if counts else 0


def measurement_dict(m: Measurement) -> dict[str, Any]:
    return dataclasses.asdict(m)
