#!/usr/bin/env python
"""Benchmark of the length pool with Energon's sequence packing, every figure measured in this run.

8 simulated data-parallel ranks (one real Energon pipeline each, ``WorkerConfig(rank=r,
world_size=8)``) over the synthetic trimodal dataset (50% ~300, 35% ~1,200, 15% ~4,000 text
tokens + 64 image tokens), Energon's ``PackingDataset`` with the default first-fit-decreasing
packer, one pack per micro-batch, packing to 2,048 and to 4,096 tokens. For each target:

- ``off``: packing only, no pool;
- ``samples``: the length pool sorts 1,000 encoded samples before packing
  (``pack_pool_placement: samples``);
- ``packs``: a pool of packs after packing, sorted by cost and permuted with the
  rank-independent seed (``pack_pool_placement: packs``), sized to hold about as many samples
  as the 1,000-sample pool (``round(1000 / documents per pack)`` packs, measured in the ``off``
  run): the same memory.

Reported per configuration:

- packing efficiency: real tokens / (packs x target), over the first ``--steps`` packs per rank;
- straggler idle under the per-document attention cost ``sum(L + L^2/4096)`` per pack
  (``1 - mean/max`` over the ranks), per micro-batch (one pack) and per optimizer step (the
  sum of M consecutive packs per rank), averaged over those steps;
- samples/s: one rank's loader (``get_savable_loader``, in-process; the same loader for every
  configuration), timed from ``iter(loader)`` until it has emitted ``--timed-samples`` samples,
  the same count for every configuration, fills included (a pool reads as many samples as it
  emits only over whole fill-and-drain cycles; a clock started after the first fill would
  credit the pool with samples read before it started, so the count spans several 1,000-sample
  cycles). The configurations run in interleaved rounds (round k: rank ``k % 8``, order rotated)
  because the machine is shared; ``vs off`` is the median of the per-round ratios, and the
  no-pool baseline runs twice in every round (``off (2nd)``: its ratio is the drift check).
  Ratios are given in CPU time (this process's: the loader runs in-process; other processes
  cannot inflate it) beside wall time, and reported, never failed. The first micro-batch alone
  (the first fill) is reported too;
- the warmup: the same three configurations with a steep warmup (``--warmup-start`` -> target
  over ``--warmup-steps`` steps, one step per pack): mean tokens per pack against the cap of the
  step it is emitted in (the fill), packs over their cap, and the straggler idle during the
  warmup.

Usage:
    python tools/bench_packing.py --quick     # 8,000 samples, 100 packs per rank, 3 rounds
                                              # timed at the first target, no drift baseline
    python tools/bench_packing.py             # 24,000 samples, 600 packs per rank
"""

from __future__ import annotations

import itertools
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

from energon_ordering import OrderingConfig
from energon_ordering.inspect.diagnostics import straggler_idle
from energon_ordering.inspect.rank_simulation import TRAINING_GC, build_train_loader, close_loader, record_batch
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.warmup.pack_cap import pack_target
from energon_ordering.warmup.schedule import SeqLenWarmup

WORLD = 8
POOL_SAMPLES = 1000


def _dataset(out: Path, num_samples: int) -> Path:
    path = out / f"trimodal_{num_samples}"
    if not (path / "web" / ".nv-meta" / "index.uuid").exists():
        click.echo(f"writing {num_samples} trimodal samples to {path} (energon prepare) ...", err=True)
        with one_time(f"writing {num_samples:,} samples"):
            make_synthetic_dataset(path, [SourceSpec("web", num_samples, "trimodal")],
                                   shard_size=256)
    return path / "web"


def _run(path: Path, cfg: OrderingConfig, steps: int) -> dict:
    """Runs the 8 ranks one after the other for ``steps`` packs each."""
    packs_by_rank = []
    for rank in range(WORLD):
        loader = build_train_loader(path, ordering=cfg, rank=rank, world_size=WORLD, batch_size=1,
                                **TRAINING_GC, **WATCHDOG)
        packs_by_rank.append([record_batch(b).lengths for b in itertools.islice(loader, steps)])
        close_loader(loader)
    return dict(
        step_lengths=[[rank[s] for rank in packs_by_rank] for s in range(steps)],
        packs=[p for rank in packs_by_rank for p in rank],
    )


