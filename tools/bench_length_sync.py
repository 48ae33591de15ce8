#!/usr/bin/env python
"""Benchmark of cross-rank length sync on the real pipeline, every figure measured in this run.

8 simulated data-parallel ranks (one real Energon pipeline each, ``WorkerConfig(rank=r,
world_size=8)``) over a synthetic trimodal multimodal dataset, micro-batch 4. Prints:

1. straggler idle and padding waste for: no pool, ``sample`` mode (the reference algorithm),
   ``batch`` mode, at each pool size and number of loader workers, and a global sort of the
   same samples (the limit);
2. pool overhead: samples/s through one rank's pipeline with vs without the pool (ratio);
3. checkpoint size: pickled ``save_state_rank()`` bytes vs pool size, bytes per pooled sample;
4. restore latency of a full pool vs the time to fill one;
5. lean pools at equal memory: the encoded pool (post-encode, 1,000) against the lean key pool
   (pre-encode, 10,000): resident bytes per pooled sample with photo-sized images (448 x 448
   JPEGs decoded by Energon's default decoder), the pool capacity that memory buys, straggler
   idle and padding over 8 ranks, samples/s (live loaders stepped in turn: the median of
   per-round ratios to no pool, wall and CPU time) and restore latency.

Usage:
    python tools/bench_length_sync.py                 # full run (pools 100 / 1,000 / 10,000)
    python tools/bench_length_sync.py --quick         # small scale (the README demo)
    python tools/bench_length_sync.py --only lean     # just section 5
"""

from __future__ import annotations

import gc
import json
import pickle
import statistics
import time
from pathlib import Path

import click

from energon_ordering import LengthPoolSortDataset, OrderingConfig
from energon_ordering.inspect.diagnostics import padding_waste, straggler_idle
from energon_ordering.errors import LengthIndexError
from energon_ordering.pool.key_pool_sort import KeyPoolSortDataset
from energon_ordering.length_index.index import LengthIndex
from energon_ordering.length_index.build import build_length_index
from energon_ordering.inspect.pool_memory import find_stage, pool_holdings, resident_bytes
from energon_ordering.inspect.interleaved_timing import time_in_turns
from energon_ordering.inspect.rank_simulation import TRAINING_GC, build_train_loader, close_loader, lengths_by_step, run_ranks
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder

BATCH = 4


def _dataset(out: Path, num_samples: int) -> Path:
    path = out / f"trimodal_{num_samples}"
    if not (path / "web" / ".nv-meta" / "index.uuid").exists():
        click.echo(f"writing {num_samples} trimodal samples to {path} (energon prepare) ...")
        make_synthetic_dataset(path, [SourceSpec("web", num_samples, "trimodal")], shard_size=256)
    return path / "web"


