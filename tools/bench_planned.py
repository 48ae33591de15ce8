#!/usr/bin/env python
"""The planned order beside the batch pools, the global sort and the free-dealing bound, at the
length level, every figure measured in this run (issue 32).

The planned order is a function of lengths only, so no pipeline is needed: each window's plan
(:func:`~energon_ordering.planned.window.plan_window`, with packing
:func:`~energon_ordering.planned.packs.plan_packed_window`) is computed exactly as every rank
computes it, and measured with :mod:`energon_ordering.inspect.lost_compute`.

Mixes (``--samples`` per mix, 8 million: no source is drawn beyond its size in any default
window measured here; with 2 million, as before 7 December 2026, the 1,024-rank windows drew
a source up to 2.9 times, and now, as the pipeline does on repeating data, hold fewer steps:
:func:`window_steps_for`):

- ``trimodal``: one source, 50% ~300, 35% ~1,200, 15% ~4,000 tokens (the package's benchmark
  mix, :data:`~energon_ordering.inspect.synthetic.LENGTH_PROFILES`);
- ``demo``: the demo's four sources (caption trimodal, vqa short, ocr medium, curated trimodal,
  each text plus 64 image tokens; equal blend weights, as the demo's metadataset);
- ``heavy``: two sources 0.7 / 0.3, one lognormal-tailed (10% around 6,000 tokens, the rest
  around 500), the other 3x longer.

Shapes: R in {2, 8, 64, 1,024} ranks and, plan only, 16,384; M in {1, 2, 8} micro-batches per
step; padded micro-batches of B = 4 samples, or packed (one pack of ``--cap`` tokens per
micro-batch, samples cut to the cap). Rows:

- ``planned step`` / ``planned window``: ``planned_mix`` ``"step"`` (every step within one
  sample per source) and ``"window"`` (every plan window within one);
- ``batch <pool>``: per-rank ``batch`` pools of 10k and 100k samples, or the largest the package
  accepts at the shape (a loader worker's share of ``--dataset-samples`` over R x 2 workers,
  :func:`~energon_ordering.inspect.advise.worker_share`), predicted by ``advise``'s model
  (:func:`~energon_ordering.inspect.advise.predict_order`); padded only;
- ``own packs``: packed without the plan, every rank first-fit packing its own draws (R <= 64);
- ``global sort``: the planned step run's samples sorted globally, dealt micro-batch index by
  micro-batch index (padded only; the limit of a per-micro-batch sort);
- ``bound step`` / ``bound window``: the free-dealing bound of the planned runs' own steps
  (each step's samples dealt longest first to the least-loaded rank, no micro-batch structure;
  :func:`~energon_ordering.inspect.lost_compute.free_dealing_bound`): idle per step only;
- ``held packs step`` / ``held packs window`` (packed): what no dealing of the planned runs' own
  packs can beat, each step's costliest pack beside M - 1 of its cheapest
  (:func:`~energon_ordering.inspect.lost_compute.held_packs_bound`); the targets are checked
  against the free-dealing bound, this row says how much of the gap the packs themselves set.

Columns: idle per micro-batch and per optimizer step, padding by tokens, lost compute (idle per
step + padding by tokens), the worst step's and the worst window's deviation from the blend
weights (samples), planning CPU (ms per step, ms per step per 1,000 ranks, share of one core at
a 1 s step: a node plans once for its ranks), the plan's peak memory (tracemalloc, R >= 64),
and the targets each planned row meets. Checks of CPU time depend on the machine's load: they
report, and the run never fails on them. The loader worker's share of planning on real
pipelines, and memory at index sizes 10^6-10^8, are ``tools/bench_planned_scale.py``'s.

Usage:
    python tools/bench_planned.py --quick     # 8 and 1,024 ranks, M 2 and 8 (3.5 min of CPU)
    python tools/bench_planned.py             # every shape, 16,384 ranks plan only
    python tools/bench_planned.py --only packed --ranks 8,64
    python tools/bench_planned.py --ranks '' --plan-only-ranks 16384   # 16,384 ranks alone
"""