def _rate(path: Path, cfg: OrderingConfig, rank: int, timed_samples: int
          ) -> tuple[float, float, float]:
    """(samples/s wall, samples/s in CPU time, first micro-batch in s) of one rank's loader: the
    clock starts at ``iter(loader)`` and stops when ``timed_samples`` samples were emitted (CPU:
    this process's; the loader runs in-process)."""
    loader = build_train_loader(path, ordering=cfg, rank=rank, world_size=WORLD, batch_size=1,
                                **TRAINING_GC, **WATCHDOG)
    t0, c0 = time.perf_counter(), time.process_time()
    it = iter(loader)
    n = len(record_batch(next(it)).keys)
    first = time.perf_counter() - t0
    while n < timed_samples:
        n += len(record_batch(next(it)).keys)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    del it
    close_loader(loader)
    return n / seconds, n / cpu, first


def _throughput(path: Path, cfgs: dict[str, OrderingConfig], rounds: int, timed_samples: int) -> dict:
    """Interleaved rounds: in round k every configuration runs rank ``k % 8`` once, in an order
    rotated each round; per configuration the median of its per-round ratio to ``off``."""
    names = list(cfgs)
    rates: dict[str, list[float]] = {n: [] for n in names}
    cpu_rates: dict[str, list[float]] = {n: [] for n in names}
    firsts: dict[str, list[float]] = {n: [] for n in names}
    for k in range(rounds):
        for name in names[k % len(names):] + names[: k % len(names)]:
            rate, cpu_rate, first = _rate(path, cfgs[name], k % WORLD, timed_samples)
            rates[name].append(rate)
            cpu_rates[name].append(cpu_rate)
            firsts[name].append(first)
    return {n: dict(rates=rates[n], first=statistics.median(firsts[n]),
                    samples_per_s=statistics.median(rates[n]),
                    cpu_samples_per_s=statistics.median(cpu_rates[n]),
                    vs_off=statistics.median(r / o for r, o in zip(rates[n], rates["off"])),
                    cpu_vs_off=statistics.median(
                        r / o for r, o in zip(cpu_rates[n], cpu_rates["off"])))
            for n in names}


def _figures(run: dict, target: int, micro_batches_per_step: int) -> dict:
    packs = run["packs"]
    lost = lost_compute_figures(run["step_lengths"], micro_batches_per_step)
    return dict(
        efficiency=sum(sum(p) for p in packs) / (target * len(packs)),
        idle=lost["idle_micro_batch"],
        idle_step=lost["idle_step"],
        docs_per_pack=sum(len(p) for p in packs) / len(packs),
        over_cap=sum(sum(p) > target for p in packs),
    )


