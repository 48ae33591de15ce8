#!/usr/bin/env python
"""Benchmark of the planned global order with sequence packing, every figure measured in this run.

The packed plan (:func:`energon_ordering.planned.packs.plan_packed_window`) is a function of
lengths only, so 1,024 ranks need no pipelines: each step's packs are computed exactly as every
rank computes them, and measured. Packs of ``--cap`` tokens (8,192), one pack per micro-batch,
8 micro-batches per step, on ``tools/bench_planned.py``'s two mixes (``trimodal``; ``heavy``:
10% of samples around 6,000 tokens, a second source 3x longer, cut to the cap).

Side by side at 8, 64, 256 and 1,024 ranks:

- ``planned``: the plan's packs;
- ``own packs``: what packing without the plan gives: every rank packs its own draws of the mix
  (first fit into its 8 packs, in draw order, as Energon's packer fills a buffer; the first
  draw that fits none of them closes the rank's step and opens its next one).

Figures per setting: straggler idle per step (``1 - mean / max`` of the ranks' step costs,
``sum(L + L^2/4096)`` over their packs, averaged over the steps; ranks synchronise once per
optimizer step), padding (the share of the packs' tokens left empty), the worst per-step
deviation of a source's count from ``weight x samples of the step`` (samples; the planned
order's counts are exact by construction, the figure checks it), and the planning time per
step (one process computing all ranks' packs, as every rank does).

Usage:
    python tools/bench_planned_packing.py --quick    # 8 steps per setting (about a minute)
    python tools/bench_planned_packing.py            # 16 steps per setting
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import numpy as np

from energon_ordering.cli.tables import table
from energon_ordering.planned.balance import sample_cost
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.packs import plan_packed_window

sys.path.insert(0, str(Path(__file__).parent))
from bench_planned import mixes  # noqa: E402

RANKS = (8, 64, 256, 1024)
M = 8  # micro-batches per step, one pack each


def planned(lengths, weights, R: int, steps: int, cap: int):
    """Per step: rank costs [R], tokens, samples per source; and seconds per step."""
    w = np.tile(np.asarray(weights, float) / sum(weights), (steps, 1))
    t0 = time.perf_counter()
    plan = plan_packed_window(lengths, seed=0, cursor=PlanCursor.start(len(lengths)), weights=w,
                              caps=[cap] * steps, world_size=R, micro_batch=1,
                              micro_batches_per_step=M)
    seconds = (time.perf_counter() - t0) / steps
    flat = np.minimum(np.concatenate(lengths), cap)
    L = flat[plan.ids]
    pack_cost = np.add.reduceat(sample_cost(L), plan.offsets[:-1]).reshape(steps, R, M)
    tokens = np.add.reduceat(L, plan.offsets[:-1]).reshape(steps, -1).sum(axis=1)
    return pack_cost.sum(axis=2), tokens, plan.counts, seconds


def own_packs(lengths, weights, R: int, steps: int, cap: int, seed: int = 1):
    """Every rank packs its own draws (first fit into its M packs, in draw order)."""
    rng = np.random.default_rng(seed)
    p = np.asarray(weights, float) / sum(weights)
    placed: list[tuple[int, int, float]] = []  # (step, rank, length) of every packed sample
    counts = np.zeros((steps, len(lengths)), dtype=np.int64)
    for r in range(R):
        pending = None
        for t in range(steps):
            room = np.full(M, float(cap))
            while True:
                if pending is None:
                    s = int(rng.choice(len(p), p=p))
                    pending = (s, min(float(lengths[s][rng.integers(len(lengths[s]))]), cap))
                s, L = pending
                fits = np.flatnonzero(room >= L)
                if not len(fits):
                    break  # the step is full: this draw opens the rank's next step
                room[fits[0]] -= L
                placed.append((t, r, L))
                counts[t, s] += 1
                pending = None
    t, r, L = (np.array(x) for x in zip(*placed))
    rank_cost = np.zeros((steps, R))
    np.add.at(rank_cost, (t, r), sample_cost(L))
    return rank_cost, np.bincount(t, weights=L, minlength=steps), counts


def figures(rank_cost, tokens, counts, weights, R: int, cap: int):
    idle = float(np.mean(1 - rank_cost.mean(axis=1) / rank_cost.max(axis=1)))
    padding = float(1 - tokens.sum() / (len(tokens) * R * M * cap))
    w = np.asarray(weights, float) / sum(weights)
    n = counts.sum(axis=1, keepdims=True)
    worst = float(np.abs(counts - w[None, :] * n).max())
    return idle, padding, worst


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--quick", is_flag=True, help="8 steps per setting.")
@click.option("--cap", type=int, default=8192, help="Tokens per pack (pack_seq_length).")
@click.option("--ranks", default=",".join(map(str, RANKS)), help="Data-parallel sizes.")
@click.option("--samples", type=int, default=4_000_000, help="Samples per mix.")
def main(quick: bool, cap: int, ranks: str, samples: int) -> None:
    steps = 8 if quick else 16
    rows = []
    for name, (lengths, weights) in mixes(samples).items():
        for R in (int(x) for x in ranks.split(",")):
            rc, tok, cnt, sec = planned(lengths, weights, R, steps, cap)
            idle, pad, worst = figures(rc, tok, cnt, weights, R, cap)
            orc, otok, ocnt = own_packs(lengths, weights, R, steps, cap)
            oidle, opad, oworst = figures(orc, otok, ocnt, weights, R, cap)
            rows.append([name, f"{R:,}", pct(idle), pct(oidle), f"{oidle / max(idle, 1e-9):.0f}x",
                         pct(pad), pct(opad), f"{worst:.2f}", f"{oworst:.1f}",
                         f"{1000 * sec:.1f}"])
            print(f"  {name} R={R}: done", file=sys.stderr)
    print(f"Planned packing: packs of {cap:,} tokens, 1 pack per micro-batch, {M} micro-batches "
          f"per step, {steps} steps per setting.\n")
    print(table(["mix", "ranks", "idle planned", "idle own packs", "gain", "padding planned",
                 "padding own packs", "worst step dev. planned", "own packs",
                 "plan ms/step"], rows))


if __name__ == "__main__":
    main()
