#!/usr/bin/env python
"""Peak memory of one ``planned_mix: window`` window in a loader worker, side by side.

For each mix of ``tools/bench_planned.py`` and each window size, one process measures
(tracemalloc, which numpy reports its buffers to):

- ``reference``: the window planned with every array of the window at once
  (:func:`~energon_ordering.planned.window_mix.mix_window`, then
  :func:`~energon_ordering.planned.window_mix.deal_bands`: what ``plan_window`` did before
  :mod:`~energon_ordering.planned.window_mix_buffer`, and still does for lengths that are not
  whole tokens);
- ``buffer``: ``plan_window`` as it runs now (the plan built in its own memory);
- ``check``: what a node's other process holds while it checks the plan it maps from the shared
  file (``window_mix_plan_problem``), the plan itself being page cache;

without the warmup's caps and under caps that defer and force samples (512 to 16,384 tokens
over the window's steps). It also checks that both planners give the same ids, counts and next
cursor.

Usage:
    python tools/bench_window_mix_memory.py                        # 2^20 and 2^22 samples
    python tools/bench_window_mix_memory.py --ranks 16384 --micro-batches 1 --steps 16,64
"""

from __future__ import annotations

import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import click
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import begin, check, finish, machine_speed  # noqa: E402
from bench_planned import mixes  # noqa: E402

from energon_ordering.cli.tables import table  # noqa: E402
from energon_ordering.pipeline.window_mix_share import (  # noqa: E402
    encode_window_mix_plan, window_mix_plan_buffer, window_mix_plan_problem)
from energon_ordering.planned.cursor import PlanCursor  # noqa: E402
from energon_ordering.planned.window import plan_window, window_weights  # noqa: E402
from energon_ordering.planned.window_mix import deal_bands, mix_window  # noqa: E402

B = 4


def _peak(fn):
    tracemalloc.start()
    try:
        t = time.process_time()
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] / 2**20, time.process_time() - t
    finally:
        tracemalloc.stop()


def _reference(lengths, kw, R, M):
    gid, L, counts, nxt = mix_window(lengths, draws_per_step=R * M * B, **kw)
    pos = deal_bands(L, world_size=R, micro_batch=B, micro_batches_per_step=M)
    del L
    flat = np.empty(pos.shape, dtype=np.int64)
    for t in range(len(pos)):
        np.take(gid[t], pos[t], out=flat[t])
    return flat, counts, nxt


def _planned(lengths, kw, shape):
    """``plan_window`` as a loader worker runs it: built in the buffer the node shares."""
    K, R, M, _ = shape
    buf = window_mix_plan_buffer(shape, len(lengths))
    p = plan_window(lengths, window_steps=K, world_size=R, micro_batch=B,
                    micro_batches_per_step=M, mix="window", out=buf[:int(np.prod(shape))], **kw)
    return p, encode_window_mix_plan(p.ids, p.next_cursor, buf)


@click.command()
@click.option("--ranks", default=16384, show_default=True)
@click.option("--micro-batches", default=1, show_default=True)
@click.option("--steps", default="16,64", show_default=True,
              help="Window sizes K, comma-separated.")
@click.option("--samples", default=4_000_000, show_default=True, help="Samples per mix.")
def main(ranks: int, micro_batches: int, steps: str, samples: int) -> None:
    """The side-by-side table, then one check per row: the same plan, and its check passes."""
    start = begin()
    click.echo(machine_speed())
    R, M = ranks, micro_batches
    results = []
    rows = []
    for name, (lengths, weights) in mixes(samples).items():
        for K in (int(x) for x in steps.split(",")):
            n = K * R * M * B
            for capped in (False, True):
                caps = np.linspace(512, 16384, K).astype(np.int64) if capped else None
                cursor = PlanCursor.start(len(lengths))
                w = window_weights(weights, 0, K)
                kw = dict(seed=1, cursor=cursor, weights=w, caps=caps)
                ref, ref_mib, ref_s = _peak(lambda: _reference(lengths, kw, R, M))
                shape = (K, R, M, B)
                (plan, encoded), buf_mib, buf_s = _peak(lambda: _planned(lengths, kw, shape))
                same = (np.array_equal(plan.ids, ref[0]) and np.array_equal(plan.counts, ref[1])
                        and plan.next_cursor == ref[2])
                del ref
                with tempfile.TemporaryDirectory() as d:
                    path = Path(d) / "plan.npy"
                    np.save(path, encoded)
                    del plan, encoded
                    mapped = np.load(path, mmap_mode="r")
                    why, check_mib, check_s = _peak(lambda: window_mix_plan_problem(
                        mapped, seed=1, sizes=[len(x) for x in lengths], cursor=cursor,
                        weights=w, shape=shape, caps=caps, lengths=lengths))
                    del mapped
                results.append((f"{name} K={K} {'caps' if capped else 'no caps'}",
                                same and why is None, why or "same ids, counts, next cursor"))
                rows.append([name, f"{K}", f"{n:,}", "caps" if capped else "none",
                             f"{ref_mib:.1f}", f"{buf_mib:.1f}", f"{ref_mib / buf_mib:.2f}",
                             f"{check_mib:.1f}", f"{buf_s:.2f} / {ref_s:.2f}",
                             f"{check_s:.2f}", "yes" if same and why is None else "NO"])
    click.echo(f"{R} ranks x {M} micro-batches of {B}; peak MiB (tracemalloc) of one window")
    click.echo(table(["mix", "K", "samples", "caps", "reference MiB", "buffer MiB", "ratio",
                      "check MiB", "CPU s buffer / ref", "check CPU s",
                      "same plan, check passes"], rows))
    for what, ok, detail in results:
        check(f"buffer plan = reference plan, {what}", ok, detail)
    finish(start)


if __name__ == "__main__":
    main()
