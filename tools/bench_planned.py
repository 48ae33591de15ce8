#!/usr/bin/env python
"""Benchmark of the planned global order at the length level, every figure measured in this run.

The planned order is a function of lengths only, so 1,024 ranks need no pipelines: the plan of
each window (:func:`energon_ordering.planned.window.plan_window`) is computed exactly as every
rank will compute it, and measured. Micro-batch 4, 8 micro-batches per step, on two mixes:

- ``trimodal``: the package's benchmark mix (one source; 50% ~300, 35% ~1,200, 15% ~4,000
  tokens, :data:`energon_ordering.inspect.synthetic.LENGTH_PROFILES`);
- ``heavy``: issue 23's heavy-tailed two-source mix, weights 0.5 / 0.5: 10% of samples around
  6,000 tokens and the rest around 500, the second source 3x longer.

Side by side at 8, 64, 256 and 1,024 ranks:

- ``planned K=..``: the plan with windows of K steps (K = 1 is a per-step sort);
- ``batch 10k`` / ``batch 100k``: per-rank ``batch`` pools, predicted by ``advise``'s model
  (:func:`energon_ordering.inspect.advise.predict_order`: each rank's pool is drawn from the
  mix, and ordered by the package's own order function);
- ``global sort``: the planned run's own samples (all steps of the setting, from the first K
  measured) sorted globally and dealt out micro-batch by micro-batch (R B neighbours, B
  neighbours per rank; the limit of ``tools/bench_length_sync.py``). It tightens with the run's
  length (more samples sorted together), so it is stated for the run's steps.

Figures (plan time and peak memory: one process computing all of a window's steps and ranks,
as every rank and loader worker will): straggler idle per micro-batch index (DESIGN.md; ``advise.vector_straggler_idle``),
padding waste (``advise``'s), the worst per-step deviation of a source's count from
``weight x G`` in samples, and the planning time per step (one process, all of a window's
steps and ranks, as each rank computes it). The default ``plan_window_steps`` is chosen as the
smallest K that meets issue 23's targets (idle <= 1.5x the global sort and <= 0.5%, padding
<= 2%, every step within one sample) at every rank count on both mixes, using at most 2/3 of
each target (room for other mixes and seeds), and printed.

Usage:
    python tools/bench_planned.py --quick      # 32 steps, K in 1, 16, 32 (under 2 minutes)
    python tools/bench_planned.py              # 64 steps, K in 1, 4, 16, 32, 64
"""

from __future__ import annotations

import tracemalloc

import click
import numpy as np

from energon_ordering.cli.tables import table
from energon_ordering.inspect.advise import (
    LengthPopulation,
    PlannedRun,
    _padding,
    planned_run,
    predict_order,
    vector_straggler_idle,
)
from energon_ordering.inspect.synthetic import LENGTH_PROFILES, sample_lengths
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.window import plan_window, window_weights

BATCH = 4
M = 8
RANKS = (8, 64, 256, 1024)
TARGET_IDLE = 0.005
TARGET_IDLE_RATIO = 1.5
TARGET_PADDING = 0.02
#: The default K must meet the targets with this much to spare (other mixes, other seeds).
MARGIN = 2 / 3


