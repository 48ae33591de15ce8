"""The planned order's straggler idle per micro-batch and per optimizer step, side by side.

The package's idle (``diagnostics.straggler_idle``, ``tools/bench_planned.py``) is taken per
micro-batch: the ranks' costs of micro-batch b. With pure data parallelism the ranks wait for each
other at the gradient all-reduce, once per optimizer step, so the sum of a rank's M micro-batches
is what they wait on. This prints both for the same plans, with a bound for the step figure: the
greedy longest-first dealing of each step's samples to the ranks with no micro-batch structure
(every rank M x B samples of any lengths; padding ignored), which the plan cannot reach while it
keeps every micro-batch narrow.

    python tools/bench_planned_step_idle.py [--steps 32] [--ranks 8,64,256,1024]
"""

from __future__ import annotations

import heapq
import sys
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_planned import BATCH, M, as_rank_major, mixes, run_planned  # noqa: E402

from energon_ordering.cli.tables import table  # noqa: E402
from energon_ordering.inspect.advise import vector_straggler_idle  # noqa: E402
from energon_ordering.planned.balance import sample_cost  # noqa: E402
from energon_ordering.planned.window import DEFAULT_WINDOW_STEPS  # noqa: E402


def step_idle(lens: np.ndarray) -> float:
    """Mean over optimizer steps of ``1 - mean_r / max_r`` of each rank's summed cost;
    ``lens[step, rank, m, b]``."""
    cost = sample_cost(lens).sum(axis=(2, 3))
    return float((1.0 - cost.mean(axis=1) / cost.max(axis=1)).mean())


def free_dealing_idle(lens: np.ndarray) -> float:
    """The same for each step's samples dealt longest first to the least loaded rank, any number
    per rank (no micro-batches): a bound the plan's narrow micro-batches cannot reach."""
    out = []
    for step in lens:
        R = step.shape[0]
        heap = [(0.0, r) for r in range(R)]
        for c in np.sort(sample_cost(step).ravel())[::-1]:
            total, r = heapq.heappop(heap)
            heapq.heappush(heap, (total + float(c), r))
        totals = np.array([t for t, _ in heap])
        out.append(1.0 - totals.mean() / totals.max())
    return float(np.mean(out))


@click.command()
@click.option("--steps", type=int, default=32, help="Optimizer steps planned per setting.")
@click.option("--ranks", default="8,64,256,1024", help="Data-parallel sizes.")
@click.option("--samples", type=int, default=400_000, help="Samples per mix.")
def main(steps: int, ranks: str, samples: int) -> None:
    """Idle per micro-batch vs per optimizer step of the planned order."""
    K = DEFAULT_WINDOW_STEPS
    click.echo(f"micro-batch {BATCH}, {M} micro-batches per step, K = {K}, {steps} steps\n")
    rows = []
    for name, (lengths, weights) in mixes(samples).items():
        for R in (int(r) for r in ranks.split(",")):
            lens, _, _ = run_planned(lengths, weights, R, K, steps)  # [steps, R, M, B]
            rows.append([name, f"{R:,}", f"{vector_straggler_idle(as_rank_major(lens)):.3%}",
                         f"{step_idle(lens):.3%}", f"{free_dealing_idle(lens):.3%}"])
    click.echo(table(["mix", "ranks", "idle per micro-batch", "idle per optimizer step",
                      "per step, free dealing"], rows))


if __name__ == "__main__":
    main()
