#!/usr/bin/env python
"""Benchmark of cross-rank length sync on the real pipeline, every figure measured in this run.

8 simulated data-parallel ranks (one real Energon pipeline each, ``WorkerConfig(rank=r,
world_size=8)``) over a synthetic trimodal multimodal dataset, micro-batch 4. Prints:

1. straggler idle per micro-batch and per optimizer step (M consecutive micro-batches) and
   padding weighted by tokens (``energon_ordering.inspect.lost_compute``; the definitions are
   printed) for: no pool, ``sample`` mode (the reference algorithm), ``batch`` mode, at each
   pool size and number of loader workers, and a global sort of the same samples (the limit;
   it tightens with the number of samples sorted together, so it is stated for the run);
2. pool overhead: samples/s through one rank's pipeline with vs without the pool, two live
   loaders stepped in turn: the median per-round ratio in CPU time and in wall time;
3. checkpoint size: pickled ``save_state_rank()`` bytes vs pool size, bytes per pooled sample;
4. restore latency of a full pool vs the time to fill one (CPU and wall);
5. lean pools at equal memory: the encoded pool (post-encode, 1,000) against the lean key pool
   (pre-encode, 10,000): resident bytes per pooled sample with photo-sized images (448 x 448
   JPEGs decoded by Energon's default decoder), the pool capacity that memory buys, straggler
   idle and padding over 8 ranks, samples/s (live loaders stepped in turn: the median of
   per-round ratios to no pool, wall and CPU time) and restore latency.

Checks that do not depend on the machine's load (idle ordering, checkpoint bytes, pool memory)
exit 1 when they fail; timing expectations print ``load-dependent: ... (not a failure)``.
Every configuration's 8 rank pipelines run once (section 5 reuses section 1's runs).

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

from _bench_common import (
    LOST_COMPUTE_DEFINITION,
    WATCHDOG,
    begin,
    check,
    finish,
    load_dependent,
    lost_compute_figures,
    one_time,
)

from energon_ordering import LengthPoolSortDataset, OrderingConfig
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
        with one_time(f"writing {num_samples:,} samples"):
            make_synthetic_dataset(path, [SourceSpec("web", num_samples, "trimodal")],
                                   shard_size=256)
    return path / "web"


def _global_sort(step_lengths: list, world: int) -> list:
    """The same samples sorted globally and dealt out micro-batch by micro-batch: R x B
    neighbours per micro-batch index, B neighbours per rank (the limit of a pool). It tightens
    with the number of samples sorted together (the run's length)."""
    lengths = sorted(L for step in step_lengths for b in step for L in b)
    per_step = world * BATCH
    return [[lengths[s * per_step + r * BATCH: s * per_step + (r + 1) * BATCH]
             for r in range(world)] for s in range(len(lengths) // per_step)]


#: Sync runs by (configuration, loader workers, micro-batches): section 5 reuses section 1's.
_SYNC_RUNS: dict[tuple, dict] = {}


def _sync(path: Path, cfg: OrderingConfig, world: int, workers: int, steps: int,
          micro_batches_per_step: int) -> dict:
    """Idle and padding of ``world`` real rank pipelines (:func:`lost_compute_figures`), and
    their lengths ``[micro-batch][rank]``; each configuration runs once per process."""
    key = (repr(cfg), world, workers, steps)
    if key not in _SYNC_RUNS:
        rec = run_ranks(path, ordering=cfg, world_size=world, num_workers=workers, steps=steps,
                        **WATCHDOG,
                        batch_size=BATCH, task_encoder_factory=IndexedSyntheticTaskEncoder)
        st = lengths_by_step(rec)
        _SYNC_RUNS[key] = dict(steps=len(st), lengths=st,
                               **lost_compute_figures(st, micro_batches_per_step))
    return _SYNC_RUNS[key]


def bench_sync(path: Path, world: int, pools: list[int], workers: list[int], steps: int,
               micro_batches_per_step: int) -> list:
    rows = []
    for nw in workers:
        base = _sync(path, OrderingConfig(), world, nw, steps, micro_batches_per_step)
        rows.append(dict(workers=nw, pool=0, mode="off", **_figures(base)))
        limit = lost_compute_figures(_global_sort(base["lengths"], world), micro_batches_per_step)
        rows.append(dict(workers=nw, pool=0, mode="global sort",
                         **{**_figures(limit), "steps": base["steps"]}))
        for pool in pools:
            if pool >= 10_000 and nw > 1:
                continue  # 10k-sample pools per worker: the 1-worker run carries the figure
            for mode in ("sample", "batch"):
                cfg = OrderingConfig(length_sort_pool_size=pool, length_sort_mode=mode)
                run = _sync(path, cfg, world, nw, steps, micro_batches_per_step)
                rows.append(dict(workers=nw, pool=pool, mode=mode, **_figures(run)))
                click.echo(f"  workers={nw} pool={pool} {mode}: idle {rows[-1]['idle']:.4f} "
                           f"per micro-batch, padding {rows[-1]['padding']:.4f}", err=True)
    return rows


def _figures(run: dict) -> dict:
    """The printed figures of a :func:`_sync` run (or of its global sort)."""
    return dict(steps=run.get("steps"), idle=run["idle_micro_batch"], idle_step=run["idle_step"],
                padding=run["padding_tokens"])


def bench_overhead(path: Path, pool: int, rounds: int) -> dict:
    """Samples/s of one rank's loader with the pool against without it, the two live loaders
    stepped in turn one pool of samples at a time (:func:`_interleaved_rates`): wall and CPU
    time."""
    cfg = OrderingConfig(length_sort_pool_size=pool, length_sort_mode="batch")
    rate, wall, cpu = _interleaved_rates(path, {"off": OrderingConfig(), "on": cfg}, pool, rounds)
    return dict(pool=pool, samples=pool * rounds, off=rate["off"], on=rate["on"],
                wall_ratio=statistics.median(wall["on"]), cpu_ratio=statistics.median(cpu["on"]),
                wall_rounds=wall["on"], cpu_rounds=cpu["on"], rounds=rounds)


def _state_after(path: Path, cfg: OrderingConfig, n_batches: int) -> tuple[dict, float, float]:
    """The state after ``n_batches`` of a fresh in-process loader, and the wall and CPU seconds
    they took."""
    loader = build_train_loader(path, ordering=cfg, num_workers=0, batch_size=BATCH,
                                **TRAINING_GC, **WATCHDOG)
    it = iter(loader)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n_batches):
        next(it)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    state = loader.save_state_rank()
    del it
    close_loader(loader)
    return state, wall, cpu


def bench_checkpoint(path: Path, pools: list[int]) -> list:
    """State bytes vs pool size (state taken right after the first batch of the first pool,
    when the pool holds pool_size - 4 unemitted samples), and restore vs fill time (wall and
    this process's CPU time: the loaders run in-process)."""
    rows = []
    plain, _, _ = _state_after(path, OrderingConfig(), 1)
    base = len(pickle.dumps(plain))
    for pool in pools:
        cfg = OrderingConfig(length_sort_pool_size=pool, length_sort_mode="batch")
        state, fill, fill_cpu = _state_after(path, cfg, 1)  # first batch = fill one pool + sort
        pooled = pool - BATCH
        size = len(pickle.dumps(state))
        gc.collect()
        loader = build_train_loader(path, ordering=cfg, num_workers=0, batch_size=BATCH,
                                **TRAINING_GC, **WATCHDOG)
        t0, c0 = time.perf_counter(), time.process_time()
        loader.restore_state_rank(state)
        next(iter(loader))  # re-creates the pool's samples from their restore keys
        restore, restore_cpu = time.perf_counter() - t0, time.process_time() - c0
        close_loader(loader)
        rows.append(dict(pool=pool, state_bytes=size, plain_state_bytes=base,
                         bytes_per_pooled_sample=(size - base) / pooled,
                         fill_seconds=fill, restore_seconds=restore, fill_cpu=fill_cpu,
                         restore_cpu=restore_cpu, restore_over_fill=restore / fill,
                         restore_over_fill_cpu=restore_cpu / fill_cpu))
        click.echo(f"  checkpoint pool={pool}: {rows[-1]['bytes_per_pooled_sample']:.1f} B/sample,"
                   f" restore/fill {rows[-1]['restore_over_fill_cpu']:.2f} CPU", err=True)
    return rows


def _print_tables(sync: list, overhead: dict, ckpt: list, world: int, micro_batches_per_step: int
                  ) -> None:
    click.echo(f"\n## Straggler idle and padding ({world} ranks, micro-batch {BATCH}, "
               f"{sync[0]['steps']} micro-batches per rank)\n")
    click.echo(f"Definitions: {LOST_COMPUTE_DEFINITION}; here M = {micro_batches_per_step}. "
               f"'global sort': the {sync[0]['steps'] * world * BATCH:,} samples of the no-pool "
               f"run sorted together and dealt micro-batch by micro-batch ({world} x {BATCH} "
               f"neighbours, {BATCH} per rank); it tightens with the samples sorted together.\n")
    click.echo("| workers | pool | mode | micro-batches | idle per micro-batch | "
               f"idle per step (M = {micro_batches_per_step}) | padding by tokens |")
    click.echo("|---:|---:|---|---:|---:|---:|---:|")
    for r in sync:
        pool = "-" if r["pool"] == 0 else f"{r['pool']:,}"
        click.echo(f"| {r['workers']} | {pool} | {r['mode']} | {r['steps']} | "
                   f"{100 * r['idle']:.2f}% | {100 * r['idle_step']:.2f}% | "
                   f"{100 * r['padding']:.2f}% |")
    o = overhead
    click.echo(f"\n## Pool overhead (one rank, in-process, batch mode, pool {o['pool']:,})\n")
    click.echo("| clock | samples/s off | samples/s on | on / off (median of rounds) | each round |")
    click.echo("|---|---:|---:|---:|---|")
    click.echo(f"| CPU time | - | - | {o['cpu_ratio']:.3f} | "
               f"{' '.join(f'{x:.2f}' for x in o['cpu_rounds'])} |")
    click.echo(f"| wall | {o['off']:.0f} | {o['on']:.0f} | {o['wall_ratio']:.3f} | "
               f"{' '.join(f'{x:.2f}' for x in o['wall_rounds'])} |")
    click.echo(f"(two live loaders stepped in turn, {o['pool']:,} samples at a time, "
               f"{o['rounds']} rounds after each emitted its first turn; ratio = no-pool seconds / "
               "pool seconds for the same samples, > 1 faster than no pool)")
    click.echo("\n## Checkpoint size and restore latency (state after the first batch)\n")
    click.echo("| pool | state bytes | without pool | bytes / pooled sample | fill CPU s | "
               "restore CPU s | restore/fill CPU | fill wall s | restore wall s | "
               "restore/fill wall |")
    click.echo("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in ckpt:
        click.echo(f"| {r['pool']:,} | {r['state_bytes']:,} | {r['plain_state_bytes']:,} | "
                   f"{r['bytes_per_pooled_sample']:.1f} | {r['fill_cpu']:.2f} | "
                   f"{r['restore_cpu']:.2f} | {r['restore_over_fill_cpu']:.2f} | "
                   f"{r['fill_seconds']:.2f} | {r['restore_seconds']:.2f} | "
                   f"{r['restore_over_fill']:.2f} |")


def _sync_checks(sync: list, overhead: dict, ckpt: list) -> None:
    """Checks independent of load (the order is seeded) and load-dependent reports."""
    for nw in sorted({r["workers"] for r in sync}):
        rows = {(r["mode"], r["pool"]): r for r in sync if r["workers"] == nw}
        off, limit = rows[("off", 0)], rows[("global sort", 0)]
        best = min((r for (mode, _), r in rows.items() if mode == "batch"),
                   key=lambda r: r["idle"], default=None)
        if best is None:
            continue
        check(f"{nw} worker(s): batch pool {best['pool']:,} lowers idle per micro-batch below no "
              "pool", best["idle"] < off["idle"],
              f"{100 * best['idle']:.2f}% against {100 * off['idle']:.2f}%")
        check(f"{nw} worker(s): the global sort is the lower bound of idle per micro-batch",
              limit["idle"] <= best["idle"],
              f"{100 * limit['idle']:.2f}% against batch {100 * best['idle']:.2f}%")
    for r in ckpt:
        check(f"checkpoint of pool {r['pool']:,} holds restore keys, not samples",
              r["bytes_per_pooled_sample"] < 100,
              f"{r['bytes_per_pooled_sample']:.1f} B per pooled sample (< 100)")
        load_dependent(f"restore of pool {r['pool']:,} against filling it",
                       r["restore_over_fill_cpu"] <= 1.5,
                       f"restore/fill {r['restore_over_fill_cpu']:.2f} in CPU time, "
                       f"{r['restore_over_fill']:.2f} wall (expected <= 1.5 in CPU time)")
    load_dependent(f"pool {overhead['pool']:,} samples/s against no pool",
                   overhead["cpu_ratio"] >= 0.9,
                   f"CPU-time ratio {overhead['cpu_ratio']:.3f}, wall {overhead['wall_ratio']:.3f} "
                   "(expected >= 0.9 in CPU time)")


# ---- 5. lean pools at equal memory -------------------------------------------------------------


def _photo_dataset(out: Path, num_samples: int) -> Path:
    path = out / f"photo448_{num_samples}"
    if not (path / "web" / ".nv-meta" / "index.uuid").exists():
        click.echo(f"writing {num_samples} trimodal samples with 448x448 JPEGs to {path} ...",
                   err=True)
        with one_time(f"writing {num_samples:,} samples with 448x448 JPEGs"):
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
        with one_time(f"the length index of {path}"):
            built = build_length_index(path, task_encoder=IndexedSyntheticTaskEncoder(),
                                       workers=2)
        seconds = time.perf_counter() - t0
        click.echo(f"  length index of {path}: {built[0].summary.samples} samples in "
                   f"{seconds:.1f} s", err=True)
        return dict(dataset=str(path), samples=built[0].summary.samples, seconds=seconds)


def _lean_cfg(placement: str, pool: int, holds: str = "raw") -> OrderingConfig:
    return OrderingConfig(length_sort_pool_size=pool, length_sort_mode="batch",
                          length_sort_placement=placement, length_sort_pool_holds=holds)


def _loader(path: Path, cfg: OrderingConfig):
    return build_train_loader(path, ordering=cfg, num_workers=0, batch_size=BATCH,
                              **TRAINING_GC, **WATCHDOG,
                              task_encoder_factory=IndexedSyntheticTaskEncoder)


def _pool_memory(path: Path, cfg: OrderingConfig) -> dict:
    """Resident bytes of a full pool right after its first batch, and the fill time."""
    placement, pool = cfg.length_sort_placement, cfg.length_sort_pool_size
    loader = _loader(path, cfg)
    it = iter(loader)
    t0, c0 = time.perf_counter(), time.process_time()
    next(it)
    fill, fill_cpu = time.perf_counter() - t0, time.process_time() - c0
    stage = find_stage(loader.dataset, KeyPoolSortDataset) or find_stage(
        loader.dataset, LengthPoolSortDataset)
    held, objs = pool_holdings(stage)
    nbytes = resident_bytes(objs)
    state = loader.save_state_rank()
    del it, stage, objs
    close_loader(loader)
    gc.collect()
    loader = _loader(path, cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    loader.restore_state_rank(state)
    next(iter(loader))
    restore, restore_cpu = time.perf_counter() - t0, time.process_time() - c0
    close_loader(loader)
    gc.collect()
    return dict(placement=placement, holds=cfg.length_sort_pool_holds if placement == "pre-encode"
                else "encoded samples", pool=pool, held=held, bytes=nbytes,
                bytes_per_sample=nbytes / held, fill_seconds=fill, restore_seconds=restore,
                fill_cpu=fill_cpu, restore_cpu=restore_cpu,
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
               repeats: int, workers: int, steps: int, micro_batches_per_step: int) -> dict:
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
    sync = {}
    # "lean raw" emits exactly what "lean" emits (same lengths, same order): one sync run each
    # for off / encoded / lean; "off" is section 1's run (the same configuration).
    for name, cfg in configs.items():
        if name == "lean raw":
            continue
        sync[name] = _figures(_sync(sync_path, cfg, world, workers, steps, micro_batches_per_step))
        click.echo(f"  sync {name}: idle {sync[name]['idle']:.4f} padding "
                   f"{sync[name]['padding']:.4f}", err=True)
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
               "capacity at the budget | idle per micro-batch | idle per step | padding by tokens "
               "| samples/s (wall) | restore CPU s (wall) | fill CPU s (wall) |")
    click.echo("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    off = r["sync"]["off"]
    click.echo(f"| off | - | - | - | - | - | - | {100 * off['idle']:.2f}% | "
               f"{100 * off['idle_step']:.2f}% | {100 * off['padding']:.2f}% | "
               f"{r['rate']['off']:.0f} | - | - |")
    for name, m in r["memory"].items():
        s = r["sync"]["lean" if name == "lean raw" else name]
        click.echo(f"| {name} | {m['placement']} | {m['holds']} | {m['pool']:,} | "
                   f"{m['bytes_per_sample']:,.0f} | "
                   f"{m['bytes'] / 2**20:,.1f} MiB | {m['capacity_at_budget']:,} | "
                   f"{100 * s['idle']:.2f}% | {100 * s['idle_step']:.2f}% | "
                   f"{100 * s['padding']:.2f}% | {r['rate'][name]:.0f} | "
                   f"{m['restore_cpu']:.2f} ({m['restore_seconds']:.2f}) | "
                   f"{m['fill_cpu']:.2f} ({m['fill_seconds']:.2f}) |")
    click.echo("\n| pool | CPU ratio to off (median) | each round | wall ratio to off (median) | "
               "each round |")
    click.echo("|---|---:|---|---:|---|")
    for name in ("encoded", "lean", "lean raw"):
        w, c = r["wall_ratio"][name], r["cpu_ratio"][name]
        click.echo(f"| {name} | {statistics.median(c):.3f} | {' '.join(f'{x:.2f}' for x in c)} | "
                   f"{statistics.median(w):.3f} | {' '.join(f'{x:.2f}' for x in w)} |")
    click.echo(f"(samples/s and ratios: live loaders in one process, stepped in turn "
               f"{r['turn_samples']:,} samples at a time (one lean pool, whole encoded pools), "
               f"order rotated each round, {r['repeats']} rounds after each emitted its first "
               "turn; ratio = no-pool seconds / pool seconds for the same number of samples, "
               "> 1 faster than no pool; CPU = this process's CPU time; one rank, in-process)")
    click.echo(f"sync: {r['steps']} micro-batches per rank on the trimodal set (section 1's runs "
               "where the configuration is the same); memory, samples/s and restore on the "
               "448x448 JPEG set (the order depends only on lengths).")
    for ix in r["indexes"]:
        built = "existing" if ix["seconds"] is None else f"built in {ix['seconds']:.1f} s"
        click.echo(f"length index {ix['dataset']}: {ix['samples']:,} samples ({built})")
    lean, encoded = r["memory"]["lean"], r["memory"]["encoded"]
    check("the lean key pool holds less per pooled sample than the encoded pool",
          lean["bytes_per_sample"] < encoded["bytes_per_sample"] / 100,
          f"{lean['bytes_per_sample']:,.0f} B against {encoded['bytes_per_sample']:,.0f} B "
          "(under 1/100)")
    for name in ("lean", "lean raw"):
        cpu, wall = (statistics.median(r[k][name]) for k in ("cpu_ratio", "wall_ratio"))
        load_dependent(f"{name} pool samples/s against no pool", cpu >= 0.9,
                       f"CPU-time ratio {cpu:.3f}, wall {wall:.3f} (expected >= 0.9 in CPU time)")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--out", default="bench_out", type=click.Path(file_okay=False),
              help="Folder for the dataset (reused between runs) and results.json.")
@click.option("--quick", is_flag=True, help="Small scale: pools 100/1,000, fewer steps.")
@click.option("--samples", default=None, type=int,
              help="Dataset size [default: 80,000; 8,000 with --quick].")
@click.option("--world-size", default=8, help="Simulated data-parallel ranks.")
@click.option("--micro-batches-per-step", default=8,
              help="M of the idle per optimizer step (consecutive micro-batches per rank).")
@click.option("--only", type=click.Choice(["all", "sync", "lean"]), default="all",
              help="Run sections 1-4 (sync), section 5 (lean) or both.")
def main(out: str, quick: bool, samples: int | None, world_size: int,
         micro_batches_per_step: int, only: str) -> None:
    """Measure cross-rank length sync, overhead, checkpoint size, restore latency and lean pools."""
    start = begin()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_sync = samples or (8_000 if quick else 80_000)
    path = _dataset(out_dir, n_sync)
    pools = [100, 1_000] if quick else [100, 1_000, 10_000]
    # --quick: in-process ranks (0 loader workers: the same order as 1 worker, at about half the
    # CPU time, which a worker process spends again on its start and on pickling batches)
    workers = [0] if quick else [1, 4]
    # Micro-batches per rank of every sync run: one full pool of the largest size per rank
    # (1,000 samples with --quick, else 10,000). Every configuration runs once (section 5 reuses section 1's).
    steps = 250 if quick else 2_500
    if only in ("all", "sync"):
        sync = bench_sync(path, world_size, pools, workers, steps, micro_batches_per_step)
        overhead = bench_overhead(path, pool=1_000, rounds=3 if quick else 8)
        ckpt = bench_checkpoint(path, pools)
        _print_tables(sync, overhead, ckpt, world_size, micro_batches_per_step)
        _sync_checks(sync, overhead, ckpt)
        click.echo(f"\n(sections 1-4: {start.text()} so far; dataset {path})")
        (out_dir / "results.json").write_text(json.dumps(dict(
            sync=sync, overhead=overhead, checkpoint=ckpt), indent=2))
    if only in ("all", "lean"):
        photo = _photo_dataset(out_dir, 3_000 if quick else 12_000)
        # The package refuses a pool larger than a loader worker's share of repeating data, so
        # the lean pool is sized to the sync data: at most n_sync / world_size (one worker).
        lean_pool = 1_000 if quick else 10_000
        share = n_sync // world_size // BATCH * BATCH
        if share < lean_pool:
            click.echo(f"lean pool {share:,} instead of {lean_pool:,}: a loader worker's share of "
                       f"{n_sync:,} samples at {world_size} ranks (a larger pool is refused)",
                       err=True)
            lean_pool = share
        lean = bench_lean(path, photo, world_size,
                          encoded_pool=min(200 if quick else 1_000, lean_pool),
                          lean_pool=lean_pool, repeats=2 if quick else 8, workers=workers[0],
                          steps=steps, micro_batches_per_step=micro_batches_per_step)
        _print_lean(lean)
        (out_dir / "lean_results.json").write_text(json.dumps(lean, indent=2))
    finish(start)


if __name__ == "__main__":
    main()
