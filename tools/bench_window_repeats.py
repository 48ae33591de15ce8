#!/usr/bin/env python
"""Samples that meet their own copy in an optimizer step, side by side for window lengths.

A plan window sorts its draws by length, so where it draws a source of repeating data beyond
its size the copies of a sample (one length) sit in one step. Since 7 December 2026 the default
window holds at most the steps in which no source is drawn beyond its size
(:func:`~energon_ordering.planned.window_size.steps_within_an_epoch`); a window that straddles a
source's epoch end can still hold a sample of that epoch's tail and its copy from the next
epoch's head.

For each window length (the ones given, and the bound), this plans whole windows of the pure
plan (:func:`~energon_ordering.planned.window.plan_window`, as every rank does) over at least
``--steps`` optimizer steps of synthetic lognormal sources of the given sizes and weights, and
prints the steps holding a sample twice or more and the repeated draws (a step's draws minus
its distinct samples), as shares of the steps and of all draws.

Usage:
    python tools/bench_window_repeats.py
    python tools/bench_window_repeats.py --sizes 20000,2000 --weights 10,1 --shape 8x1x4 \
        --mix window --steps 2100 --windows 4096,64
"""

from __future__ import annotations

import argparse

import numpy as np

from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.window import plan_window
from energon_ordering.planned.window_size import steps_within_an_epoch


def repeats(lengths: list[np.ndarray], weights: np.ndarray, *, world_size: int,
            micro_batches: int, micro_batch: int, mix: str, steps: int,
            window_steps: int) -> tuple[int, int, int, int]:
    """(steps planned, steps with a repeated sample, repeated draws, draws)."""
    g = world_size * micro_batches * micro_batch
    cursor = PlanCursor.start(len(lengths))
    planned = dup_steps = dup_draws = 0
    while planned < steps:
        plan = plan_window(lengths, seed=1, cursor=cursor,
                           weights=np.tile(weights, (window_steps, 1)), window_steps=window_steps,
                           world_size=world_size, micro_batch=micro_batch,
                           micro_batches_per_step=micro_batches, mix=mix)
        cursor = plan.next_cursor
        ids = plan.ids.reshape(window_steps, -1)
        for t in range(window_steps):
            d = g - len(np.unique(ids[t]))
            dup_draws += d
            dup_steps += d > 0
        planned += window_steps
    return planned, dup_steps, dup_draws, planned * g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="20000,2000", help="samples of each source")
    ap.add_argument("--weights", default="10,1", help="weight of each source")
    ap.add_argument("--shape", default="8x1x4", help="ranks x micro-batches a step x micro-batch")
    ap.add_argument("--mix", default="window", choices=["step", "window"])
    ap.add_argument("--steps", type=int, default=2100, help="optimizer steps to plan at least")
    ap.add_argument("--windows", default="4096,64", help="window lengths beside the bound")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    w = np.array([float(x) for x in a.weights.split(",")])
    w = w / w.sum()
    R, M, B = (int(x) for x in a.shape.split("x"))
    rng = np.random.default_rng(0)
    lengths = [np.clip(rng.lognormal(6 + i, 0.8, n), 16, 8192).astype(np.int64)
               for i, n in enumerate(sizes)]
    bound = steps_within_an_epoch(sizes, [w], R * M * B)
    print(f"sources {sizes} at weights {np.round(w, 3).tolist()}, {R} ranks x {M} x {B}, "
          f"planned_mix {a.mix}; steps within an epoch of every source: {bound}")
    for k in [int(x) for x in a.windows.split(",")] + [bound]:
        planned, dup_steps, dup_draws, draws = repeats(
            lengths, w, world_size=R, micro_batches=M, micro_batch=B, mix=a.mix,
            steps=a.steps, window_steps=k)
        print(f"K = {k:5d}{' (the bound)' if k == bound else '            '}: {planned:,} steps, "
              f"{dup_steps / planned:6.1%} of them hold a sample twice, repeated draws "
              f"{dup_draws / draws:6.2%}")


if __name__ == "__main__":
    main()
