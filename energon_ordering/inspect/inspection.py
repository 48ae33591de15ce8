"""Run an ordering configuration on simulated ranks and measure it (used by the CLI).

Everything here runs real Energon pipelines (``rank_simulation``) and reduces the recorded
batches with the pure functions of :mod:`energon_ordering.inspect.diagnostics`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from energon_ordering.config import OrderingConfig
from energon_ordering.inspect.diagnostics import (
    detect_sawtooth,
    histogram_dispersion,
    padding_waste,
    rank_overlap,
    sources_by_step,
    straggler_idle,
)
from energon_ordering.errors import OrderingConfigError
from energon_ordering.mixture.schedule import MixtureSchedule
from energon_ordering.inspect.rank_simulation import (
    BatchRecord,
    build_train_loader,
    lengths_by_step,
    resume,
    run_with_cuts,
)

__all__ = [
    "Measurement",
    "ResumeCheck",
    "check_resume",
    "measure",
    "shard_length",
    "source_lengths_from_indexes",
    "source_sizes_from_metadataset",
]


@dataclass(frozen=True)
class Measurement:
    """Diagnostics of one simulated run (``records[rank][step]``).

    ``histogram_dispersion`` is :func:`~energon_ordering.inspect.diagnostics.histogram_dispersion`
    over each rank's micro-batches (averaged over ranks); ``step_histogram_dispersion`` the same
    over optimizer steps, a step's group being every micro-batch of every rank in that step
    (:func:`~energon_ordering.inspect.diagnostics.sources_by_step`), against the schedule's
    weights at each step when there is one. Both are 1 for independent draws, higher when
    groups are clumped by source.

    With packing, ``padding_waste`` pads each micro-batch's packs to its longest pack, the
    costs behind ``straggler_idle`` sum over documents (attention does not cross documents), and
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
        micro_batches_per_step: Groups micro-batches into optimizer steps for the per-step
            dispersion.
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
        padding, docs_per_pack = padding_waste(rows), float(np.mean([len(p) for p in packs]))
    else:
        padding, docs_per_pack = padding_waste([b.lengths for b in all_batches]), float("nan")
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
    )


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
