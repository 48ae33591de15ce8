#!/usr/bin/env python
"""What one loader worker of the planned order costs at 10^7 and 10^8 samples, measured.

Issue 23's targets: at most 64 MiB per loader worker with a 10^8-sample length index, and the
first batch within 2 s with a 10^7-sample index. The ordering work of a worker is: map the
split's flat lengths file (:mod:`energon_ordering.length_index.lengths_file`), plan the first
window and keep its own rank's rows (:class:`~energon_ordering.pipeline.planned_source.
PlannedSourceDataset`'s own ``micro_batch_ids``), then read and decode the samples (Energon's
work, the same in every mode, not measured here).

For each index size and data-parallel size, a fresh process (spawned: nothing inherited) runs
exactly that on a synthetic lengths file of the size (trimodal lengths, float32, as the
lengths file stores integer lengths) and reports:

- ``first ids s``: from mapping the file to the ids of the worker's first micro-batch (the
  plan of window 0: the ordering's part of the time to the first batch);
- ``next window s``: planning the next window (paid once per K steps, ahead of need only in
  the sense that it is paid when the window's first micro-batch is asked for);
- ``peak alloc MiB``: the most memory the ordering allocated at once (tracemalloc, which numpy
  reports its buffers to), over both windows;
- ``anon MiB``: the process's anonymous memory (``RssAnon``) after both windows, minus before
  the file was mapped: what stays private to the worker;
- ``file MiB``: pages of the lengths file the worker touched (``RssFile`` growth): page cache,
  shared by every worker of the node and reclaimable, not the worker's own memory.

With ``--join-samples N`` it also builds a real prepared dataset of N samples with its length
index and times the one-off join that writes the lengths file (the first planned start after
``energon-ordering index``, once per data version) against mapping it afterwards.

With ``--throughput N`` it also times, side by side on a real prepared dataset of N samples,
one rank's in-process loader (Energon's own order, no pool) against the planned order at each
data-parallel size, stepped in turns (:func:`~energon_ordering.inspect.interleaved_timing.
time_in_turns`), and the share of the planned loader's time spent planning (the seconds inside
``PlannedSourceDataset._plan_rows`` over the wall seconds of its timed turns). A rank's
planning costs O(R) per step (the plan of every rank), its loading O(1): the share grows with R.
With ``--node-ranks N`` the process runs N planned ranks that share their plans through
``ENERGON_ORDERING_PLAN_DIR`` as a node's ranks do (one plans each window, the others map it):
the planning share is then over the N ranks' time.

Usage:
    python tools/bench_planned_scale.py                  # 10^7 and 10^8, 8 and 1,024 ranks
    python tools/bench_planned_scale.py --sizes 1e6 --ranks 8 --join-samples 50000
    python tools/bench_planned_scale.py --sizes '' --ranks 8,64,256,1024 --throughput 20000
    python tools/bench_planned_scale.py --sizes '' --ranks 1024 --throughput 20000 --node-ranks 8
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
import tracemalloc
from pathlib import Path

import click
import numpy as np

from energon_ordering.cli.tables import table

BATCH = 4
M = 8


def _status() -> dict[str, int]:
    """``/proc/self/status`` memory lines, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    return out


def _worker(path: str, world_size: int, window_steps: int, mix: str, queue) -> None:
    """One loader worker's ordering work (spawned), reported to ``queue``."""
    from megatron.energon import WorkerConfig

    from energon_ordering.length_index.lengths_file import split_lengths
    from energon_ordering.pipeline.planned_source import PlannedSourceDataset

    os.environ["ENERGON_ORDERING_PLAN_DIR"] = "off"  # plan here: never map another run's plan
    before = _status()
    tracemalloc.start()
    t0 = time.perf_counter()
    lengths = split_lengths(Path(path), lambda: None)  # exists: mapped
    ds = PlannedSourceDataset(
        [None], [[]], [lengths], weights=[1.0], seed=0, window_steps=window_steps,
        micro_batches_per_step=M, batch_size=BATCH, planned_mix=mix,
        worker_config=WorkerConfig(rank=world_size - 1, world_size=world_size, num_workers=2),
    )
    first = ds.micro_batch_ids(1)  # worker 1 of rank R-1
    t1 = time.perf_counter()
    ds.micro_batch_ids(window_steps * M + 1)  # the next window
    t2 = time.perf_counter()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    after = _status()
    queue.put({
        "first": t1 - t0, "next": t2 - t1, "peak": peak, "ids": len(first),
        "anon": after["RssAnon"] - before["RssAnon"],
        "file": after["RssFile"] - before["RssFile"],
    })


