#!/usr/bin/env python
"""A packed plan's default window, side by side: peak memory, lost compute, planning CPU.

A packed window's planning holds memory per *sample*: about 53 bytes a sample of the window for
``planned_mix: window``; ``step`` packs step by step, so about 53 bytes a sample of one step
beside the window's ids (8 bytes a sample). Its default window is sized in packs (``window``:
2^17 since 7 December 2026, 2^16 before; ``step``: 2^17), and also in samples: at most 2^20,
counted from the length index's mean lengths under the run's weights
(:func:`~energon_ordering.planned.window_size.packed_samples_per_pack`), since short samples fill
a pack with dozens.

For each mix and shape, one process plans each rule's window, one row beside the other:

- ``2^16 packs (before)``: the window mix's default before 7 December 2026;
- ``packs only``: today's packs without the samples' bound (what short samples would cost);
- ``now``: the default the pipeline takes;

and prints K, the window's samples, the peak MiB one window's planning allocates (tracemalloc:
numpy reports its buffers), planning CPU per optimizer step per 1,000 ranks, idle per optimizer
step, padding by tokens and their sum, lost compute, over ``--windows`` windows. ``check:``
lines fail where the default's peak is over 64 MiB (but for a window of one step: a step is
planned at once).

Usage:
    python tools/bench_packed_window_memory.py
    python tools/bench_packed_window_memory.py --shapes 1024x8 --mixes short --planned-mix window
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import begin, check, finish, machine_speed  # noqa: E402
from bench_planned import mixes as bench_mixes  # noqa: E402

from energon_ordering.cli.tables import table  # noqa: E402
from energon_ordering.inspect.lost_compute import idle_per_step, pack_padding_by_tokens  # noqa: E402
from energon_ordering.inspect.synthetic import LENGTH_PROFILES, sample_lengths  # noqa: E402
from energon_ordering.planned.balance import sample_cost  # noqa: E402
from energon_ordering.planned.cursor import PlanCursor  # noqa: E402
from energon_ordering.planned.packs import plan_packed_window  # noqa: E402
from energon_ordering.planned.window_size import (MAX_WINDOW_MIX_STEPS,  # noqa: E402
                                                  default_window_steps,
                                                  packed_samples_per_pack)

TARGET_MIB = 64.0
#: The window mix's packs a default window held before 7 December 2026.
BEFORE_WINDOW_MIX_PACKS = 1 << 16


def _mixes(n: int) -> dict[str, tuple[list[np.ndarray], list[float]]]:
    """name -> (lengths per source, weights): chat-like short samples (mean 217 tokens), a
    mix of them with medium ones, and ``tools/bench_planned.py``'s three mixes."""
    p = LENGTH_PROFILES
    return {
        "short": ([sample_lengths(p["short"], n, 0)], [1.0]),
        "short+medium": ([sample_lengths(p["short"], n, 1), sample_lengths(p["medium"], n, 2)],
                         [0.8, 0.2]),
        **bench_mixes(n),
    }


def _plan(lengths, weights, R, M, k, mix, cap, cursor):
    return plan_packed_window(lengths, seed=0, cursor=cursor, weights=np.tile(weights, (k, 1)),
                              caps=[cap] * k, world_size=R, micro_batch=1,
                              micro_batches_per_step=M, mix=mix)


def _row(name, lengths, weights, R, M, k, mix, cap, windows):
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    tracemalloc.start()
    try:
        first = _plan(lengths, w, R, M, k, mix, cap, PlanCursor.start(len(lengths)))
        peak = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    flat = np.minimum(np.concatenate(lengths), cap).astype(np.float64)
    cursor, cpu, costs, used = PlanCursor.start(len(lengths)), 0.0, [], []
    for _ in range(windows):
        t0 = time.process_time()
        plan = _plan(lengths, w, R, M, k, mix, cap, cursor)
        cpu += time.process_time() - t0
        cursor = plan.next_cursor
        L = flat[plan.ids]
        sizes = np.diff(plan.offsets)
        pack = np.repeat(np.arange(len(sizes)), sizes)
        costs.append(np.bincount(pack, weights=sample_cost(L),
                                 minlength=len(sizes)).reshape(-1, R, M))
        used.append(np.bincount(pack, weights=L, minlength=len(sizes)))
    steps = windows * k
    idle = idle_per_step(np.concatenate(costs))
    pad = pack_padding_by_tokens(np.concatenate(used), cap)
    return [name, f"{k:,}", f"{len(first.ids):,}", f"{peak:.1f}",
            f"{cpu * 1e3 / steps / (R / 1000):.2f}", f"{idle:.2%}", f"{pad:.2%}",
            f"{idle + pad:.2%}"], peak


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--shapes", default="1024x1,1024x8,16384x1,16384x2",
              help="Ranks x packs per step, comma-separated.")
@click.option("--mixes", "mix_names", default="short,short+medium,trimodal,demo,heavy")
@click.option("--planned-mix", "planned_mixes", default="window,step")
@click.option("--cap", default=8192, help="Tokens per pack (pack_seq_length).")
@click.option("--windows", default=1, help="Windows planned for the idle and padding figures.")
@click.option("--samples", default=4_000_000, help="Samples per source.")
def main(shapes: str, mix_names: str, planned_mixes: str, cap: int, windows: int,
         samples: int) -> None:
    start = begin()
    click.echo(machine_speed())
    every = _mixes(samples)
    for name in [m.strip() for m in mix_names.split(",")]:
        lengths, weights = every[name]
        spp = packed_samples_per_pack(lengths, [weights], cap)
        for shape in shapes.split(","):
            R, M = (int(x) for x in shape.lower().split("x"))
            for mix in [m.strip() for m in planned_mixes.split(",")]:
                packs = default_window_steps(mix, R * M, packed=True)
                new = default_window_steps(mix, R * M, packed=True, samples_per_pack=spp)
                rules = [("packs only", packs), ("now", new)]
                if mix == "window":
                    before = max(1, min(MAX_WINDOW_MIX_STEPS, BEFORE_WINDOW_MIX_PACKS // (R * M)))
                    rules.insert(0, ("2^16 packs (before)", before))
                rows = []
                for rule, k in rules:
                    row, peak = _row(rule, lengths, weights, R, M, k, mix, cap, windows)
                    rows.append(row)
                click.echo(f"\n{name} ({spp:.1f} samples a pack of {cap:,} tokens), {R:,} ranks "
                           f"x {M} packs, planned_mix {mix}")
                click.echo(table(["window", "K", "samples", "peak MiB", "CPU ms/step/1k ranks",
                                  "idle/step", "padding (tokens)", "lost compute"], rows))
                check(f"{name} {R}x{M} {mix}: the default window's peak <= {TARGET_MIB:.0f} MiB",
                      peak <= TARGET_MIB or new == 1, f"{peak:.1f} MiB at K = {new}"
                      + (" (one step: a step is planned at once)" if new == 1 else ""))
    finish(start)


if __name__ == "__main__":
    main()
