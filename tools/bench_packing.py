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
  (``1 - mean/max`` over the ranks, averaged over those steps);
- samples/s: every configuration runs the same loader (``get_savable_loader``, in-process) on
  every rank; the clock starts after the first micro-batch (the first pool fill, reported
  separately as "first batch") and stops when the rank has emitted ``--timed-samples`` more
  samples, the same count for every configuration; samples/s = timed samples / timed seconds
  summed over the 8 ranks. Ratios are against ``off`` of the same target, and ``off`` runs a
  second time at the end of each target as a drift check (the machine is shared);
- the warmup: the same three configurations with a steep warmup (``--warmup-start`` -> target
  over ``--warmup-steps`` steps, one step per pack): mean tokens per pack against the cap of the
  step it is emitted in (the fill), packs over their cap, and the straggler idle during the
  warmup.

Usage:
    python tools/bench_packing.py --quick     # 8,000 samples, 150 packs per rank
    python tools/bench_packing.py             # 24,000 samples, 600 packs per rank
"""

from __future__ import annotations

import itertools
import statistics
import time
from pathlib import Path

import click

from energon_ordering import OrderingConfig
from energon_ordering.inspect.diagnostics import straggler_idle
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, record_batch
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.warmup.pack_cap import pack_target
from energon_ordering.warmup.schedule import SeqLenWarmup

WORLD = 8
POOL_SAMPLES = 1000


def _dataset(out: Path, num_samples: int) -> Path:
    path = out / f"trimodal_{num_samples}"
    if not (path / "web" / ".nv-meta" / "index.uuid").exists():
        click.echo(f"writing {num_samples} trimodal samples to {path} (energon prepare) ...", err=True)
        make_synthetic_dataset(path, [SourceSpec("web", num_samples, "trimodal")], shard_size=256)
    return path / "web"


def _run(path: Path, cfg: OrderingConfig, steps: int, timed_samples: int) -> dict:
    """Runs the 8 ranks one after the other; see the module docstring for what is timed."""
    packs_by_rank, first, timed_seconds, timed = [], 0.0, 0.0, 0
    for rank in range(WORLD):
        loader = build_train_loader(path, ordering=cfg, rank=rank, world_size=WORLD, batch_size=1)
        t0 = time.perf_counter()
        it = iter(loader)
        records = [record_batch(next(it))]
        t1 = time.perf_counter()
        n, t_end = 0, None
        while len(records) < steps or t_end is None:
            batch = record_batch(next(it))
            records.append(batch)
            if t_end is None:
                n += len(batch.keys)
                if n >= timed_samples:
                    t_end = time.perf_counter()
        del it
        close_loader(loader)
        first += t1 - t0
        timed_seconds += t_end - t1
        timed += n
        packs_by_rank.append([r.lengths for r in records[:steps]])
    return dict(
        step_lengths=[[rank[s] for rank in packs_by_rank] for s in range(steps)],
        packs=[p for rank in packs_by_rank for p in rank],
        first=first / WORLD,
        samples_per_s=timed / timed_seconds,
    )


def _figures(run: dict, target: int) -> dict:
    packs = run["packs"]
    return dict(
        efficiency=sum(sum(p) for p in packs) / (target * len(packs)),
        idle=straggler_idle(run["step_lengths"]),
        docs_per_pack=sum(len(p) for p in packs) / len(packs),
        samples_per_s=run["samples_per_s"],
        first=run["first"],
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
@click.option("--steps", default=None, type=int, help="Packs per rank measured [150 quick, 600 full].")
@click.option("--timed-samples", default=None, type=int,
              help="Samples per rank timed after the first micro-batch [300 quick, 1,200 full].")
def main(quick: bool, out: str, buffer_size: int, targets: str, warmup_steps: int | None,
         warmup_start: int, num_samples: int | None, steps: int | None,
         timed_samples: int | None) -> None:
    num_samples = num_samples or (8000 if quick else 24000)
    steps = steps or (150 if quick else 600)
    timed_samples = timed_samples or (300 if quick else 1200)
    warmup_steps = warmup_steps or steps // 2
    if num_samples < WORLD * POOL_SAMPLES:
        raise click.ClickException(
            f"--samples {num_samples} is below {WORLD} ranks x {POOL_SAMPLES} samples: the "
            "1,000-sample pool would exceed a rank's share of the data.")
    path = _dataset(Path(out), num_samples)
    results: dict[int, dict[str, dict]] = {}
    t_start = time.perf_counter()
    for target in [int(t) for t in targets.split(",")]:
        base = dict(packing_buffer_size=buffer_size, pack_seq_length=target, seed=1234)
        rows: dict[str, dict] = {"off": _figures(_run(path, OrderingConfig(**base), steps, timed_samples), target)}
        rows["off"]["pool"] = 0
        pack_pool = max(1, round(POOL_SAMPLES / rows["off"]["docs_per_pack"]))
        pools = {"off": ("packs", 0), "samples": ("samples", POOL_SAMPLES), "packs": ("packs", pack_pool)}
        for name in ("samples", "packs"):
            placement, pool = pools[name]
            cfg = OrderingConfig(**base, length_sort_pool_size=pool, pack_pool_placement=placement)
            rows[name] = _figures(_run(path, cfg, steps, timed_samples), target)
            rows[name]["pool"] = pool
            click.echo(f"  target {target} {name}: {rows[name]}", err=True)
        warm = SeqLenWarmup(start=warmup_start, full=target, warmup_steps=warmup_steps)
        for name, (placement, pool) in pools.items():
            cfg = OrderingConfig(**base, seq_length_warmup=warm, length_sort_pool_size=pool,
                                 pack_pool_placement=placement)
            run = _run(path, cfg, warmup_steps, 1)
            rows[name].update(_warmup_figures(run, target, warm, warmup_steps))
        again = _figures(_run(path, OrderingConfig(**base), steps, timed_samples), target)
        again["pool"] = 0
        again.update({k: rows["off"][k] for k in rows["off"] if k.startswith("warmup")})
        rows["off again"] = again
        results[target] = rows
    minutes = (time.perf_counter() - t_start) / 60

    click.echo(f"\n## Packing with the length pool ({WORLD} ranks, 1 pack per micro-batch, "
               f"{steps} packs per rank, packing buffer {buffer_size} samples, trimodal "
               f"{num_samples:,} samples; samples/s over {timed_samples:,} samples per rank after "
               f"the first micro-batch; warmup {warmup_start} -> target over {warmup_steps} steps; "
               f"{minutes:.1f} min)\n")
    click.echo("| target | pool | pool size | docs/pack | packing efficiency | straggler idle | "
               "samples/s | vs off | first batch (s) | warmup tokens/cap | warmup over cap | "
               "warmup idle |")
    click.echo("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for target, rows in results.items():
        for name, r in rows.items():
            size = "-" if r["pool"] == 0 else (f"{r['pool']:,} samples" if name == "samples"
                                               else f"{r['pool']:,} packs")
            click.echo(f"| {target:,} | {name} | {size} | {r['docs_per_pack']:.2f} | "
                       f"{100 * r['efficiency']:.1f}% | {100 * r['idle']:.1f}% | "
                       f"{r['samples_per_s']:.0f} | "
                       f"{r['samples_per_s'] / rows['off']['samples_per_s']:.2f} | "
                       f"{r['first']:.2f} | {100 * r['warmup_fill']:.1f}% | "
                       f"{r['warmup_over_cap']} | {100 * r['warmup_idle']:.1f}% |")
    click.echo("\nWarmup, tokens per pack (mean over ranks) vs cap at steps (first, middle, last):")
    for target, rows in results.items():
        for name, r in itertools.islice(rows.items(), 3):
            click.echo(f"  {target} {name}: " + ", ".join(
                f"step {s}: {t:,}/{c:,}" for s, t, c in r["warmup_points"]))


if __name__ == "__main__":
    main()