def _join_times(folder: Path, n: int) -> tuple[float, float]:
    """Seconds of the first ``indexed_lengths`` of a real N-sample dataset (the join, writing
    the lengths file) and of the second (mapping it)."""
    from megatron.energon import WorkerConfig, load_dataset

    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
    from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
    from energon_ordering.length_index.build import build_length_index
    from energon_ordering.length_index.index import LengthIndex
    from energon_ordering.pipeline.planned_source import indexed_lengths
    from energon_ordering.pool.byte_range_reader import ByteRangeReader

    make_synthetic_dataset(folder, [SourceSpec("web", n, "trimodal")], shard_size=256,
                           image_size=4)
    web = folder / "web"
    build_length_index(web, task_encoder=IndexedSyntheticTaskEncoder())
    factory = load_dataset(web).get_datasets(
        training=True, split_part="train",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0)).datasets[0].dataset
    index = LengthIndex.open(web)
    for written in (web / ".nv-meta").glob("*.split-*.npy"):  # the index build wrote it: time
        written.unlink()                                     # the join it replaces
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        reader = ByteRangeReader(web, [(s.name, s.count) for s in factory.shards],
                                 lengths=index.path, lengths_digest=index.digest)
        got = indexed_lengths(reader, web)
        assert len(got) == n
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def _throughput(folder: Path, n: int, ranks: list[int], rounds: int,
                node_ranks: int) -> list[list[str]]:
    """Rows (ranks, planned / no pool in wall and CPU time, planning share) on a real dataset."""
    import statistics

    from energon_ordering import OrderingConfig
    from energon_ordering.inspect.interleaved_timing import time_in_turns
    from energon_ordering.inspect.rank_simulation import TRAINING_GC, build_train_loader
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
    from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
    from energon_ordering.length_index.build import build_length_index
    from energon_ordering.pipeline.planned_source import PlannedSourceDataset

    make_synthetic_dataset(folder, [SourceSpec("web", n, "trimodal")], shard_size=256)
    web = folder / "web"
    build_length_index(web, task_encoder=IndexedSyntheticTaskEncoder())
    planning = [0.0]
    original = PlannedSourceDataset._plan_rows

    def timed(self, window, start):
        t = time.perf_counter()
        try:
            return original(self, window, start)
        finally:
            planning[0] += time.perf_counter() - t

    PlannedSourceDataset._plan_rows = timed
    rows = []
    try:
        for R in ranks:
            cfg = OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                                 length_sort_pool_holds="keys", micro_batches_per_step=M, seed=0)
            planned = [f"planned r{r}" for r in range(min(node_ranks, R))]
            loaders = {
                "off": build_train_loader(web, ordering=OrderingConfig(), batch_size=BATCH,
                                          task_encoder_factory=IndexedSyntheticTaskEncoder,
                                          **TRAINING_GC),
                **{name: build_train_loader(web, ordering=cfg, rank=r, world_size=R,
                                            batch_size=BATCH,
                                            task_encoder_factory=IndexedSyntheticTaskEncoder,
                                            **TRAINING_GC)
                   for r, name in enumerate(planned)},
            }
            per_turn = 256  # micro-batches: one window of a rank at K = 32, M = 8
            wall, cpu = time_in_turns(loaders, per_turn, rounds,
                                      after_warmup=lambda: planning.__setitem__(0, 0.0))
            # each round: one turn of no pool against the mean turn of the node's planned ranks
            mean_wall = [statistics.mean(wall[n][i] for n in planned) for i in range(rounds)]
            ratio = [a / b for a, b in zip(wall["off"], mean_wall)]
            cratio = sum(cpu["off"]) * len(planned) / sum(sum(cpu[n]) for n in planned)
            planned_wall = sum(sum(wall[n]) for n in planned)
            rows.append([f"{R:,}", f"{len(planned)}", f"{statistics.median(ratio):.3f}",
                         f"{min(ratio):.2f}-{max(ratio):.2f}", f"{cratio:.3f}",
                         f"{100 * planning[0] / planned_wall:.1f}%",
                         f"{1e3 * sum(mean_wall) / (rounds * per_turn * BATCH):.2f}"])
    finally:
        PlannedSourceDataset._plan_rows = original
    return rows


