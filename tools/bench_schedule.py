#!/usr/bin/env python
"""Benchmark of mixture schedules on the real pipeline, every figure measured in this run.

One rank, micro-batch 4, one micro-batch per step, over a synthetic 3-source metadataset
(web / code / curated, each its own prepared dataset). Prints:

1. schedule fidelity: max |realised - target| samples per window (and per prefix) for the
   ``deterministic`` and ``random`` policies over 20,000 samples of a 3-phase schedule with a ramp;
   and, on 8 simulated ranks (micro-batch 4, 4 micro-batches per step, no pool, 2 loader
   workers), max abs(realised - target) per optimizer step summed over the ranks, and the share
   of steps within 2 samples per source;
2. phase-switch lag in steps for pool sizes 0 / 1,000 / 10,000 (batch mode), with and without
   lag compensation: mean, min and max over several switches that land at different offsets of
   the pool's emission cycle;
3. sequence-length warmup: tokens per step during the warmup against the schedule's cap, and
   the overhead of the warmup stage (samples/s with vs without it, interleaved runs).

Usage:
    python tools/bench_schedule.py [--quick]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import numpy as np

from _bench_common import WATCHDOG, begin, check, finish, load_dependent, one_time

from energon_ordering import OrderingConfig
from energon_ordering.inspect.diagnostics import switch_lag
from energon_ordering.inspect.rank_simulation import (
    build_train_loader,
    close_loader,
    record_batch,
    run_ranks,
)
from energon_ordering.mixture.schedule import MixtureSchedule
from energon_ordering.warmup.schedule import SeqLenWarmup
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

BATCH = 4
SOURCES = ("web", "code", "curated")
LOW = {"web": 0.6, "code": 0.3, "curated": 0.1}
HIGH = {"web": 0.2, "code": 0.2, "curated": 0.6}


def _dataset(out: Path) -> Path:
    root = out / "three_sources"
    meta = root / "metadataset.yaml"
    if not meta.exists():
        click.echo(f"writing a 3-source dataset to {root} (energon prepare) ...", err=True)
        with one_time("writing the 3-source dataset"):
            make_synthetic_dataset(
                root,
                [SourceSpec("web", 4000, "short"), SourceSpec("code", 4000, "medium"),
                 SourceSpec("curated", 2000, "short")],
                shard_size=100,
            )
    return meta


def _run(meta: Path, cfg: OrderingConfig, steps: int) -> np.ndarray:
    """Per-step sample counts per source, shape [steps, 3]."""
    loader = build_train_loader(meta, ordering=cfg, batch_size=BATCH, **WATCHDOG)
    it = iter(loader)
    counts = np.zeros((steps, len(SOURCES)))
    for s in range(steps):
        for src in record_batch(next(it)).sources:
            counts[s, SOURCES.index(src)] += 1
    del it
    close_loader(loader)
    return counts


def bench_fidelity(meta: Path, samples: int, window: int) -> list[dict]:
    steps = samples // BATCH
    sched = MixtureSchedule.from_dict({
        "total_steps": steps,
        "phases": [
            {"until": 0.25, "weights": LOW},
            {"until": 0.5, "weights": {"web": 0.1, "code": 0.8, "curated": 0.1}},
            {"until": 1.0, "ramp_steps": steps // 4, "weights": HIGH},
        ],
    })
    target = sched.weights_table(np.arange(steps)) * BATCH
    rows = []
    for policy in ("deterministic", "random"):
        counts = _run(meta, OrderingConfig(mixture_schedule=sched, blend_policy=policy), steps)
        n = steps // window * window
        per_window = (counts[:n] - target[:n]).reshape(-1, window, len(SOURCES)).sum(axis=1)
        prefix = np.cumsum(counts - target, axis=0)
        p = target[:n] / BATCH
        sigma = np.sqrt((BATCH * p * (1 - p)).reshape(-1, window, len(SOURCES)).sum(axis=1))
        rows.append(dict(policy=policy, samples=int(counts.sum()), window_samples=window * BATCH,
                         max_window_dev=float(np.abs(per_window).max()),
                         max_prefix_dev=float(np.abs(prefix).max()),
                         binomial_sigma=float(sigma.mean())))
        click.echo(f"  fidelity {policy}: {rows[-1]}", err=True)
    return rows


def bench_ranks_per_step(meta: Path, ranks: int, micro_batches: int, steps: int,
                         num_workers: int) -> list[dict]:
    """Per optimizer step, summed over ``ranks`` real rank pipelines: realised - target."""
    sched = MixtureSchedule.from_dict({
        "total_steps": steps,
        "phases": [{"until": 0.5, "weights": LOW},
                   {"until": 1.0, "ramp_steps": steps // 4, "weights": HIGH}],
    })
    target = sched.weights_table(np.arange(steps)) * ranks * micro_batches * BATCH
    rows = []
    for policy in ("deterministic", "random"):
        cfg = OrderingConfig(mixture_schedule=sched, blend_policy=policy,
                             micro_batches_per_step=micro_batches)
        t0 = time.perf_counter()
        records = run_ranks(meta, ordering=cfg, world_size=ranks, steps=steps * micro_batches,
                            **WATCHDOG,
                            num_workers=num_workers, batch_size=BATCH)
        counts = np.zeros((steps, len(SOURCES)))
        for rank in records:
            for i, batch in enumerate(rank):
                for src in batch.sources:
                    counts[i // micro_batches, SOURCES.index(src)] += 1
        dev = np.abs(counts - target)
        rows.append(dict(policy=policy, ranks=ranks, steps=steps,
                         global_batch=ranks * micro_batches * BATCH,
                         max_step_dev=float(dev.max()),
                         steps_within_2=float((dev.max(axis=1) <= 2).mean()),
                         seconds=time.perf_counter() - t0))
        click.echo(f"  per step over {ranks} ranks, {policy}: {rows[-1]}", err=True)
    return rows


def bench_lag(meta: Path, pool: int, compensate: bool, switches: int) -> dict:
    cycle = max(1, pool // BATCH)  # batches per pool
    # golden-ratio offset: successive switches land at well-spread offsets of the pool's cycle
    period = 3 * cycle + int(0.618 * cycle) + 37
    phases = [{"until": period * (k + 1), "weights": LOW if k % 2 == 0 else HIGH}
              for k in range(switches + 1)]
    sched = MixtureSchedule.from_dict({"phases": phases})
    cfg = OrderingConfig(mixture_schedule=sched, blend_policy="deterministic",
                         length_sort_pool_size=pool, length_sort_mode="batch",
                         schedule_lag_compensation=compensate)
    steps = period * (switches + 1)
    t0 = time.perf_counter()
    counts = _run(meta, cfg, steps)
    share = counts[:, 2] / BATCH
    target = sched.weights_table(np.arange(steps))[:, 2]
    half = period // 2
    lags = [switch_lag(share[k * period - half: k * period + half],
                       target[k * period - half: k * period + half])
            for k in range(1, switches + 1)]
    row = dict(pool=pool, compensation=compensate, switches=switches,
               bound=pool / BATCH, mean=float(np.mean(lags)), min=float(np.min(lags)),
               max=float(np.max(lags)), seconds=time.perf_counter() - t0)
    click.echo(f"  lag pool={pool} compensation={compensate}: mean {row['mean']:.1f} "
               f"[{row['min']:.1f}, {row['max']:.1f}]", err=True)
    return row


def _warmup_run(meta: Path, warmup: SeqLenWarmup | None, steps: int
                ) -> tuple[np.ndarray, float, float]:
    """Tokens per step, and samples/s in wall and in CPU time (in-process loader: this
    process's CPU time is the pipeline's)."""
    cfg = OrderingConfig(seq_length_warmup=warmup, length_sort_pool_size=256,
                         length_sort_mode="batch")
    loader = build_train_loader(meta, ordering=cfg, batch_size=BATCH, **WATCHDOG)
    it = iter(loader)
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = [sum(record_batch(next(it)).lengths) for _ in range(steps)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    del it
    close_loader(loader)
    return np.array(tokens), steps * BATCH / wall, steps * BATCH / cpu


def bench_warmup(meta: Path, steps: int, repeats: int) -> dict:
    warmup = SeqLenWarmup(start=128, full=4096, warmup_steps=steps)
    on_rates, off_rates, on_cpu, off_cpu = [], [], [], []
    for _ in range(repeats):
        tok_on, r_on, c_on = _warmup_run(meta, warmup, steps)
        tok_off, r_off, c_off = _warmup_run(meta, None, steps)
        on_rates.append(r_on)
        off_rates.append(r_off)
        on_cpu.append(c_on)
        off_cpu.append(c_off)
    buckets = []
    size = max(1, steps // 8)
    for lo in range(0, steps, size):
        cap = warmup.max_seq_len(lo + size - 1)
        buckets.append(dict(steps=f"{lo}-{lo + size - 1}", cap_end=cap,
                            cap_tokens_per_step=BATCH * cap,
                            tokens_per_step=float(tok_on[lo:lo + size].mean()),
                            uncapped_tokens_per_step=float(tok_off[lo:lo + size].mean())))
    on, off = float(np.median(on_rates)), float(np.median(off_rates))
    cpu_on, cpu_off = float(np.median(on_cpu)), float(np.median(off_cpu))
    return dict(buckets=buckets, samples_per_s_on=on, samples_per_s_off=off, ratio=on / off,
                cpu_samples_per_s_on=cpu_on, cpu_samples_per_s_off=cpu_off,
                cpu_ratio=cpu_on / cpu_off,
                over_cap=int(sum(b["tokens_per_step"] > b["cap_tokens_per_step"]
                                 for b in buckets)))


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--out", default="bench_out", type=click.Path(file_okay=False),
              help="Folder for the dataset (reused between runs) and schedule_results.json.")
@click.option("--quick", is_flag=True, help="Pools 0 / 1,000 only, 8,000 samples for fidelity.")
def main(out: str, quick: bool) -> None:
    """Measure schedule fidelity and phase-switch lag."""
    start = begin()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = _dataset(out_dir)
    fidelity = bench_fidelity(meta, samples=8_000 if quick else 20_000, window=50)
    per_step = bench_ranks_per_step(meta, ranks=8, micro_batches=4, steps=16 if quick else 30,
                                    num_workers=2)
    lags = []
    for pool in ([0, 1_000] if quick else [0, 1_000, 10_000]):
        for compensate in ([False] if pool == 0 else [False, True]):
            lags.append(bench_lag(meta, pool, compensate, switches=4 if pool >= 10_000 else 8))

    click.echo("\n## Schedule fidelity (3 sources, 3 phases with a ramp, micro-batch 4)\n")
    click.echo("| policy | samples | window | max abs(realised - target) per window | per prefix | binomial sigma per window |")
    click.echo("|---|---:|---:|---:|---:|---:|")
    for r in fidelity:
        click.echo(f"| {r['policy']} | {r['samples']:,} | {r['window_samples']} samples | "
                   f"{r['max_window_dev']:.2f} | {r['max_prefix_dev']:.2f} | {r['binomial_sigma']:.2f} |")
    click.echo("\n## Per optimizer step across 8 ranks (micro-batch 4, 4 per step, 2 workers, no pool)\n")
    click.echo("| policy | steps | global batch | max abs(realised - target) per step | steps within 2 samples |")
    click.echo("|---|---:|---:|---:|---:|")
    for r in per_step:
        click.echo(f"| {r['policy']} | {r['steps']} | {r['global_batch']} | "
                   f"{r['max_step_dev']:.2f} | {100 * r['steps_within_2']:.0f}% |")
    click.echo("\n## Phase-switch lag in steps (deterministic policy, batch-mode pool)\n")
    click.echo("| pool | lag compensation | switches | bound pool/micro-batch | mean lag | min | max |")
    click.echo("|---:|---|---:|---:|---:|---:|---:|")
    for r in lags:
        comp = "-" if r["pool"] == 0 else ("on" if r["compensation"] else "off")
        click.echo(f"| {r['pool']:,} | {comp} | {r['switches']} | {r['bound']:.0f} | "
                   f"{r['mean']:.1f} | {r['min']:.1f} | {r['max']:.1f} |")
    warm = bench_warmup(meta, steps=200 if quick else 400, repeats=3)
    click.echo("\n## Sequence-length warmup 128 -> 4,096 tokens (micro-batch 4, one per step)\n")
    click.echo("| steps | cap at end | cap x batch | tokens/step (warmup) | tokens/step (no warmup) |")
    click.echo("|---|---:|---:|---:|---:|")
    for b in warm["buckets"]:
        click.echo(f"| {b['steps']} | {b['cap_end']:,} | {b['cap_tokens_per_step']:,} | "
                   f"{b['tokens_per_step']:,.0f} | {b['uncapped_tokens_per_step']:,.0f} |")
    click.echo("\n## Warmup stage overhead (one loader, in-process, samples/s with / without the "
               "warmup; CPU = this process's CPU time)\n")
    click.echo("| clock | with warmup | without | with / without |")
    click.echo("|---|---:|---:|---:|")
    click.echo(f"| CPU time | {warm['cpu_samples_per_s_on']:.0f} | "
               f"{warm['cpu_samples_per_s_off']:.0f} | {warm['cpu_ratio']:.3f} |")
    click.echo(f"| wall | {warm['samples_per_s_on']:.0f} | {warm['samples_per_s_off']:.0f} | "
               f"{warm['ratio']:.3f} |")
    click.echo(f"\n(dataset {meta})\n")
    deterministic = next(r for r in per_step if r["policy"] == "deterministic")
    check("deterministic policy, no pool: every optimizer step within one sample of its "
          "target per source", deterministic["max_step_dev"] < 1.0,
          f"worst step {deterministic['max_step_dev']:.2f} samples off")
    check("warmup: tokens per step at most the cap x micro-batch in every bucket",
          warm["over_cap"] == 0, f"{warm['over_cap']} buckets over")
    load_dependent("warmup stage overhead, samples/s with / without", warm["cpu_ratio"] >= 0.9,
                   f"CPU-time ratio {warm['cpu_ratio']:.3f}, wall {warm['ratio']:.3f} "
                   "(expected >= 0.9 in CPU time)")
    (out_dir / "schedule_results.json").write_text(
        json.dumps(dict(fidelity=fidelity, per_step=per_step, lag=lags, warmup=warm), indent=2))
    finish(start)


if __name__ == "__main__":
    main()
