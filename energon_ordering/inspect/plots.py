"""PNG plots of schedules and runs (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from energon_ordering.inspect.diagnostics import step_idle
from energon_ordering.inspect.rank_simulation import BatchRecord, lengths_by_step
from energon_ordering.mixture.schedule import MixtureSchedule
from energon_ordering.warmup.schedule import SeqLenWarmup

__all__ = ["plot_plan", "plot_run"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_plan(
    path: str | Path,
    *,
    total_steps: int,
    schedule: MixtureSchedule | None,
    warmup: SeqLenWarmup | None,
) -> Path:
    """Weights per source and max_seq_len over the steps of a run."""
    plt = _plt()
    steps = np.unique(np.linspace(0, total_steps - 1, num=min(total_steps, 2000)).astype(int))
    rows = int(schedule is not None) + int(warmup is not None) or 1
    fig, axes = plt.subplots(rows, 1, figsize=(9, 3.2 * rows), squeeze=False)
    ax_i = 0
    if schedule is not None:
        ax = axes[ax_i, 0]
        table = schedule.weights_table(steps)
        ax.stackplot(steps, table.T, labels=schedule.sources)
        ax.set_ylabel("sampling weight")
        ax.set_xlim(0, total_steps)
        ax.set_ylim(0, 1)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(f"mixture schedule ({schedule.fingerprint})")
        ax_i += 1
    if warmup is not None:
        ax = axes[ax_i, 0]
        ax.plot(steps, [warmup.max_seq_len(int(s)) for s in steps])
        ax.set_ylabel("max_seq_len (tokens)")
        ax.set_title(f"sequence-length warmup {warmup.start} -> {warmup.full} over {warmup.warmup_steps} steps")
    if schedule is None and warmup is None:
        axes[0, 0].text(0.5, 0.5, "no schedule and no warmup", ha="center")
    axes[-1, 0].set_xlabel("optimizer step")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(
    path: str | Path,
    *,
    runs: dict[str, list[list[BatchRecord]]],
    micro_batches_per_step: int = 1,
    schedule: MixtureSchedule | None = None,
    warmup: SeqLenWarmup | None = None,
) -> Path:
    """Per-step straggler idle of each run, the realised source mix of the last run against the
    schedule, and its longest sample per micro-batch against the warmup cap."""
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(9, 9.5))
    for name, records in runs.items():
        idle = np.array(step_idle(lengths_by_step(records)))
        axes[0].plot(np.arange(len(idle)), 100 * idle, label=f"{name} (mean {100 * idle.mean():.1f}%)", lw=0.8)
    axes[0].set_ylabel("straggler idle (%)")
    axes[0].set_xlabel("micro-batch")
    axes[0].legend(fontsize=8)
    name, records = list(runs.items())[-1]
    sources = sorted({s for rank in records for b in rank for s in b.sources})
    steps = min(len(r) for r in records)
    batch_index = np.arange(steps)
    if sources:
        counts = np.zeros((steps, len(sources)))
        for rank in records:
            for i, b in enumerate(rank[:steps]):
                for s in b.sources:
                    counts[i, sources.index(s)] += 1
        window = max(1, steps // 25)
        kernel = np.ones(window) / window
        shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        for j, s in enumerate(sources):
            axes[1].plot(batch_index, np.convolve(shares[:, j], kernel, mode="same"), label=f"{s} (realised)")
        if schedule is not None:
            table = schedule.weights_table(batch_index // micro_batches_per_step)
            for j, s in enumerate(schedule.sources):
                axes[1].plot(batch_index, table[:, j], "--", color=axes[1].lines[sources.index(s)].get_color()
                             if s in sources else None, lw=0.8)
        axes[1].set_ylabel(f"source share ({name})")
        axes[1].legend(fontsize=7, ncol=2)
    longest = [max(max(rank[i].lengths) for rank in records) for i in range(steps)]
    axes[2].plot(batch_index, longest, lw=0.8, label=f"longest sample ({name})")
    if warmup is not None:
        axes[2].plot(batch_index, [warmup.max_seq_len(int(i // micro_batches_per_step)) for i in batch_index],
                     "--", label="warmup cap")
    axes[2].set_ylabel("tokens")
    axes[2].set_xlabel("micro-batch")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