def _lengths_file(folder: Path, n: int) -> Path:
    """A synthetic trimodal lengths file of ``n`` samples (written in chunks: O(chunk) memory)."""
    from energon_ordering.inspect.synthetic import LENGTH_PROFILES, sample_lengths

    path = folder / f"lengths-{n}.npy"
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n,))
    chunk = 10_000_000
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        out[lo:hi] = sample_lengths(LENGTH_PROFILES["trimodal"], hi - lo, lo // chunk)
    out.flush()
    del out
    return path


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--sizes", default="1e7,1e8", help="Index sizes (samples).")
@click.option("--ranks", default="8,1024", help="Data-parallel sizes.")
@click.option("--window-steps", type=int, default=None,
              help="plan_window_steps (default: the package's for the mix and the global batch).")
@click.option("--mix", "mixes", default="step",
              help="planned_mix granularities, comma-separated (step, window).")
@click.option("--dir", "folder", type=click.Path(file_okay=False), default=None,
              help="Where the synthetic lengths files go (default: a temporary folder).")
@click.option("--join-samples", type=int, default=0,
              help="Also time the one-off join of a real dataset of this many samples (0: no).")
@click.option("--throughput", type=int, default=0,
              help="Also time planned against no pool on a real dataset of this many samples.")
@click.option("--rounds", type=int, default=6, help="Rounds of turns (--throughput).")
@click.option("--node-ranks", type=int, default=1,
              help="Planned ranks in this process (--throughput), sharing their plans as the "
                   "ranks of a node do (ENERGON_ORDERING_PLAN_DIR); 1: a rank alone.")
def main(sizes: str, ranks: str, window_steps: int | None, mixes: str, folder: str | None,
         join_samples: int, throughput: int, rounds: int, node_ranks: int) -> None:
    """One planned loader worker's time to its first micro-batch and its memory, per size."""
    from energon_ordering.planned.window_size import default_window_steps

    ctx = multiprocessing.get_context("spawn")
    rows = []
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        for n in (int(float(s)) for s in sizes.split(",") if s):
            t0 = time.perf_counter()
            path = _lengths_file(Path(tmp), n)
            made = time.perf_counter() - t0
            click.echo(f"{n:,} samples: synthetic lengths file {path.stat().st_size / 2**20:,.0f} "
                       f"MiB, written in {made:.1f} s")
            for R, mix in ((int(r), x) for r in ranks.split(",") for x in mixes.split(",")):
                k = window_steps or default_window_steps(mix, R * M * BATCH)
                queue = ctx.Queue()
                p = ctx.Process(target=_worker, args=(str(path), R, k, mix, queue))
                p.start()
                got = queue.get()
                p.join()
                rows.append([f"{n:,}", f"{R:,}", mix, f"{k:,}", f"{R * M * BATCH * k:,}",
                             f"{got['first']:.2f}", f"{got['next']:.2f}",
                             f"{got['peak'] / 2**20:.1f}", f"{got['anon'] / 2**20:.1f}",
                             f"{got['file'] / 2**20:.0f}"])
            path.unlink()
    if rows:
        click.echo(f"\nmicro-batch {BATCH}, {M} micro-batches per step; one spawned process per "
                   "row (loader worker 1 of the last rank)")
        click.echo(table(["samples", "ranks", "planned_mix", "K", "samples per window",
                          "first ids s", "next window s", "peak alloc MiB", "anon MiB",
                          "file MiB"], rows))
    if join_samples:
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            first, mapped = _join_times(Path(tmp), join_samples)
        click.echo(f"\nreal dataset of {join_samples:,} samples: joining the length index to "
                   f"index.sqlite and writing the lengths file (done by `energon-ordering index`, "
                   f"else by the first planned start) takes {first:.2f} s "
                   f"({1e6 * first / join_samples:.1f} us per sample); every later start maps it "
                   f"in {mapped:.3f} s")
    if throughput:
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            os.environ.setdefault("ENERGON_ORDERING_PLAN_DIR", str(Path(tmp) / "plans"))
            got = _throughput(Path(tmp), throughput, [int(r) for r in ranks.split(",")], rounds,
                              node_ranks)
        click.echo(f"\nin-process loaders, {throughput:,} real samples, {rounds} rounds of turns of "
                   "256 micro-batches (planned / no pool: above 1 is faster; planned: the mean "
                   f"of the node's {node_ranks} rank(s))")
        click.echo(table(["ranks", "ranks of the node", "samples/s vs no pool (median)", "per round", "CPU time ratio",
                          "planning share", "planned ms / sample"], got))
        click.echo("targets: samples/s >= 0.97 of no pool; planning <= 5% of the loader's time")
    click.echo("targets: memory per loader worker <= 64 MiB at 10^8 samples (peak alloc and "
               "anon: the worker's own; file pages are shared page cache); the ordering's part "
               "of the first batch <= 2 s at 10^7")


if __name__ == "__main__":
    main()