from __future__ import annotations

import shlex
import sys
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass

import click
import numpy as np

from _bench_common import machine_speed
from energon_ordering.cli.tables import table
from energon_ordering.inspect.advise import LengthPopulation, predict_order, worker_share
from energon_ordering.inspect.lost_compute import (
    free_dealing_bound,
    held_packs_bound,
    idle_per_micro_batch,
    idle_per_step,
    micro_batch_costs,
    pack_padding_by_tokens,
    padding_by_tokens,
)
from energon_ordering.inspect.synthetic import LENGTH_PROFILES, sample_lengths
from energon_ordering.planned.balance import sample_cost
from energon_ordering.planned.cursor import PlanCursor
from energon_ordering.planned.packs import plan_packed_window
from energon_ordering.planned.window import plan_window, window_weights
from energon_ordering.planned.window_size import (WINDOW_MIX_SAMPLES, default_window_steps,
                                                  packed_samples_per_pack, steps_within_an_epoch)

BATCH = 4
RANKS = (2, 8, 64, 1024)
PLAN_ONLY_RANKS = (16384,)
MICRO_BATCHES = (1, 2, 8)
POOLS = (10_000, 100_000)
WORKERS = 2  # loader workers per rank, for the pools the package accepts
#: A window holds at most this many samples at the plan-only shapes (K shrinks with R M B),
#: unless ``--plan-only-window-samples`` says: the window mix's default window.
PLAN_ONLY_WINDOW_SAMPLES = WINDOW_MIX_SAMPLES

# issue 32's targets
TARGET_BOUND_RATIO, TARGET_BOUND_POINTS = 1.2, 0.001
TARGET_PADDING = 0.02
TARGET_MS_PER_1K_RANKS = 2.0
TARGET_SHARE = 0.05
TARGET_MIB = 64.0
OWN_PACKS_MAX_RANKS = 64


def heavy_tailed(n: int, seed: int) -> np.ndarray:
    """10% of samples around 6,000 tokens, the rest around 500 (lognormal)."""
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.1
    return np.where(long, rng.lognormal(np.log(6000), 0.3, n),
                    rng.lognormal(np.log(500), 0.6, n)).clip(16, 32768).astype(np.int64)


