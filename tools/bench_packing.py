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

Reported per configuration: packing efficiency (real tokens / (packs x target)), straggler idle
under the per-document attention cost ``sum(L + L^2/4096)`` per pack (``1 - mean/max`` over the
ranks, averaged over steps), samples/s through the 8 pipelines (in-process, one after the
other), and, with the warmup on (``start`` -> target over ``--warmup-steps`` steps), the tokens
per pack against the cap of each step.

Usage:
    python tools/bench_packing.py --quick     # ~6,000 samples, 150 packs per rank
    python tools/bench_packing.py             # 24,000 samples, 600 packs per rank
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import click

from energon_ordering import OrderingConfig
from energon_ordering.inspect.diagnostics import straggler_idle
from energon_ordering.inspect.rank_simulation import lengths_by_step, run_ranks
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


def _run(path: Path, cfg: OrderingConfig, steps: int) -> dict:
    t0 = time.perf_counter()
    records = run_ranks(path, ordering=cfg, world_size=WORLD, steps=steps, batch_size=1)
    seconds = time.perf_counter() - t0
    step_lengths = lengths_by_step(records)
    packs = [b.lengths for rank in records for b in rank]
    return dict(
        step_lengths=step_lengths,
        packs=packs,
        docs=sum(len(p) for p in packs),
        seconds=seconds,
    )


def _figures(run: dict, targets: list[int]) -> dict:
    packs = run["packs"]
    return dict(
        efficiency=sum(sum(p) for p in packs) / sum(targets),
        idle=straggler_idle(run["step_lengths"]),
        docs_per_pack=run["docs"] / len(packs),
        samples_per_s=run["docs"] / run["seconds"],
        over_cap=sum(sum(p) > t for p, t in zip(packs, targets)),
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--quick", is_flag=True, help="Small scale.")
@click.option("--out", type=click.Path(file_okay=False), default="bench_data", help="Dataset folder.")
@click.option("--buffer", "buffer_size", default=256, help="packing_buffer_size (samples).")
@click.option("--targets", default="2048,4096", help="Pack targets (tokens).")
@click.option("--warmup-steps", default=None, type=int, help="Warmup length [default: steps / 2].")
@click.option("--warmup-start", default=512, help="Warmup start (tokens).")
@click.option("--samples", "num_samples", default=None, type=int, help="Dataset size [6,000 quick, 24,000 full].")
@click.option("--steps", default=None, type=int, help="Packs per rank [150 quick, 600 full].")
def main(quick: bool, out: str, buffer_size: int, targets: str, warmup_steps: int | None,
         warmup_start: int, num_samples: int | None, steps: int | None) -> None:
    num_samples = num_samples or (6000 if quick else 24000)
    steps = steps or (150 if quick else 600)
    warmup_steps = warmup_steps or steps // 2
    path = _dataset(Path(out), num_samples)
    results: dict[int, dict[str, dict]] = {}
    for target in [int(t) for t in targets.split(",")]:
        base = dict(packing_buffer_size=buffer_size, pack_seq_length=target, seed=1234)
        rows: dict[str, dict] = {}
        off = _run(path, OrderingConfig(**base), steps)
        rows["off"] = _figures(off, [target] * len(off["packs"]))
        pack_pool = max(1, round(POOL_SAMPLES / rows["off"]["docs_per_pack"]))
        for name, cfg in (
            ("samples", OrderingConfig(**base, length_sort_pool_size=POOL_SAMPLES,
                                       pack_pool_placement="samples")),
            ("packs", OrderingConfig(**base, length_sort_pool_size=pack_pool,
                                     pack_pool_placement="packs")),
        ):
            run = _run(path, cfg, steps)
            rows[name] = _figures(run, [target] * len(run["packs"]))
            rows[name]["pool"] = cfg.length_sort_pool_size
            click.echo(f"  target {target} {name}: {rows[name]}", err=True)
        rows["off"]["pool"] = 0
        # warmup: start -> target over warmup_steps, for each placement with a pool
        warm = SeqLenWarmup(start=warmup_start, full=target, warmup_steps=warmup_steps)
        for name in ("off", "samples", "packs"):
            cfg = OrderingConfig(**base, seq_length_warmup=warm,
                                 length_sort_pool_size=rows[name]["pool"],
                                 pack_pool_placement="packs" if name == "off" else name)
            run = _run(path, cfg, steps)
            caps = [pack_target(s, target, warm) for s in range(len(run["step_lengths"]))]
            per_step = [statistics.mean(sum(b) for b in ranks) / cap
                        for ranks, cap in zip(run["step_lengths"], caps)][:warmup_steps]
            rows[name]["warmup_fill"] = statistics.mean(per_step)
            rows[name]["warmup_over_cap"] = sum(
                sum(b) > cap for ranks, cap in zip(run["step_lengths"], caps) for b in ranks)
            rows[name]["warmup_first"] = [(s, round(per_step[s] * caps[s]), caps[s])
                                          for s in (0, warmup_steps // 2, warmup_steps - 1)]
        results[target] = rows

    click.echo(f"\n## Packing with the length pool ({WORLD} ranks, 1 pack per micro-batch, "
               f"{steps} packs per rank, packing buffer {buffer_size} samples, trimodal)\n")
    click.echo("| target | pool | pool size | docs/pack | packing efficiency | straggler idle | "
               "samples/s | over cap | warmup tokens/cap | warmup over cap |")
    click.echo("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for target, rows in results.items():
        for name, r in rows.items():
            size = "-" if name == "off" else (f"{r['pool']:,} samples" if name == "samples"
                                              else f"{r['pool']:,} packs")
            click.echo(f"| {target:,} | {name} | {size} | {r['docs_per_pack']:.2f} | "
                       f"{100 * r['efficiency']:.1f}% | {100 * r['idle']:.1f}% | "
                       f"{r['samples_per_s']:.0f} | {r['over_cap']} | "
                       f"{100 * r['warmup_fill']:.1f}% | {r['warmup_over_cap']} |")
    click.echo("\nWarmup, tokens per pack (mean over ranks) vs cap at steps (first, middle, last):")
    for target, rows in results.items():
        for name, r in rows.items():
            click.echo(f"  {target} {name}: " + ", ".join(
                f"step {s}: {t:,}/{c:,}" for s, t, c in r["warmup_first"]))
    for target, rows in results.items():
        click.echo(f"\nratios at {target}: idle packs/off {rows['packs']['idle'] / rows['off']['idle']:.3f}, "
                   f"samples/off {rows['samples']['idle'] / rows['off']['idle']:.3f}; samples/s "
                   f"packs/off {rows['packs']['samples_per_s'] / rows['off']['samples_per_s']:.3f}, "
                   f"samples/off {rows['samples']['samples_per_s'] / rows['off']['samples_per_s']:.3f}")


if __name__ == "__main__":
    main()