def heavy_tailed(n: int, seed: int) -> np.ndarray:
    """10% of samples around 6,000 tokens, the rest around 500 (lognormal)."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.1
    return np.where(long, rng.lognormal(np.log(6000), 0.3, n),
                    rng.lognormal(np.log(500), 0.6, n)).clip(16, 32768).astype(np.int64)


def mixes(n: int) -> dict[str, tuple[list[np.ndarray], list[float]]]:
    """name -> (lengths per source, weights)."""
    return {
        "trimodal": ([sample_lengths(LENGTH_PROFILES["trimodal"], n, 0)], [1.0]),
        "heavy": ([heavy_tailed(n // 2, 1), 3 * heavy_tailed(n // 2, 2)], [0.5, 0.5]),
    }


def population(lengths: list[np.ndarray], weights: list[float], n: int = 400_000) -> LengthPopulation:
    """The mix as ``advise`` models it: draws by blend weight, sorted by length."""
    rng = np.random.default_rng(0)
    counts = rng.multinomial(n, np.asarray(weights) / sum(weights))
    ls = np.concatenate([rng.choice(l, size=c) for l, c in zip(lengths, counts)]).astype(np.float64)
    src = np.concatenate([np.full(c, s) for s, c in enumerate(counts)])
    order = np.argsort(ls, kind="stable")
    return LengthPopulation(ls[order], src[order], tuple(f"s{s}" for s in range(len(lengths))),
                            "bench_planned")


as_rank_major = PlannedRun.rank_major  # [steps, R, M, B] -> [R, steps x M, B]


def run_planned(lengths, weights, R: int, K: int, steps: int):
    """Plans ``steps`` steps in windows of K (``advise.planned_run``); returns lengths
    ``[steps, R, M, B]``, the worst per-step deviation (samples) and seconds of planning per
    step."""
    run = planned_run(lengths, weights, world_size=R, micro_batch=BATCH, micro_batches_per_step=M,
                      steps=steps, window_steps=K)
    return run.lengths, run.worst_step_samples, run.plan_seconds_per_step


def plan_peak_bytes(lengths, weights, R: int, K: int) -> int:
    """Peak bytes one window's plan allocates (tracemalloc; numpy reports its buffers), beyond
    the lengths it is given."""
    w = np.asarray(weights) / sum(weights)
    tracemalloc.start()
    plan_window(lengths, seed=0, cursor=PlanCursor.start(len(lengths)),
                weights=window_weights(w, 0, K), window_steps=K, world_size=R, micro_batch=BATCH,
                micro_batches_per_step=M)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def global_sort(lens: np.ndarray) -> np.ndarray:
    steps, R, m, b = lens.shape
    return np.sort(lens.ravel()).reshape(steps, m, R, b).transpose(0, 2, 1, 3)


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--quick", is_flag=True, help="32 steps, K in 1, 16, 32.")
@click.option("--steps", type=int, default=None, help="Steps planned per setting (default 32 "
              "with --quick, else 64); a multiple of every K.")
@click.option("--memory/--no-memory", default=True,
              help="Measure each plan's peak memory (one more window per row, traced).")
@click.option("--windows", default=None, help="K values, e.g. 1,4,16,64.")
@click.option("--samples", type=int, default=2_000_000, help="Samples per mix.")
def main(quick: bool, steps: int | None, windows: str | None, samples: int,
         memory: bool) -> None:
    """Planned order vs batch pools vs the global sort, 8 to 1,024 ranks."""
    steps = steps or (32 if quick else 64)
    ks = tuple(int(k) for k in windows.split(",")) if windows else (
        (1, 16, 32) if quick else (1, 4, 16, 32, 64))
    ks = tuple(k for k in ks if steps % k == 0)
    click.echo(f"micro-batch {BATCH}, {M} micro-batches per step, {steps} steps per setting; "
               f"K = plan_window_steps\n")
    meets: dict[int, bool] = {k: True for k in ks}
    # the largest fraction of a target any setting of K used (idle, padding), over R and mixes
    used: dict[int, float] = {k: 0.0 for k in ks}
    for name, (lengths, weights) in mixes(samples).items():
        pop = population(lengths, weights)
        rows = []
        for R in RANKS:
            G = R * M * BATCH
            limit_idle = limit_pad = None
            planned_rows = []
            for K in ks:
                lens, worst, sec = run_planned(lengths, weights, R, K, steps)
                idle = vector_straggler_idle(as_rank_major(lens))
                pad = _padding(as_rank_major(lens))
                if limit_idle is None:
                    g = as_rank_major(global_sort(lens))
                    limit_idle, limit_pad = vector_straggler_idle(g), _padding(g)
                ok = (idle <= min(TARGET_IDLE, TARGET_IDLE_RATIO * limit_idle)
                      and pad <= TARGET_PADDING and worst < 1.0)
                meets[K] &= ok
                used[K] = max(used[K], idle / min(TARGET_IDLE, TARGET_IDLE_RATIO * limit_idle),
                              pad / TARGET_PADDING)
                peak = plan_peak_bytes(lengths, weights, R, K) if memory else float("nan")
                planned_rows.append([f"planned K={K}", f"{R:,}", pct(idle), pct(pad),
                                     f"{worst:.2f}", f"{1e3 * sec:.1f}",
                                     f"{1e6 * sec / G:.2f}", f"{peak / 2**20:,.0f}",
                                     "yes" if ok else "no"])
            rows += planned_rows
            for pool in (10_000, 100_000):
                p = predict_order(pop, mode="batch", pool_size=pool, batch_size=BATCH, ranks=(R,),
                                  step_ranks=R, micro_batches_per_step=M, steps=steps * M)
                worst_pp = max((w for _, w in p.step_share_pp.values()), default=0.0)
                rows.append([f"batch {pool // 1000}k", f"{R:,}", pct(p.idle[R]), pct(p.padding),
                             f"{worst_pp / 100 * G:.1f}", "-", "-", "-", ""])
            rows.append(["global sort", f"{R:,}", pct(limit_idle), pct(limit_pad), "-", "-", "-",
                         "-", ""])
        click.echo(f"{name}: " + ", ".join(f"source {s}: mean {l.mean():,.0f} tokens, weight {w}"
                                           for s, (l, w) in enumerate(zip(lengths, weights))))
        click.echo(table(["order", "ranks", "idle", "padding", "worst step dev (samples)",
                          "plan ms / step", "plan us / sample", "plan peak MiB",
                          "meets targets"], rows) + "\n")
    chosen = next((k for k in ks if meets[k] and used[k] <= MARGIN), None)
    click.echo("targets: idle <= 1.5x global sort and <= 0.5%, padding <= 2%, every step within "
               "one sample of weight x G, at every rank count, both mixes")
    click.echo("K meeting them: " + (", ".join(str(k) for k in ks if meets[k]) or "none"))
    click.echo("largest share of a target used, per K: "
               + ", ".join(f"K={k}: {used[k]:.2f}" for k in ks))
    click.echo(f"default plan_window_steps (smallest K meeting them within {MARGIN:.2f} of every "
               f"target): {chosen if chosen is not None else 'none of ' + str(ks)}")


if __name__ == "__main__":
    main()
