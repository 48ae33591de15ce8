"""PNG plots of schedules and runs (matplotlib, headless).

Each plot has a ``*_figure`` function that returns the matplotlib figure (every panel titled,
both axes labelled, legends outside the data) and a ``plot_*`` function that saves it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from energon_ordering.inspect.diagnostics import source_histograms, sources_by_step, step_idle
from energon_ordering.inspect.rank_simulation import BatchRecord
from energon_ordering.mixture.schedule import MixtureSchedule
from energon_ordering.warmup.schedule import SeqLenWarmup

__all__ = ["plan_figure", "plot_plan", "plot_run", "run_figure"]

#: Where legends go: outside the panel, to the right of the data.
_LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0,
                   "fontsize": 8}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    plt = _plt()
    path = Path(path)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def plan_figure(
    *,
    total_steps: int,
    schedule: MixtureSchedule | None,
    warmup: SeqLenWarmup | None,
    name: str = "recipe",
) -> Any:
    """Weights per source (stacked, first source on top, as in the legend) and max_seq_len
    over the steps ``[0, total_steps)`` of a run; ``name`` (the recipe) titles the figure."""
    plt = _plt()
    steps = np.unique(np.linspace(0, total_steps - 1, num=min(total_steps, 2000)).astype(int))
    rows = int(schedule is not None) + int(warmup is not None) or 1
    fig, axes = plt.subplots(rows, 1, figsize=(10, 3.2 * rows), squeeze=False, sharex=True)
    fig.suptitle(f"plan of {name} ({total_steps:,} steps)")
    ax_i = 0
    if schedule is not None:
        ax = axes[ax_i, 0]
        table = schedule.weights_table(steps)
        # stackplot stacks its first series at the bottom; stack in reverse so that the
        # bands read top to bottom in the order of the legend.
        order = list(range(len(schedule.sources)))[::-1]
        colors = [f"C{i}" for i in range(len(schedule.sources))]
        handles = ax.stackplot(steps, table.T[order], colors=[colors[i] for i in order])
        ax.legend(handles[::-1], schedule.sources, title="source", **_LEGEND_OUTSIDE)
        ax.set_ylabel("sampling weight (share)")
        ax.set_ylim(0, 1)
        ax.set_title("mixture schedule: weight of each source per step")
        ax_i += 1
    if warmup is not None:
        ax = axes[ax_i, 0]
        ax.plot(steps, [warmup.max_seq_len(int(s)) for s in steps])
        ax.set_ylabel("max_seq_len (tokens)")
        ax.set_title(f"sequence-length warmup: {warmup.start:,} -> {warmup.full:,} tokens over "
                     f"{warmup.warmup_steps:,} steps ({warmup.kind})")
    if schedule is None and warmup is None:
        axes[0, 0].text(0.5, 0.5, "no mixture schedule and no warmup in this recipe",
                        ha="center", va="center", transform=axes[0, 0].transAxes)
        axes[0, 0].set_ylabel("-")
        axes[0, 0].set_title("nothing scheduled")
    for ax in axes[:, 0]:
        ax.set_xlim(0, total_steps - 1)
        ax.set_xlabel("optimizer step")
        ax.tick_params(labelbottom=True)
    fig.tight_layout()
    return fig


def plot_plan(
    path: str | Path,
    *,
    total_steps: int,
    schedule: MixtureSchedule | None,
    warmup: SeqLenWarmup | None,
    name: str = "recipe",
) -> Path:
    """Saves :func:`plan_figure` as a PNG at ``path``."""
    return _save(plan_figure(total_steps=total_steps, schedule=schedule, warmup=warmup, name=name),
                 path)


def _step_shares(records: list[list[BatchRecord]], sources: list[str], m: int) -> np.ndarray:
    """Share of each source per optimizer step (all micro-batches of all ranks in the step)."""
    hist = source_histograms(sources_by_step([[b.sources for b in rank] for rank in records], m), sources)
    return hist / np.maximum(hist.sum(axis=1, keepdims=True), 1)


def _rolling(x: np.ndarray, window: int) -> np.ndarray:
    """Centred mean over ``window`` rows (shorter at the ends), per column: no lag."""
    c = np.cumsum(np.vstack([np.zeros((1, x.shape[1])), x]), axis=0)
    idx = np.arange(len(x))
    lo = np.maximum(idx - window // 2, 0)
    hi = np.minimum(idx - window // 2 + window, len(x))
    return (c[hi] - c[lo]) / (hi - lo)[:, None]


def run_figure(
    *,
    runs: dict[str, list[list[BatchRecord]]],
    micro_batches_per_step: int = 1,
    schedule: MixtureSchedule | None = None,
    warmup: SeqLenWarmup | None = None,
    window_steps: int = 10,
    measurements: dict[str, Any] | None = None,
) -> Any:
    """Per optimizer step: straggler idle of each run (each rank's micro-batches of the step
    summed, labelled as such), its legend giving each run's mean idle per optimizer step and,
    from ``measurements`` (``{run: Measurement}``, as the tables), its idle per micro-batch and
    padding by tokens;
    the realised source shares of every run (up to three; else the first, pool off, and the
    last) side by side against the schedule, per step and as a centred mean over
    ``window_steps`` steps; and the longest sample of the last run, against the warmup cap
    when there is a warmup."""
    plt = _plt()
    m = micro_batches_per_step
    names = list(runs)
    shown = names if len(names) <= 3 else [names[0], names[-1]]
    fig = plt.figure(figsize=(12, 11))
    grid = fig.add_gridspec(3, len(shown), height_ratios=[1, 1.15, 1])
    ax_idle = fig.add_subplot(grid[0, :])
    for name, records in runs.items():
        steps = min(len(r) for r in records) // m
        # A rank's cost in a step is the sum over its micro-batches; step_idle takes one
        # "batch" per rank, so concatenate each rank's micro-batches of the step.
        per_rank = [[sum((r[k * m + j].lengths for j in range(m)), ()) for r in records]
                    for k in range(steps)]
        idle = np.array(step_idle(per_rank)) if per_rank else np.zeros(1)
        label = f"{name}: mean {100 * idle.mean():.1f}% per optimizer step"
        got = (measurements or {}).get(name)
        if got is not None:
            label += (f" ({100 * got.straggler_idle:.1f}% per micro-batch); padding "
                      f"{100 * got.padding_by_tokens:.1f}% by tokens")
        ax_idle.plot(np.arange(len(idle)), 100 * idle, lw=0.8, label=label)
    summed = (f"each rank's {m} micro-batches summed; idle per micro-batch in the legend"
              if m > 1 else "one micro-batch per rank per step: the same per micro-batch")
    ax_idle.set_title(f"straggler idle per optimizer step ({summed}): share of the step the "
                      "ranks wait for the slowest", fontsize=10)
    ax_idle.set_xlabel("optimizer step")
    ax_idle.set_ylabel("idle per optimizer step (%)")
    ax_idle.legend(**_LEGEND_OUTSIDE)

    seen = {s for recs in runs.values() for r in recs for b in r for s in b.sources}
    # In the schedule's order (the colours of plan.png), then any other source.
    all_sources = [s for s in (schedule.sources if schedule else ()) if s in seen]
    all_sources += sorted(seen - set(all_sources))
    share_axes = []
    for col, name in enumerate(shown):
        ax = fig.add_subplot(grid[1, col], sharey=share_axes[0] if share_axes else None)
        share_axes.append(ax)
        records = runs[name]
        ax.set_title(f"{name}: source share per optimizer step" if len(shown) < 3
                     else f"{name}:\nsource share per step", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("share of the step's samples")
        if not all_sources:
            ax.text(0.5, 0.5, "the batches carry no source names", ha="center",
                    transform=ax.transAxes)
            continue
        shares = _step_shares(records, all_sources, m)
        x = np.arange(len(shares))
        smooth = _rolling(shares, window_steps) if len(shares) else shares
        for j in range(len(all_sources)):
            ax.plot(x, shares[:, j], color=f"C{j}", lw=0.6, alpha=0.3)
            ax.plot(x, smooth[:, j], color=f"C{j}", lw=1.6)
        if schedule is not None and len(x):
            table = schedule.weights_table(x)
            for s, column in zip(schedule.sources, table.T):
                j = all_sources.index(s) if s in all_sources else len(all_sources)
                ax.plot(x, column, "--", color=f"C{j}", lw=1.0)
        ax.set_xlim(0, max(1, len(x) - 1))
        ax.set_ylim(0, 1)
    if all_sources:
        from matplotlib.lines import Line2D

        targets = {}
        if schedule is not None:
            first, last = schedule.weights(0), schedule.weights(max(0, len(x) - 1))
            targets = {s: f" (target {first[s]:.2f}" + (f" -> {last[s]:.2f})" if abs(
                last[s] - first[s]) > 1e-9 else ")") for s in schedule.sources}
        handles = [Line2D([], [], color=f"C{j}", lw=3, label=f"{s}{targets.get(s, '')}")
                   for j, s in enumerate(all_sources)]
        handles += [Line2D([], [], color="k", lw=0.6, alpha=0.4, label="realised, per step"),
                    Line2D([], [], color="k", lw=1.6,
                           label=f"realised, mean over {window_steps} steps (centred)"),
                    Line2D([], [], color="k", lw=1.0, ls="--", label="scheduled target")]
        share_axes[-1].legend(handles=handles, **_LEGEND_OUTSIDE)

    ax_len = fig.add_subplot(grid[2, :])
    name, records = names[-1], runs[names[-1]]
    steps = min(len(r) for r in records) // m
    longest = [max(max(r[k * m + j].lengths, default=0) for r in records for j in range(m))
               for k in range(steps)]
    ax_len.plot(np.arange(steps), longest, lw=0.8, label=f"longest sample ({name})")
    if warmup is not None:
        ax_len.plot(np.arange(steps), [warmup.max_seq_len(k) for k in range(steps)], "--",
                    label="warmup cap (max_seq_len)")
    ax_len.set_title("longest sample of each step, against the sequence-length warmup cap"
                     if warmup is not None else
                     "longest sample of each step (no sequence-length warmup in this recipe)")
    ax_len.set_xlabel("optimizer step")
    ax_len.set_ylabel("tokens")
    ax_len.legend(**_LEGEND_OUTSIDE)
    for ax in (ax_idle, ax_len):
        ax.set_xlim(0, max(1, steps - 1))
    fig.tight_layout()
    return fig


def plot_run(
    path: str | Path,
    *,
    runs: dict[str, list[list[BatchRecord]]],
    micro_batches_per_step: int = 1,
    schedule: MixtureSchedule | None = None,
    warmup: SeqLenWarmup | None = None,
    window_steps: int = 10,
    note: str | None = None,
    measurements: dict[str, Any] | None = None,
) -> Path:
    """Saves :func:`run_figure` as a PNG at ``path``, with ``note`` printed under it."""
    fig = run_figure(runs=runs, micro_batches_per_step=micro_batches_per_step, schedule=schedule,
                     warmup=warmup, window_steps=window_steps, measurements=measurements)
    if note:
        fig.text(0.01, -0.01, note, ha="left", va="top", fontsize=9, wrap=True)
    return _save(fig, path)
