#!/usr/bin/env python
"""The longest gap between two micro-batches of a planned loader worker, at a plan window
boundary against inside a window, with and without planning ahead (issue 32).

A planned loader worker needs window w+1's plan at its first micro-batch of w+1. Planned there,
the plan (all R ranks' rows, a pure function of global inputs) is a gap in the worker's stream
at every window boundary; planned ahead (:mod:`energon_ordering.pipeline.plan_ahead`: a thread
plans w+1 while w is consumed) it is not. Target: the boundary gap at most 50 ms above the
in-window gap, at 1,024 ranks, padded and packed.

What runs: one loader worker of the last rank (worker 1 of 2), plan only (no reading or
decoding: the sources are synthetic length arrays, the order's work is the same), its
micro-batches asked for one after the other, each "consumed" in ``step / M x W`` seconds (a
step of ``--step-s`` seconds; M micro-batches per step; W loader workers take turns). The
consumption is a sleep, which releases the GIL as a GPU-bound consumer does; a worker that
decodes on the CPU leaves the planning thread less of it. The window must outlast the plan's
wall time: one window at 1,024 ranks (K = 32, M = 8) took 0.7 s of CPU padded and 11-20 s
packed (one 8,192-token pack per micro-batch) on this package's 2-core CI machine, several times
that in wall time under load. Plans are not shared (every process plans its own windows: the
worst case of a node).

Measured (2 cores, load average 15-35, 2026-12-03): padded, 1 s steps: boundary gap +747 ms
over the in-window gap at the boundary, -99 ms ahead; packed, 2 s steps: +20,418 ms at the
boundary, -104 ms ahead. (Packed at 4 packs per micro-batch, 44 s of CPU per window, the plan
outlasted even a 128 s window under that load: the thread hid 128 s of it.)

A gap is the time from one micro-batch's ids to the next's (consumption included). "in window"
is the longest gap to a micro-batch in the same window as the one before, "boundary" the
longest gap to a worker's first micro-batch of a window (the first window excluded: there is
no earlier window to plan it during). Figures depend on the machine's load (printed, never
failed), except the check that both modes yield the same ids.

Usage:
    python tools/bench_planned_boundary.py                      # 1,024 ranks, padded and packed
    python tools/bench_planned_boundary.py --ranks 64 --windows 3 --step-s 0.2
    python tools/bench_planned_boundary.py --orders packed --modes ahead --step-s 4
"""

from __future__ import annotations

import functools
import shlex
import sys
import time

import click
import numpy as np

from energon_ordering.cli.tables import table

BATCH = 4  # samples per padded micro-batch (packed: one pack per micro-batch)
M = 8
WORKERS = 2
PACK_SEQ_LENGTH = 8192


class _NoReader:
    """Stands for a source's byte-range reader: plan only, nothing is read."""

    def close(self) -> None:
        pass


WEIGHTS = [0.7, 0.3]


@functools.cache
def _mix_lengths() -> list[np.ndarray]:
    """The heavy-tailed two-source mix (2,000,000 samples each, cut to the pack's tokens)."""
    rng = np.random.default_rng(0)
    n = 2_000_000
    short = np.minimum(rng.lognormal(6.0, 0.9, n), PACK_SEQ_LENGTH).round().clip(16)
    long_ = np.minimum(3 * rng.lognormal(6.0, 0.9, n), PACK_SEQ_LENGTH).round().clip(16)
    return [short, long_]


def _source(world_size: int, window_steps: int, packed: bool, ahead: bool, mix: str):
    """Loader worker 1 of the last rank, over a heavy-tailed two-source mix (lengths only)."""
    from megatron.energon import WorkerConfig

    from energon_ordering.pipeline.planned_packs import PlannedPackSourceDataset
    from energon_ordering.pipeline.planned_source import PlannedSourceDataset

    kw = dict(weights=WEIGHTS, seed=0, window_steps=window_steps, micro_batches_per_step=M,
              batch_size=1 if packed else BATCH, planned_mix=mix,
              worker_config=WorkerConfig(rank=world_size - 1, world_size=world_size,
                                         num_workers=WORKERS))
    lengths = _mix_lengths()
    if packed:
        ds = PlannedPackSourceDataset([_NoReader(), _NoReader()], [[], []], lengths,
                                      pack_seq_length=PACK_SEQ_LENGTH, warmup=None, **kw)
    else:
        ds = PlannedSourceDataset([_NoReader(), _NoReader()], [[], []], lengths, **kw)
    ds.plan_ahead = ahead
    if ahead:
        ds.plan_windows_ahead()
    return ds