def mixes(n: int) -> dict[str, tuple[list[np.ndarray], list[float]]]:
    """name -> (lengths per source, blend weights)."""
    p = LENGTH_PROFILES
    demo = [64 + sample_lengths(p[name], n // 4, i)
            for i, name in enumerate(("trimodal", "short", "medium", "trimodal"))]
    return {
        "trimodal": ([sample_lengths(p["trimodal"], n, 0)], [1.0]),
        "demo": (demo, [0.25] * 4),
        "heavy": ([heavy_tailed(n // 2, 1), 3 * heavy_tailed(n // 2, 2)], [0.7, 0.3]),
    }


def population(lengths: list[np.ndarray], weights: list[float],
               n: int = 400_000) -> LengthPopulation:
    """The mix as ``advise`` models it: draws by blend weight, sorted by length."""
    rng = np.random.default_rng(0)
    counts = rng.multinomial(n, np.asarray(weights) / sum(weights))
    ls = np.concatenate([rng.choice(x, size=c) for x, c in zip(lengths, counts)])
    src = np.concatenate([np.full(c, s) for s, c in enumerate(counts)])
    order = np.argsort(ls, kind="stable")
    return LengthPopulation(ls[order].astype(np.float64), src[order],
                            tuple(f"s{s}" for s in range(len(lengths))), "bench_planned")


@dataclass
class Row:
    """One row of a table (nan: not measured for this order)."""

    order: str
    idle_mb: float = float("nan")
    idle_step: float = float("nan")
    padding: float = float("nan")
    step_dev: float = float("nan")
    window_dev: float = float("nan")
    cpu_per_step: float = float("nan")  # seconds
    peak_mib: float = float("nan")
    checks: str = ""

    @property
    def lost(self) -> float:
        return self.idle_step + self.padding


@dataclass
class Planned:
    """A planned run: micro-batch costs ``[steps, R, M]``, each step's sample costs, its
    padding by tokens, samples per step and source, and CPU seconds of planning."""

    costs: np.ndarray
    step_samples: list[np.ndarray]
    padding: float
    counts: np.ndarray
    cpu: float
    lengths: np.ndarray | None = None  # padded: [steps, R, M, B]


def _deviation(counts: np.ndarray, weights: Sequence[float], k: int) -> tuple[float, float]:
    """Worst step's and worst window's ``|count - weight x samples|`` (samples)."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    n = counts.sum(axis=1, keepdims=True)
    step = float(np.abs(counts - w * n).max())
    win = counts.reshape(-1, k, counts.shape[1]).sum(axis=1)
    return step, float(np.abs(win - w * win.sum(axis=1, keepdims=True)).max())


def _windows(weights, k: int, windows: int):
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    return [window_weights(w, i, k) for i in range(windows)]


def plan_padded(lengths, weights, R: int, M: int, k: int, windows: int, mix: str) -> Planned:
    """``windows`` windows of the padded plan."""
    flat = np.concatenate(lengths)
    offsets = np.cumsum([0] + [len(x) for x in lengths[:-1]])
    cursor, ids, cpu = PlanCursor.start(len(lengths)), [], 0.0
    for w in _windows(weights, k, windows):
        t0 = time.process_time()
        plan = plan_window(lengths, seed=0, cursor=cursor, weights=w, window_steps=k,
                           world_size=R, micro_batch=BATCH, micro_batches_per_step=M, mix=mix)
        cpu += time.process_time() - t0
        cursor = plan.next_cursor
        ids.append(plan.ids)
    gid = np.concatenate(ids)  # [steps, R, M, B]
    L = flat[gid].astype(np.float64)
    src = np.searchsorted(offsets, gid, side="right") - 1
    counts = np.stack([np.bincount(s.ravel(), minlength=len(lengths)) for s in src])
    return Planned(micro_batch_costs(L), list(sample_cost(L).reshape(len(L), -1)),
                   padding_by_tokens(L), counts, cpu, L)


def plan_packed(lengths, weights, R: int, M: int, k: int, windows: int, mix: str,
                cap: int) -> Planned:
    """``windows`` windows of the packed plan (one pack per micro-batch)."""
    flat = np.minimum(np.concatenate(lengths), cap).astype(np.float64)
    cursor, cpu = PlanCursor.start(len(lengths)), 0.0
    costs, steps, used, counts = [], [], [], []
    for w in _windows(weights, k, windows):
        t0 = time.process_time()
        plan = plan_packed_window(lengths, seed=0, cursor=cursor, weights=w, caps=[cap] * k,
                                  world_size=R, micro_batch=1, micro_batches_per_step=M,
                                  mix=mix)
        cpu += time.process_time() - t0
        cursor = plan.next_cursor
        L = flat[plan.ids]
        sizes = np.diff(plan.offsets)
        pack = np.repeat(np.arange(len(sizes)), sizes)
        c = sample_cost(L)
        costs.append(np.bincount(pack, weights=c, minlength=len(sizes)).reshape(-1, R, M))
        used.append(np.bincount(pack, weights=L, minlength=len(sizes)))
        per_step = R * M
        step_of = pack // per_step
        steps += [c[step_of == t] for t in range(plan.steps)]
        counts.append(plan.counts)
    used_all = np.concatenate(used)
    return Planned(np.concatenate(costs), steps, pack_padding_by_tokens(used_all, cap),
                   np.concatenate(counts), cpu)


def own_packs(lengths, weights, R: int, M: int, steps: int, cap: int) -> Planned:
    """Packing without the plan: every rank first-fit packs its own draws of the mix into its
    M packs of a step, in draw order; the first draw that fits none closes the step."""
    rng = np.random.default_rng(1)
    p = np.asarray(weights, dtype=np.float64) / sum(weights)
    costs = np.zeros((steps, R, M))
    used = np.zeros((steps, R, M))
    counts = np.zeros((steps, len(lengths)), dtype=np.int64)
    samples: list[list[float]] = [[] for _ in range(steps)]
    for r in range(R):
        pending = None
        for t in range(steps):
            while True:
                if pending is None:
                    s = int(rng.choice(len(p), p=p))
                    pending = (s, float(min(lengths[s][rng.integers(len(lengths[s]))], cap)))
                s, L = pending
                fits = np.flatnonzero(used[t, r] + L <= cap)
                if not len(fits):
                    break
                m = fits[0]
                used[t, r, m] += L
                c = float(sample_cost(np.array([L]))[0])
                costs[t, r, m] += c
                samples[t].append(c)
                counts[t, s] += 1
                pending = None
    return Planned(costs, [np.array(x) for x in samples],
                   pack_padding_by_tokens(used.ravel(), cap), counts, 0.0)


def peak_mib(plan) -> float:
    """Peak MiB one window's plan allocates (tracemalloc: numpy reports its buffers)."""
    tracemalloc.start()
    try:
        plan()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def bound_of(run: Planned, R: int) -> float:
    """The free-dealing bound of the run's own steps."""
    width = max(len(x) for x in run.step_samples)
    padded = np.zeros((len(run.step_samples), width))
    for t, x in enumerate(run.step_samples):
        padded[t, : len(x)] = x
    return free_dealing_bound(padded, R)


def global_sort(L: np.ndarray) -> np.ndarray:
    """The samples sorted globally and dealt micro-batch index by micro-batch index."""
    steps, R, m, b = L.shape
    return np.sort(L.ravel()).reshape(steps, m, R, b).transpose(0, 2, 1, 3)


def _ok(cond: bool) -> str:
    return "ok" if cond else "MISS"


def planned_row(name: str, run: Planned, weights, R: int, M: int, k: int, bound: float,
                best_pool_lost: float | None, peak: float, mix: str) -> Row:
    steps = len(run.costs)
    step_dev, window_dev = _deviation(run.counts, weights, k)
    row = Row(name, idle_per_micro_batch(run.costs), idle_per_step(run.costs), run.padding,
              step_dev, window_dev, run.cpu / steps, peak)
    checks = []
    if mix == "step" and M >= 2:
        limit = max(TARGET_BOUND_RATIO * bound, bound + TARGET_BOUND_POINTS)
        checks.append(f"idle/bound {_ok(row.idle_step <= limit)}")
    checks.append(f"pad {_ok(row.padding <= TARGET_PADDING)}")
    checks.append(f"mix {_ok((step_dev if mix == 'step' else window_dev) < 1.0)}")
    if best_pool_lost is not None:
        ratio = 0.5 if R >= 64 else 1.0
        checks.append(f"lost {_ok(row.lost <= ratio * best_pool_lost)}")
    ms = 1e3 * row.cpu_per_step / (R / 1000)
    if R >= 1024:  # CPU per 1,000 ranks is meant at scale (small R pays fixed overheads)
        checks.append(f"cpu {_ok(ms <= TARGET_MS_PER_1K_RANKS)}*")
    if peak == peak:
        checks.append(f"mem {_ok(peak <= TARGET_MIB)}")
    row.checks = ", ".join(checks)
    return row


def _fmt(row: Row, R: int) -> list[str]:
    def pct(x: float) -> str:
        return "-" if x != x else f"{100 * x:.2f}%"

    def num(x: float, f: str) -> str:
        return "-" if x != x else format(x, f)

    cpu = row.cpu_per_step
    return [row.order, pct(row.idle_mb), pct(row.idle_step), pct(row.padding), pct(row.lost),
            num(row.step_dev, ".2f"), num(row.window_dev, ".2f"),
            num(1e3 * cpu, ".1f"), num(1e3 * cpu / (R / 1000), ".2f"), pct(cpu / 1.0),
            num(row.peak_mib, ".0f"), row.checks]


HEADERS = ["order", "idle/micro-batch", "idle/step", "padding (tokens)", "lost compute",
           "worst step dev", "worst window dev", "plan CPU ms/step", "ms/step/1k ranks",
           "share of 1 s step", "peak MiB", "targets"]


#: plan_window_steps of the run (``--window-steps``; None: each mix's default).
WINDOW_STEPS: list[int | None] = [None]
#: Most samples of a window at the plan-only shapes (``--plan-only-window-samples``).
PLAN_ONLY_SAMPLES: list[int] = [PLAN_ONLY_WINDOW_SAMPLES]


def window_steps_for(R: int, M: int, b: int, plan_only: bool, mix: str, packed: bool,
                     samples_per_pack: float | None = None,
                     lengths: list[np.ndarray] | None = None,
                     weights: list[float] | None = None) -> int:
    """K of ``mix`` at the shape: ``--window-steps``, else the package's default
    (:func:`~energon_ordering.planned.window_size.default_window_steps`; packed, with the
    mix's samples per pack as the pipeline reads them off the length index), at most the steps
    in which no source of ``lengths`` is drawn beyond its size, as the pipeline bounds it on
    repeating data (else the window's copies of a sample would share steps and flatter its
    padding); plan-only shapes shrink it to fit their window."""
    k = WINDOW_STEPS[0] or default_window_steps(mix, R * M * b, packed,
                                                samples_per_pack=samples_per_pack)
    if not WINDOW_STEPS[0] and lengths is not None:
        k = min(k, steps_within_an_epoch([len(x) for x in lengths], [weights],
                                         R * M * b * (samples_per_pack or 1.0)))
    if not plan_only:
        return k
    return int(max(1, min(k, PLAN_ONLY_SAMPLES[0] // (R * M * b))))


def padded_table(name, lengths, weights, pop, R, M, windows, dataset_samples,
                 plan_only: bool) -> tuple[list[Row], dict[str, int]]:
    ks = {mix: window_steps_for(R, M, BATCH, plan_only, mix, False, lengths=lengths,
                                weights=weights) for mix in ("step", "window")}
    k = ks["step"]
    rows: list[Row] = []
    pool_rows: list[Row] = []
    if not plan_only:
        share = worker_share([dataset_samples], R, WORKERS)
        for size in sorted({min(p, share) for p in POOLS}):
            if size < 1:
                continue
            p = predict_order(pop, mode="batch", pool_size=size, batch_size=BATCH, ranks=(R,),
                              step_ranks=R, num_workers=WORKERS, micro_batches_per_step=M,
                              steps=k * windows * M)
            worst_pp = max((w for _, w in p.step_share_pp.values()), default=0.0)
            label = f"batch {size // 1000}k" if size in POOLS else f"batch {size:,} (largest)"
            pool_rows.append(Row(label, p.idle[R], p.idle_step[R], p.padding_tokens,
                                 worst_pp / 100 * R * M * BATCH))
    best = min((r.lost for r in pool_rows), default=None)
    runs = {}
    for mix in ("step", "window"):
        km = ks[mix]
        run = plan_padded(lengths, weights, R, M, km, windows, mix)
        bound = bound_of(run, R)
        peak = (peak_mib(lambda: plan_window(
            lengths, seed=0, cursor=PlanCursor.start(len(lengths)),
            weights=_windows(weights, km, 1)[0], window_steps=km, world_size=R,
            micro_batch=BATCH, micro_batches_per_step=M, mix=mix)) if R >= 64 else float("nan"))
        rows.append(planned_row(f"planned {mix}", run, weights, R, M, km, bound, best, peak, mix))
        runs[mix] = (run, bound)
    rows += pool_rows
    g = global_sort(runs["step"][0].lengths)
    gc = micro_batch_costs(g)
    rows.append(Row("global sort", idle_per_micro_batch(gc), idle_per_step(gc),
                    padding_by_tokens(g)))
    for mix in ("step", "window"):
        rows.append(Row(f"bound {mix}", idle_step=runs[mix][1]))
    return rows, ks


def packed_table(name, lengths, weights, R, M, windows, cap,
                 plan_only: bool) -> tuple[list[Row], dict[str, int]]:
    spp = packed_samples_per_pack(lengths, [weights], cap)
    ks = {mix: window_steps_for(R, M, 1, plan_only, mix, True, spp, lengths=lengths,
                                weights=weights) for mix in ("step", "window")}
    k = ks["step"]
    rows: list[Row] = []
    base = None
    if R <= OWN_PACKS_MAX_RANKS and not plan_only:
        own = own_packs(lengths, weights, R, M, k * windows, cap)
        step_dev, window_dev = _deviation(own.counts, weights, k)
        base = Row("own packs", idle_per_micro_batch(own.costs), idle_per_step(own.costs),
                   own.padding, step_dev, window_dev)
    bounds, held = {}, {}
    for mix in ("step", "window"):
        km = ks[mix]
        run = plan_packed(lengths, weights, R, M, km, windows, mix, cap)
        bounds[mix] = bound_of(run, R)
        held[mix] = held_packs_bound(run.costs)
        peak = (peak_mib(lambda: plan_packed_window(
            lengths, seed=0, cursor=PlanCursor.start(len(lengths)),
            weights=_windows(weights, km, 1)[0], caps=[cap] * km, world_size=R, micro_batch=1,
            micro_batches_per_step=M, mix=mix)) if R >= 64 else float("nan"))
        rows.append(planned_row(f"planned {mix}", run, weights, R, M, km, bounds[mix],
                                None if base is None else base.lost, peak, mix))
    if base is not None:
        rows.append(base)
    for mix in ("step", "window"):
        rows.append(Row(f"bound {mix}", idle_step=bounds[mix]))
    for mix in ("step", "window"):
        rows.append(Row(f"held packs {mix}", idle_step=held[mix]))
    return rows, ks


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--quick", is_flag=True, help="8 and 1,024 ranks, M 2 and 8, one window each.")
@click.option("--ranks", default=None, help="Data-parallel sizes, or '' for none (default: "
              "2,8,64,1024; --quick: 8,1024).")
@click.option("--micro-batches", "micro_batches", default=None,
              help="Micro-batches per step (default: 1,2,8; --quick: 2,8).")
@click.option("--plan-only-ranks", default=None,
              help="Plan-only sizes (default: 16384; --quick: none).")
@click.option("--only", type=click.Choice(["padded", "packed", "both"]), default="both")
@click.option("--mixes", "mix_names", default="trimodal,demo,heavy", help="Mixes to run.")
@click.option("--windows", type=int, default=None,
              help="Plan windows per setting (default 2; --quick 1).")
@click.option("--window-steps", type=int, default=None,
              help="plan_window_steps K of both mixes (default: each mix's own: 32 for step, "
              "about 2^22 samples or 2^17 packs (at most 2^20 samples) for window; the "
              "plan-only shapes shrink it to fit their window).")
@click.option("--plan-only-window-samples", "plan_only_samples", type=int,
              default=PLAN_ONLY_WINDOW_SAMPLES, show_default=True,
              help="Most samples of a window at the plan-only shapes: K shrinks to fit (the "
              "window mix's default window; more sorts narrower bands for more memory).")
@click.option("--cap", type=int, default=8192, help="Tokens per pack (pack_seq_length).")
@click.option("--samples", type=int, default=8_000_000, help="Samples per mix.")
@click.option("--dataset-samples", type=int, default=10_000_000,
              help="Dataset size that bounds the pools the package accepts.")
def main(quick: bool, ranks: str | None, micro_batches: str | None,
         plan_only_ranks: str | None, only: str, mix_names: str, windows: int | None,
         window_steps: int | None, plan_only_samples: int, cap: int, samples: int,
         dataset_samples: int) -> None:
    """Planned step / window vs batch pools vs global sort vs the free-dealing bound."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    click.echo("$ " + shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]))
    if ranks is None:
        ranks = "8,1024" if quick else ",".join(map(str, RANKS))
    rs = [int(x) for x in ranks.split(",") if x]
    ms = [int(x) for x in (micro_batches or ("2,8" if quick else "1,2,8")).split(",") if x]
    plan_only = [int(x) for x in (plan_only_ranks if plan_only_ranks is not None else
                                  ("" if quick else ",".join(map(str, PLAN_ONLY_RANKS))))
                 .split(",") if x]
    windows = windows or (1 if quick else 2)
    WINDOW_STEPS[0] = window_steps
    PLAN_ONLY_SAMPLES[0] = plan_only_samples
    click.echo(f"micro-batch {BATCH} (padded) or one pack of {cap:,} tokens (packed); "
               f"plan_window_steps {window_steps or 'of each mix (step 32, window ~2^22 samples)'} "
               f"({plan_only_samples:,} samples "
               f"a window at most at the plan-only shapes); {windows} window(s) per setting; "
               f"pools: a loader worker's share of {dataset_samples:,} samples over R x "
               f"{WORKERS} workers at most")
    click.echo(f"targets: idle per step of planned step (M >= 2) <= {TARGET_BOUND_RATIO}x the "
               f"free-dealing bound or + {100 * TARGET_BOUND_POINTS:.1f} point; padding by "
               f"tokens <= {100 * TARGET_PADDING:.0f}%; mix: step within one sample per step, "
               f"window per window; lost compute <= the best accepted pool's (<= 1/2 at R >= "
               f"64; packed: against own packs); planning <= {TARGET_MS_PER_1K_RANKS:.0f} ms "
               f"CPU per step per 1,000 ranks (* depends on the machine's load: reported, never "
               f"failed) and <= {100 * TARGET_SHARE:.0f}% of a 1 s step; peak <= "
               f"{TARGET_MIB:.0f} MiB")
    click.echo(machine_speed() + "\n")
    every = mixes(samples)
    kinds = ["padded", "packed"] if only == "both" else [only]
    for name in mix_names.split(","):
        lengths, weights = every[name]
        pop = population(lengths, weights)
        click.echo(f"== {name}: " + ", ".join(
            f"source {s}: mean {x.mean():,.0f} tokens, weight {w}"
            for s, (x, w) in enumerate(zip(lengths, weights))))
        for kind in kinds:
            for R in [*rs, *plan_only]:
                for M in ms:
                    po = R in plan_only
                    if kind == "padded":
                        rows, ks = padded_table(name, lengths, weights, pop, R, M, windows,
                                                dataset_samples, po)
                    else:
                        rows, ks = packed_table(name, lengths, weights, R, M, windows, cap, po)
                    k = (f"K = {ks['step']}" if ks["step"] == ks["window"] else
                         f"K = {ks['step']} (step) / {ks['window']} (window)")
                    click.echo(f"{name}, {kind}, {R:,} ranks, M = {M}, {k}"
                               + (" (plan only)" if po else ""))
                    click.echo(table(HEADERS, [_fmt(r, R) for r in rows]) + "\n")
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    click.echo(f"took {wall:.0f} s wall, {cpu:.0f} s CPU")


if __name__ == "__main__":
    main()