def _global_sort_limit(records, world: int) -> tuple[float, float]:
    """Idle and padding if the same samples were globally sorted and dealt out step by step."""
    lengths = sorted(L for rank in records for b in rank for L in b.lengths)
    per_step = world * BATCH
    steps = [
        [lengths[s * per_step + r * BATCH : s * per_step + (r + 1) * BATCH] for r in range(world)]
        for s in range(len(lengths) // per_step)
    ]
    return straggler_idle(steps), padding_waste([b for st in steps for b in st])


def bench_sync(
    path: Path, world: int, pools: list[int], workers: list[int], steps_for, base_steps: int
) -> list:
    rows = []
    for nw in workers:
        base = run_ranks(path, ordering=OrderingConfig(), world_size=world, num_workers=nw,
                         steps=base_steps, batch_size=BATCH)
        steps = lengths_by_step(base)
        limit = _global_sort_limit(base, world)
        rows.append(dict(workers=nw, pool=0, mode="off", steps=len(steps),
                         idle=straggler_idle(steps),
                         padding=padding_waste([b for st in steps for b in st])))
        rows.append(dict(workers=nw, pool=0, mode="global sort", steps=len(steps),
                         idle=limit[0], padding=limit[1]))
        for pool in pools:
            if pool >= 10_000 and nw > 1:
                continue  # 10k-sample pools per worker: the 1-worker run carries the figure
            for mode in ("sample", "batch"):
                t0 = time.perf_counter()
                rec = run_ranks(
                    path,
                    ordering=OrderingConfig(length_sort_pool_size=pool, length_sort_mode=mode),
                    world_size=world, num_workers=nw, steps=steps_for(pool, nw),
                    batch_size=BATCH,
                )
                st = lengths_by_step(rec)
                rows.append(dict(workers=nw, pool=pool, mode=mode, steps=len(st),
                                 idle=straggler_idle(st),
                                 padding=padding_waste([b for s in st for b in s]),
                                 seconds=time.perf_counter() - t0))
                click.echo(f"  workers={nw} pool={pool} {mode}: idle {rows[-1]['idle']:.3f} "
                           f"padding {rows[-1]['padding']:.3f}", err=True)
    return rows


def _rate(loader, n_batches: int) -> float:
    """Samples/s of ``loader`` over ``n_batches``, timed after the first batch (startup and the
    first pool's fill are not throughput); closes the loader."""
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        next(it)
    dt = time.perf_counter() - t0
    del it
    close_loader(loader)
    gc.collect()
    return n_batches * BATCH / dt


def _rate_pool(path: Path, pool: int, n_batches: int) -> float:
    cfg = OrderingConfig(length_sort_pool_size=pool, length_sort_mode="batch")
    return _rate(build_train_loader(path, ordering=cfg, num_workers=0, batch_size=BATCH, **TRAINING_GC), n_batches)


def bench_overhead(path: Path, pool: int, n_batches: int, repeats: int) -> dict:
    """Samples/s with and without the pool, interleaved runs, median of each."""
    off, on = [], []
    for _ in range(repeats):
        off.append(_rate_pool(path, 0, n_batches))
        on.append(_rate_pool(path, pool, n_batches))
    return dict(pool=pool, samples=n_batches * BATCH, off=statistics.median(off),
                on=statistics.median(on), ratio=statistics.median(on) / statistics.median(off))


def _state_after(path: Path, cfg: OrderingConfig, n_batches: int):
    loader = build_train_loader(path, ordering=cfg, num_workers=0, batch_size=BATCH, **TRAINING_GC)
    it = iter(loader)
    t0 = time.perf_counter()
    for _ in range(n_batches):
        next(it)
    elapsed = time.perf_counter() - t0
    state = loader.save_state_rank()
    del it
    close_loader(loader)
    return state, elapsed


def bench_checkpoint(path: Path, pools: list[int]) -> list:
    """State bytes vs pool size (state taken right after the first batch of the first pool,
    when the pool holds pool_size - 4 unemitted samples), and restore vs fill time."""
    rows = []
    for pool in pools:
        cfg = OrderingConfig(length_sort_pool_size=pool, length_sort_mode="batch")
        state, fill_seconds = _state_after(path, cfg, 1)  # first batch = fill one pool + sort
        plain, _ = _state_after(path, OrderingConfig(), 1)
        pooled = pool - BATCH
        size, base = len(pickle.dumps(state)), len(pickle.dumps(plain))
        gc.collect()
        loader = build_train_loader(path, ordering=cfg, num_workers=0, batch_size=BATCH, **TRAINING_GC)
        t0 = time.perf_counter()
        loader.restore_state_rank(state)
        next(iter(loader))  # re-creates the pool's samples from their restore keys
        restore_seconds = time.perf_counter() - t0
        close_loader(loader)
        rows.append(dict(pool=pool, state_bytes=size, plain_state_bytes=base,
                         bytes_per_pooled_sample=(size - base) / pooled,
                         fill_seconds=fill_seconds, restore_seconds=restore_seconds,
                         restore_over_fill=restore_seconds / fill_seconds))
        click.echo(f"  checkpoint pool={pool}: {rows[-1]['bytes_per_pooled_sample']:.1f} B/sample,"
                   f" restore/fill {rows[-1]['restore_over_fill']:.2f}", err=True)
    return rows


def _print_tables(sync, overhead, ckpt) -> None:
    click.echo("\n## Straggler idle and padding waste (8 ranks, micro-batch 4)\n")
    click.echo("| workers | pool | mode | steps | straggler idle | padding waste |")
    click.echo("|---:|---:|---|---:|---:|---:|")
    for r in sync:
        pool = "-" if r["pool"] == 0 else f"{r['pool']:,}"
        click.echo(f"| {r['workers']} | {pool} | {r['mode']} | {r['steps']} | "
                   f"{100 * r['idle']:.1f}% | {100 * r['padding']:.1f}% |")
    click.echo("\n## Pool overhead (one rank, in-process, batch mode)\n")
    click.echo("| pool | samples timed | samples/s off | samples/s on | on/off |")
    click.echo("|---:|---:|---:|---:|---:|")
    for r in overhead:
        click.echo(f"| {r['pool']:,} | {r['samples']:,} | {r['off']:.0f} | {r['on']:.0f} | "
                   f"{r['ratio']:.3f} |")
    click.echo("\n## Checkpoint size and restore latency (state after the first batch)\n")
    click.echo("| pool | state bytes | without pool | bytes / pooled sample | fill s | restore s | restore/fill |")
    click.echo("|---:|---:|---:|---:|---:|---:|---:|")
    for r in ckpt:
        click.echo(f"| {r['pool']:,} | {r['state_bytes']:,} | {r['plain_state_bytes']:,} | "
                   f"{r['bytes_per_pooled_sample']:.1f} | {r['fill_seconds']:.2f} | "
                   f"{r['restore_seconds']:.2f} | {r['restore_over_fill']:.2f} |")


# ---- 5. lean pools at equal memory -------------------------------------------------------------


def _photo_dataset(out: Path, num_samples: int) -> Path:
    path = out / f"photo448_{num_samples}"
    if not (path / "web" / ".nv-meta" / "index.uuid").exists():
        click.echo(f"writing {num_samples} trimodal samples with 448x448 JPEGs to {path} ...",
                   err=True)
        make_synthetic_dataset(path, [SourceSpec("web", num_samples, "trimodal")],
                               shard_size=256, image_size=448, image_format="jpg")
    return path / "web"


def _ensure_index(path: Path) -> dict:
    """The dataset's length index (built by the training task encoder if missing or stale)."""
    try:
        index = LengthIndex.open(path)
        return dict(dataset=str(path), samples=index.samples, seconds=None)
    except LengthIndexError:
        t0 = time.perf_counter()
        built = build_length_index(path, task_encoder=IndexedSyntheticTaskEncoder(), workers=2)
        seconds = time.perf_counter() - t0
        click.echo(f"  length index of {path}: {built[0].summary.samples} samples in "
                   f"{seconds:.1f} s", err=True)
        return dict(dataset=str(path), samples=built[0].summary.samples, seconds=seconds)


def _lean_cfg(placement: str, pool: int, holds: str = "raw") -> OrderingConfig:
    return OrderingConfig(length_sort_pool_size=pool, length_sort_mode="batch",
                          length_sort_placement=placement, length_sort_pool_holds=holds)


def _loader(path: Path, cfg: OrderingConfig):
    return build_train_loader(path, ordering=cfg, num_workers=0, batch_size=BATCH, **TRAINING_GC,
                              task_encoder_factory=IndexedSyntheticTaskEncoder)


def _pool_memory(path: Path, cfg: OrderingConfig) -> dict:
    """Resident bytes of a full pool right after its first batch, and the fill time."""
    placement, pool = cfg.length_sort_placement, cfg.length_sort_pool_size
    loader = _loader(path, cfg)
    it = iter(loader)
    t0 = time.perf_counter()
    next(it)
    fill = time.perf_counter() - t0
    stage = find_stage(loader.dataset, KeyPoolSortDataset) or find_stage(
        loader.dataset, LengthPoolSortDataset)
    held, objs = pool_holdings(stage)
    nbytes = resident_bytes(objs)
    state = loader.save_state_rank()
    del it, stage, objs
    close_loader(loader)
    gc.collect()
    loader = _loader(path, cfg)
    t0 = time.perf_counter()
    loader.restore_state_rank(state)
    next(iter(loader))
    restore = time.perf_counter() - t0
    close_loader(loader)
    gc.collect()
    return dict(placement=placement, holds=cfg.length_sort_pool_holds if placement == "pre-encode"
                else "encoded samples", pool=pool, held=held, bytes=nbytes,
                bytes_per_sample=nbytes / held, fill_seconds=fill, restore_seconds=restore,
                state_bytes=len(pickle.dumps(state)))


def _interleaved_rates(path: Path, configs: dict[str, OrderingConfig], turn: int,
                       rounds: int) -> tuple[dict[str, float], dict[str, list[float]],
                                             dict[str, list[float]]]:
    """Samples/s of every configuration, as live loaders in one process stepped in turn
    ``turn`` samples at a time (a whole number of every pool), the order rotated each round,
    after each emitted its first ``turn`` samples (start-up and first fills are not
    throughput). Turns of about a second expose every loader to the same load from other
    processes; runs one after the other swung 0.30-1.22 on a shared machine.

    Returns:
        ``(median samples/s, per-round wall ratio to "off", per-round CPU-time ratio to
        "off")``; a ratio > 1 means faster than no pool.
    """
    loaders = {name: _loader(path, cfg) for name, cfg in configs.items()}
    wall, cpu = time_in_turns(loaders, turn // BATCH, rounds)
    rate = {name: statistics.median(turn / t for t in w) for name, w in wall.items()}
    wall_ratio = {name: [o / t for o, t in zip(wall["off"], w)] for name, w in wall.items()}
    cpu_ratio = {name: [o / t for o, t in zip(cpu["off"], c)] for name, c in cpu.items()}
    return rate, wall_ratio, cpu_ratio


def bench_lean(sync_path: Path, photo_path: Path, world: int, encoded_pool: int, lean_pool: int,
               repeats: int) -> dict:
    """Encoded pool vs lean pool, side by side: memory, capacity, sync, samples/s, restore."""
    indexes = [_ensure_index(sync_path), _ensure_index(photo_path)]
    configs = {"off": OrderingConfig(), "encoded": _lean_cfg("post-encode", encoded_pool),
               "lean": _lean_cfg("pre-encode", lean_pool, "keys"),
               "lean raw": _lean_cfg("pre-encode", lean_pool, "raw")}
    memory = {name: _pool_memory(photo_path, cfg) for name, cfg in configs.items() if name != "off"}
    budget = memory["encoded"]["bytes_per_sample"] * encoded_pool
    for m in memory.values():
        m["capacity_at_budget"] = int(budget // m["bytes_per_sample"])
        click.echo(f"  memory {m['holds']} pool={m['pool']}: {m['bytes_per_sample']:,.0f} "
                   f"B/sample, restore {m['restore_seconds']:.2f} s", err=True)
    steps = 2 * lean_pool // BATCH  # two full lean pools per rank
    sync = {}
    # "lean raw" emits exactly what "lean" emits (same lengths, same order): one sync run each
    # for off / encoded / lean.
    for name, cfg in configs.items():
        if name == "lean raw":
            continue
        rec = run_ranks(sync_path, ordering=cfg, world_size=world, steps=steps, batch_size=BATCH,
                        task_encoder_factory=IndexedSyntheticTaskEncoder)
        st = lengths_by_step(rec)
        sync[name] = dict(steps=len(st), idle=straggler_idle(st),
                          padding=padding_waste([b for s in st for b in s]))
        click.echo(f"  sync {name}: idle {sync[name]['idle']:.3f} padding "
                   f"{sync[name]['padding']:.3f}", err=True)
    rate, wall_ratio, cpu_ratio = _interleaved_rates(photo_path, configs, lean_pool, repeats)
    click.echo(f"  samples/s: {rate}", err=True)
    return dict(indexes=indexes, memory=memory, budget_bytes=budget, sync=sync, rate=rate,
                wall_ratio=wall_ratio, cpu_ratio=cpu_ratio, turn_samples=lean_pool,
                repeats=repeats, world=world, steps=steps)


def _print_lean(r: dict) -> None:
    enc = r["memory"]["encoded"]
    click.echo(f"\n## Lean pool vs encoded pool at equal memory ({r['world']} ranks, micro-batch "
               f"{BATCH}, batch mode)\n")
    click.echo(f"Memory budget: the encoded pool of {enc['pool']:,} = "
               f"{r['budget_bytes'] / 2**30:.2f} GiB per loader worker (448x448 images decoded to "
               "float32 by Energon's default decoder).\n")
    click.echo("| pool | placement | holds | pool size | bytes / pooled sample | pool memory | "
               "capacity at the budget | straggler idle | padding waste | samples/s | restore s | "
               "fill s |")
    click.echo("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    off = r["sync"]["off"]
    click.echo(f"| off | - | - | - | - | - | - | {100 * off['idle']:.1f}% | "
               f"{100 * off['padding']:.1f}% | {r['rate']['off']:.0f} | - | - |")
    for name, m in r["memory"].items():
        s = r["sync"]["lean" if name == "lean raw" else name]
        click.echo(f"| {name} | {m['placement']} | {m['holds']} | {m['pool']:,} | "
                   f"{m['bytes_per_sample']:,.0f} | "
                   f"{m['bytes'] / 2**20:,.1f} MiB | {m['capacity_at_budget']:,} | "
                   f"{100 * s['idle']:.1f}% | {100 * s['padding']:.1f}% | {r['rate'][name]:.0f} | "
                   f"{m['restore_seconds']:.2f} | {m['fill_seconds']:.2f} |")
    click.echo("\n| pool | wall ratio to off (median) | each round | CPU ratio to off (median) | "
               "each round |")
    click.echo("|---|---:|---|---:|---|")
    for name in ("encoded", "lean", "lean raw"):
        w, c = r["wall_ratio"][name], r["cpu_ratio"][name]
        click.echo(f"| {name} | {statistics.median(w):.3f} | {' '.join(f'{x:.2f}' for x in w)} | "
                   f"{statistics.median(c):.3f} | {' '.join(f'{x:.2f}' for x in c)} |")
    click.echo(f"(samples/s and ratios: live loaders in one process, stepped in turn "
               f"{r['turn_samples']:,} samples at a time (one lean pool, whole encoded pools), "
               f"order rotated each round, {r['repeats']} rounds after each emitted its first "
               "turn; ratio = no-pool seconds / pool seconds for the same number of samples, "
               "> 1 faster than no pool; CPU = this process's CPU time; one rank, in-process)")
    click.echo(f"sync: {r['steps']} micro-batches per rank on the trimodal set; memory, samples/s "
               "and restore on the 448x448 JPEG set (the order depends only on lengths).")
    for ix in r["indexes"]:
        built = "existing" if ix["seconds"] is None else f"built in {ix['seconds']:.1f} s"
        click.echo(f"length index {ix['dataset']}: {ix['samples']:,} samples ({built})")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--out", default="bench_out", type=click.Path(file_okay=False),
              help="Folder for the dataset (reused between runs) and results.json.")
@click.option("--quick", is_flag=True, help="Small scale: pools 100/1,000, fewer steps.")
@click.option("--samples", default=None, type=int,
              help="Dataset size [default: 80,000; 8,000 with --quick].")
@click.option("--world-size", default=8, help="Simulated data-parallel ranks.")
@click.option("--only", type=click.Choice(["all", "sync", "lean"]), default="all",
              help="Run sections 1-4 (sync), section 5 (lean) or both.")
def main(out: str, quick: bool, samples: int | None, world_size: int, only: str) -> None:
    """Measure cross-rank length sync, overhead, checkpoint size, restore latency and lean pools."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_sync = samples or (8_000 if quick else 80_000)
    path = _dataset(out_dir, n_sync)
    if only in ("all", "lean"):
        photo = _photo_dataset(out_dir, 3_000 if quick else 12_000)
        t0 = time.perf_counter()
        # The package refuses a pool larger than a loader worker's share of repeating data, so
        # the lean pool is sized to the sync data: at most n_sync / world_size (one worker).
        lean_pool = 2_000 if quick else 10_000
        share = n_sync // world_size // BATCH * BATCH
        if share < lean_pool:
            click.echo(f"lean pool {share:,} instead of {lean_pool:,}: a loader worker's share of "
                       f"{n_sync:,} samples at {world_size} ranks (a larger pool is refused)",
                       err=True)
            lean_pool = share
        lean = bench_lean(path, photo, world_size,
                          encoded_pool=min(200 if quick else 1_000, lean_pool),
                          lean_pool=lean_pool, repeats=4 if quick else 8)
        _print_lean(lean)
        click.echo(f"\n(lean section {time.perf_counter() - t0:.0f} s)")
        (out_dir / "lean_results.json").write_text(json.dumps(lean, indent=2))
        if only == "lean":
            return
    pools = [100, 1_000] if quick else [100, 1_000, 10_000]
    workers = [1] if quick else [1, 4]
    cap = 300 if quick else 1_500

    def steps_for(pool: int, nw: int) -> int:
        # Enough steps to emit two pools per worker; 10k pools: 250 steps of the first one.
        if pool >= 10_000:
            return 250
        return max(200, min(cap, 2 * pool * nw // BATCH))

    t0 = time.perf_counter()
    sync = bench_sync(path, world_size, pools, workers, steps_for, base_steps=cap)
    overhead = [bench_overhead(path, pool=1_000, n_batches=500 if quick else 5_000,
                               repeats=1 if quick else 3)]
    ckpt = bench_checkpoint(path, pools)
    _print_tables(sync, overhead, ckpt)
    click.echo(f"\n(total {time.perf_counter() - t0:.0f} s; dataset {path})")
    (out_dir / "results.json").write_text(
        json.dumps(dict(sync=sync, overhead=overhead, checkpoint=ckpt), indent=2)
    )


if __name__ == "__main__":
    main()