def _gaps(world_size: int, window_steps: int, windows: int, step_s: float, packed: bool,
          ahead: bool, mix: str) -> tuple[float, float, float, list[int]]:
    """(longest in-window gap, longest boundary gap, first micro-batch s, a digest of the
    ids) over ``windows`` windows of worker 1."""
    ds = _source(world_size, window_steps, packed, ahead, mix)
    consume = step_s / M * WORKERS
    per_window = window_steps * M
    inside, boundary, digest = 0.0, 0.0, []
    t0 = time.perf_counter()
    last = None
    b = 1
    try:
        while b < windows * per_window:
            ids = ds.micro_batch_ids(b)
            now = time.perf_counter()
            digest.append(int(np.asarray(ids, dtype=np.int64).sum()))
            if last is None:
                first = now - t0
            else:
                gap = now - last
                if b // per_window != (b - WORKERS) // per_window:
                    boundary = max(boundary, gap)
                else:
                    inside = max(inside, gap)
            last = now
            time.sleep(consume)
            b += WORKERS
    finally:
        ds.close()
    return inside, boundary, first, digest


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--ranks", default=1024, help="Data-parallel size R.")
@click.option("--window-steps", type=int, default=None,
              help="plan_window_steps (default: the package's for the mix and the global batch).")
@click.option("--mix", "mixes", default="step", help="planned_mix granularities (step, window).")
@click.option("--windows", default=2, help="Windows the worker runs through (boundaries: one "
              "fewer).")
@click.option("--step-s", default=1.0, help="Seconds per optimizer step (the consumer's pace).")
@click.option("--orders", default="padded,packed", help="Which orders to run.")
@click.option("--modes", default="boundary,ahead",
              help="Planned at the boundary, ahead, or both (then also checked alike).")
def main(ranks: int, window_steps: int | None, mixes: str, windows: int, step_s: float,
         orders: str, modes: str) -> None:
    """Longest micro-batch gap at a window boundary and inside a window, per mode."""
    from energon_ordering.planned.window_size import default_window_steps, packed_samples_per_pack

    click.echo(f"$ {shlex.join(['python', *sys.argv])}")
    t0 = time.perf_counter()
    rows, differ = [], []
    wanted = [m.strip() for m in modes.split(",")]
    for packed, mix in [(o.strip() == "packed", x.strip()) for o in orders.split(",")
                        for x in mixes.split(",")]:
        spp = (packed_samples_per_pack(_mix_lengths(), [WEIGHTS], PACK_SEQ_LENGTH)
               if packed else None)  # as the pipeline reads it off the length index
        k = window_steps or default_window_steps(mix, ranks * M * (1 if packed else BATCH),
                                                 packed, samples_per_pack=spp)
        digests = {}
        for ahead in [m == "ahead" for m in wanted]:
            inside, boundary, first, digests[ahead] = _gaps(ranks, k, windows, step_s, packed,
                                                            ahead, mix)
            rows.append(["packed" if packed else "padded", mix, f"{k}",
                         "ahead" if ahead else "at the boundary", f"{1e3 * first:,.0f}",
                         f"{1e3 * inside:,.1f}", f"{1e3 * boundary:,.1f}",
                         f"{1e3 * (boundary - inside):+,.1f}"])
            if ahead:
                over = boundary - inside
                click.echo(f"load-dependent: {'packed' if packed else 'padded'}: boundary gap "
                           f"{1e3 * over:+.1f} ms over the in-window gap with planning ahead "
                           f"(target <= +50 ms: {'met' if over <= 0.05 else 'missed'}; not a "
                           "failure)")
        if len(digests) == 2 and digests[False] != digests[True]:
            differ.append(f"{'packed' if packed else 'padded'} {mix}")
    click.echo(f"\n{ranks:,} ranks, micro-batch {BATCH} samples (packed: one pack of "
               f"{PACK_SEQ_LENGTH:,} tokens), {M} micro-batches per step, "
               f"loader worker 1 of {WORKERS} of the last rank, a step "
               f"every {step_s} s, {windows} windows (plan only, plans not shared)")
    click.echo(table(["order", "planned_mix", "K", "window planned", "first ids ms",
                      "in-window gap ms", "boundary gap ms", "boundary - in-window ms"], rows))
    click.echo(f"({time.perf_counter() - t0:.0f} s wall)")
    if differ:
        click.echo(f"check FAILED: {', '.join(differ)}: planning ahead changed the micro-batches")
        sys.exit(1)
    if len(wanted) == 2:
        click.echo("check: the same micro-batches with and without planning ahead: ok")


if __name__ == "__main__":
    main()