def _warmup_figures(run: dict, target: int, warm: SeqLenWarmup, warmup_steps: int) -> dict:
    steps = run["step_lengths"][:warmup_steps]
    caps = [pack_target(s, target, warm) for s in range(len(steps))]
    fills = [sum(p) / cap for ranks, cap in zip(steps, caps) for p in ranks]
    mid = len(steps) // 2
    return dict(
        warmup_fill=statistics.mean(fills),
        warmup_over_cap=sum(sum(p) > cap for ranks, cap in zip(steps, caps) for p in ranks),
        warmup_idle=straggler_idle(steps),
        warmup_points=[(s, round(statistics.mean(sum(p) for p in steps[s])), caps[s])
                       for s in (0, mid, len(steps) - 1)],
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--quick", is_flag=True, help="Small scale.")
@click.option("--out", type=click.Path(file_okay=False), default="bench_data", help="Dataset folder.")
@click.option("--buffer", "buffer_size", default=256, help="packing_buffer_size (samples).")
@click.option("--targets", default="2048,4096", help="Pack targets (tokens).")
@click.option("--warmup-steps", default=None, type=int, help="Warmup length [default: steps / 2].")
@click.option("--warmup-start", default=512, help="Warmup start (tokens).")
@click.option("--samples", "num_samples", default=None, type=int,
              help="Dataset size [8,000 quick, 24,000 full]; >= 8 ranks x 1,000 for the pool.")
@click.option("--steps", default=None, type=int, help="Packs per rank measured [100 quick, 600 full].")
@click.option("--timed-samples", default=None, type=int,
              help="Samples per loader timed from the start [2,000 quick, 6,000 full].")
@click.option("--rounds", default=None, type=int, help="Interleaved throughput rounds [3 quick, 8 full].")
@click.option("--micro-batches-per-step", default=8,
              help="M of the idle per optimizer step (consecutive packs per rank).")
def main(quick: bool, out: str, buffer_size: int, targets: str, warmup_steps: int | None,
         warmup_start: int, num_samples: int | None, steps: int | None,
         timed_samples: int | None, rounds: int | None, micro_batches_per_step: int) -> None:
    """Packing with the pool off, samples sorted before packing and a pool of packs."""
    start = begin()
    m = micro_batches_per_step
    num_samples = num_samples or (8000 if quick else 24000)
    steps = steps or (100 if quick else 600)
    timed_samples = timed_samples or (2000 if quick else 6000)
    rounds = rounds or (3 if quick else 8)
    warmup_steps = warmup_steps or steps // 2
    if num_samples < WORLD * POOL_SAMPLES:
        raise click.ClickException(
            f"--samples {num_samples} is below {WORLD} ranks x {POOL_SAMPLES} samples: the "
            "1,000-sample pool would exceed a rank's share of the data.")
    path = _dataset(Path(out), num_samples)
    results: dict[int, dict[str, dict]] = {}
    for target in [int(t) for t in targets.split(",")]:
        base = dict(packing_buffer_size=buffer_size, pack_seq_length=target, seed=1234)
        rows: dict[str, dict] = {"off": _figures(_run(path, OrderingConfig(**base), steps), target, m)}
        pack_pool = max(1, round(POOL_SAMPLES / rows["off"]["docs_per_pack"]))
        pools = {"off": ("packs", 0), "samples": ("samples", POOL_SAMPLES), "packs": ("packs", pack_pool)}
        cfgs = {name: OrderingConfig(**base, length_sort_pool_size=pool, pack_pool_placement=placement)
                for name, (placement, pool) in pools.items()}
        for name in ("samples", "packs"):
            rows[name] = _figures(_run(path, cfgs[name], steps), target, m)
        warm = SeqLenWarmup(start=warmup_start, full=target, warmup_steps=warmup_steps)
        for name, (placement, pool) in pools.items():
            cfg = OrderingConfig(**base, seq_length_warmup=warm, length_sort_pool_size=pool,
                                 pack_pool_placement=placement)
            rows[name].update(_warmup_figures(_run(path, cfg, warmup_steps), target, warm, warmup_steps))
            rows[name]["pool"] = pool
        results[target] = rows
        if quick and len(results) > 1:
            continue  # --quick times the first target only (the pools' cost hardly depends on it)
        # without --quick the no-pool baseline runs twice in every round: its second ratio is
        # the drift / noise check (the CPU-time ratio is the steady figure)
        timed = {**cfgs, "off (2nd)": cfgs["off"]} if not quick else cfgs
        speed = _throughput(path, timed, rounds, timed_samples)
        for name, r in rows.items():
            r.update(speed[name])
        if "off (2nd)" in speed:
            rows["off (2nd)"] = speed["off (2nd)"]
        click.echo(f"  target {target}: {rows}", err=True)

    click.echo(f"\n## Packing with the length pool ({WORLD} ranks, 1 pack per micro-batch, "
               f"{steps} packs per rank, packing buffer {buffer_size} samples, trimodal "
               f"{num_samples:,} samples; warmup {warmup_start} -> target over {warmup_steps} "
               f"steps; {start.text()} so far)\n")
    click.echo(f"Definitions: one pack per micro-batch, a pack's cost the sum over its documents; "
               f"{LOST_COMPUTE_DEFINITION}; here M = {m} packs. Packing efficiency = real tokens "
               "/ (packs x target), i.e. 1 - padding by tokens.\n")
    click.echo("| target | pool | pool size | docs/pack | packing efficiency | idle per micro-batch "
               f"| idle per step (M = {m}) | warmup tokens/cap | warmup over cap | warmup idle |")
    click.echo("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for target, rows in results.items():
        for name in ("off", "samples", "packs"):
            r = rows[name]
            size = "-" if r["pool"] == 0 else (f"{r['pool']:,} samples" if name == "samples"
                                               else f"{r['pool']:,} packs")
            click.echo(f"| {target:,} | {name} | {size} | {r['docs_per_pack']:.2f} | "
                       f"{100 * r['efficiency']:.1f}% | {100 * r['idle']:.1f}% | "
                       f"{100 * r['idle_step']:.1f}% | "
                       f"{100 * r['warmup_fill']:.1f}% | {r['warmup_over_cap']} | "
                       f"{100 * r['warmup_idle']:.1f}% |")
    click.echo(f"\nsamples/s of one rank's loader over {timed_samples:,} samples from iter() "
               f"(fills included), {rounds} interleaved rounds (rank k % 8 in round k, order "
               "rotated); vs off = median of the per-round ratios, in CPU time (this process's: "
               "the loader runs in-process) and wall time; 'off (2nd)' is the no-pool baseline "
               "run a second time in every round (drift check; not with --quick, which also "
               "times the first target only)\n")
    click.echo("| target | pool | samples/s per round (wall) | median wall | vs off, CPU | "
               "vs off, wall | first batch wall (s) |")
    click.echo("|---:|---|---|---:|---:|---:|---:|")
    timed_rows = [(target, name, rows[name]) for target, rows in results.items()
                  for name in ("off", "samples", "packs", "off (2nd)")
                  if name in rows and "rates" in rows[name]]
    for target, name, r in timed_rows:
        click.echo(f"| {target:,} | {name} | {', '.join(f'{x:.0f}' for x in r['rates'])} | "
                   f"{r['samples_per_s']:.0f} | {r['cpu_vs_off']:.2f} | {r['vs_off']:.2f} | "
                   f"{r['first']:.2f} |")
    click.echo("\nWarmup, tokens per pack (mean over ranks) vs cap at steps (first, middle, last):")
    for target, rows in results.items():
        for name in ("off", "samples", "packs"):
            click.echo(f"  {target} {name}: " + ", ".join(
                f"step {s}: {t:,}/{c:,}" for s, t, c in rows[name]["warmup_points"]))
    click.echo("")
    for target, rows in results.items():
        for name in ("off", "samples", "packs"):
            r = rows[name]
            check(f"pack {target:,}, {name}: no pack over the target", r["over_cap"] == 0,
                  f"{r['over_cap']} packs over")
            check(f"pack {target:,}, {name}: no pack over the warmup cap of its emission step",
                  r["warmup_over_cap"] == 0, f"{r['warmup_over_cap']} packs over")
        check(f"pack {target:,}: the pool of packs lowers idle per micro-batch below no pool",
              rows["packs"]["idle"] < rows["off"]["idle"],
              f"{100 * rows['packs']['idle']:.1f}% against {100 * rows['off']['idle']:.1f}%")
    for target, name, r in timed_rows:
        if name != "off":
            load_dependent(f"pack {target:,}, {name}: samples/s against no pool",
                           r["cpu_vs_off"] >= 0.9,
                           f"CPU-time ratio {r['cpu_vs_off']:.2f}, wall {r['vs_off']:.2f} "
                           "(expected >= 0.9 in CPU time)")
    finish(start)


if __name__ == "__main__":
    main()
