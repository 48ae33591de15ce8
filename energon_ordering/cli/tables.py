"""Plain text tables the commands print, and the definitions printed under them."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from energon_ordering.cli.user_error import user_errors
from energon_ordering.pool.ramp import RAMP_MIN_POOL, RAMP_RULE, pool_size_at

if TYPE_CHECKING:
    from energon_ordering.config import OrderingConfig


def table(headers: list[str], rows: list[list[Any]], left: tuple[str, ...] = ()) -> str:
    """A plain text table: the first column and the ``left`` columns left-aligned."""
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lefts = {0} | {i for i, h in enumerate(headers) if h in left}
    line = lambda r: "  ".join(c.ljust(w) if i in lefts else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])])


def epochs_rows(cfg: OrderingConfig, total_steps: int, global_batch: int, sizes: dict[str, int],
                warn_above: float) -> tuple[list[list[Any]], list[str]]:
    """Rows ``source, samples, epochs, flag`` of the implied epochs, and the repetition warnings."""
    from energon_ordering.mixture.schedule import RepetitionWarning, implied_epochs

    assert cfg.mixture_schedule is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RepetitionWarning)
        with user_errors():
            epochs = implied_epochs(cfg.mixture_schedule, total_steps, global_batch, sizes,
                                    warn_above=warn_above)
    rows = [[name, f"{sizes[name]:,}", f"{e:.2f}", "!" if e > warn_above else ""]
            for name, e in epochs.items()]
    return rows, [str(w.message) for w in caught]


def _mix(value: float, sources: int = 2) -> str:
    """A source-mix figure, or ``-`` where there is no mix to measure (one source, or NaN)."""
    return "-" if sources < 2 or value != value else f"{value:.2f}"


def _pct(value: float) -> str:
    """A share in percent, or ``-`` where it was not measured (NaN)."""
    return "-" if value != value else f"{100 * value:.1f}%"


def measure_table(results: dict[str, Any], planned: Sequence[str] = ()) -> str:
    """The diagnostics of ``inspect`` and ``demo``, one column per run; the ``planned`` runs'
    overlap figure is starred (samples drawn more often than their source's epochs allow,
    :func:`energon_ordering.cli.inspect.planned_repeats`)."""
    names = list(results)
    rows = [
        ["lost compute (idle/step + padding/tokens)",
         *(_pct(results[n].lost_compute) for n in names)],
        ["straggler idle, per optimizer step", *(_pct(results[n].idle_per_step) for n in names)],
        ["straggler idle, per micro-batch", *(_pct(results[n].straggler_idle) for n in names)],
        ["padding waste, by tokens", *(_pct(results[n].padding_by_tokens) for n in names)],
        ["padding waste, mean per micro-batch",
         *(_pct(results[n].padding_waste) for n in names)],
        ["tokens per step", *(f"{results[n].tokens_per_step:,.0f}" for n in names)],
        ["source histogram dispersion (1 = iid)",
         *(_mix(results[n].histogram_dispersion, len(results[n].sources)) for n in names)],
        ["  per optimizer step (1 = iid)",
         *(_mix(results[n].step_histogram_dispersion, len(results[n].sources)) for n in names)],
        ["keys on two ranks (must be 0)", *(str(results[n].overlapping_keys)
                                             + ("*" if n in planned else "") for n in names)],
        ["sawtooth at shard period", *("yes" if results[n].sawtooth else "no" for n in names)],
    ]
    if any(results[n].docs_per_pack == results[n].docs_per_pack for n in names):
        rows.insert(6, ["documents per pack", *(f"{results[n].docs_per_pack:.2f}" for n in names)])
    return table(["", *names], rows)


def definitions(extra: dict[str, Any]) -> str:
    """One line per term of :func:`measure_table`, printed under it."""
    return "\n".join([
        "lost compute: the share of GPU time an order loses, straggler idle per optimizer step "
        "+ padding waste by tokens; lower is better.",
        "straggler idle: share of the time the ranks wait for the slowest (cost L + L^2/4096 "
        "per sample). per optimizer step: each rank's micro-batches of the step summed, as the "
        "ranks wait once a step at the gradient reduction (data parallelism pays this; "
        "inspect.png plots it); per micro-batch: the ranks wait at every micro-batch (expert "
        "parallelism pays this); equal with one micro-batch per step.",
        "padding waste: padding up to each micro-batch's longest sample (with packing: its "
        "longest pack). by tokens: padding tokens over all computed tokens, what the GPU "
        "computes in vain; mean per micro-batch: the mean of each micro-batch's share, which "
        "understates it when the long micro-batches hold most tokens.",
        "tokens per step: tokens of one micro-batch of every rank together, before padding.",
        *(["documents per pack: mean number of documents packed into one sequence; idle, "
           "tokens and the source mix count documents."] if extra.get("packed") else []),
        "source histogram dispersion: variance of each source's count per micro-batch (per "
        "step: all ranks' micro-batches of the step, against the schedule at that step) over "
        "that of independent draws; 1 = iid, below 1 more even, above 1 clumped by source "
        "(worse: the mix swings from batch to batch).",
        "keys on two ranks: samples drawn by more than one rank; anything but 0 means ranks "
        "train on the same data.",
        *([f"{name}: length_sort_mode: planned, planned_mix: {mix}, every rank computes the "
           "same plan of the global order from the length index (no pool); each "
           + ("optimizer step holds each source's scheduled share within one sample"
              if mix == "step" else
              "plan window holds each source's scheduled share within one sample and each of "
              "its steps one band of lengths, so a source's share swings from step to step "
              "within a window (dispersion per step above 1; a sawtooth flag then comes from "
              "the bands, not from shards)")
           + "; * its keys on two ranks counts samples drawn "
           "more often than their source's epochs allow (a source's next epoch is a new "
           "permutation dealt over all ranks, so its samples return on other ranks)."
           for name, mix in extra.get("planned_mix", {}).items()]),
        f"sawtooth at shard period: 'yes' if each source's share repeats every shard "
        f"({extra['period']} micro-batches) while batches are clumped by source (shards read in "
        "blocks: a sawtooth in the per-source loss); 'no' is good.",
    ])


def index_table(built: list[Any]) -> str:
    """The summary of ``index``, within 100 columns: datasets named relative to their common
    folder, and the index files' place said once."""
    import os

    if not built:
        return "no datasets indexed."
    paths = [Path(b.dataset) for b in built]
    parent = Path(os.path.commonpath([p.parent for p in paths]))
    rows = [[str(p.relative_to(parent)), f"{b.summary.samples:,}",
             f"{b.summary.total_tokens / max(1, b.summary.samples):,.1f}", f"{b.seconds:.1f}"]
            for p, b in zip(paths, built)]
    first = Path(built[0].summary.path)
    if first.is_relative_to(paths[0]):
        rel = first.relative_to(paths[0])
        where = f"each index is written to <dataset>/{rel.parent}/\n  as {rel.name}"
    else:
        where = "index files:\n" + "\n".join(f"  {b.summary.path}" for b in built)
    return "\n".join([
        table(["dataset", "samples", "mean length (tokens)", "seconds"], rows),
        f"\n{where}",
        f"datasets in {parent}",
    ])


def _mib(n: float) -> str:
    return "n/a" if n != n else f"{n / 2**20:,.1f} MiB"


def _planned_rows(adv: Any) -> list[Any]:
    """The planned order's predictions, one per mix granularity (older Advice: the one)."""
    return list(adv.planned_mixes) or ([adv.planned] if adv.planned is not None else [])


def advice_tables(adv: Any) -> str:
    """The predictions of ``advise`` per pool setting and the planned order at each mix
    granularity: lost compute, idle (per optimizer step and per micro-batch), padding (by
    tokens and mean per micro-batch) and mix at the requested ranks, whether the package
    accepts each pool at the requested ranks and workers; idle per optimizer step at every rank
    count; and the measured costs."""
    counts, r = adv.rank_counts, adv.ranks
    rows, by_ranks = [], []
    for p in adv.predictions:
        accepted = ("" if p.pool_size == 0 else "yes" if p.pool_size <= adv.share
                    else f"needs {adv.samples_needed(p.pool_size):,}")
        rows.append([p.name, *_lost_cells(p, r), _mix(p.dispersion_batch),
                     _mix(p.dispersion_step), accepted])
        by_ranks.append([p.name, *(_pct(p.idle_step[n]) for n in counts)])
    for planned in _planned_rows(adv):
        rows.append([planned.name, *_lost_cells(planned, r), _mix(planned.dispersion_batch),
                     _mix(planned.dispersion_step),
                     "yes (index)" if planned.has_index else "needs a length index"])
        by_ranks.append([planned.name, *(_pct(planned.idle_step[n]) for n in counts)])
    headers = ["order", f"lost {r}*", "idle/step", "idle/mb", "pad/tok", "pad/mb", "disp/mb",
               "disp/step", "accepted"]
    text = [f"at {r:,} ranks (requested), micro-batch {adv.batch_size}, "
            f"{adv.micro_batches_per_step} micro-batch(es) per step:",
            table(headers, rows, left=("accepted",)),
            "  lost = idle/step + pad/tok, shares of GPU time summed (the recommendation ranks "
            "by it); idle/step = straggler idle per optimizer step (ranks wait at the gradient "
            "reduction); idle/mb = per micro-batch (ranks wait at every micro-batch: expert "
            "parallelism); pad/tok = padding weighted by tokens; pad/mb = mean of each "
            "micro-batch's padding share; disp = source dispersion per micro-batch / per step.",
            "",
            "idle per optimizer step at each rank count (* requested):",
            table(["order", *(f"{n:,}" + ("*" if n == r else "") for n in counts)], by_ranks)]
    workers = max(1, adv.num_workers)
    text += [f"\naccepted: the package accepts a pool up to a loader worker's share of the data, "
            f"{adv.share:,} samples here ({adv.total_samples:,} samples / ({adv.ranks:,} ranks x "
            f"{workers} worker(s))); a larger pool needs the data size shown (pool x ranks x "
            "workers)."]
    for planned in _planned_rows(adv):
        text.append(_planned_lines(adv, planned))
    if adv.costs:
        sizes = sorted({p.pool_size for p in adv.predictions if p.pool_size})
        rows = []
        for c in adv.costs:
            label = f"{c.placement}/{c.holds}"
            if c.note:
                rows.append([label, *("n/a" for _ in sizes)])
                continue
            rows.append([label, *(f"{_mib(c.memory_bytes(n))}, {c.first_batch_seconds(n):,.1f} s"
                                  for n in sizes)])
        a, b = adv.costs[0].measured_pools
        text += ["", "memory per loader worker, time to first batch (first batch measured on real "
                 f"in-process loaders at pools {a:,} and {b:,}, fitted as start-up + per sample):",
                 table(["placement", *(f"{n:,}" for n in sizes)], rows)]
        ramped = [n for n in sizes if pool_size_at(0, n, ramp=n >= RAMP_MIN_POOL) < n]
        if ramped:
            text.append(
                f"  pools of {RAMP_MIN_POOL:,} or more ramp up ({RAMP_RULE}): their first batch "
                f"waits for the first pool only, {pool_size_at(0, ramped[0], ramp=True):,} "
                "samples (length_sort_pool_ramp = false: the whole pool)")
        for planned in _planned_rows(adv):
            text.append(_planned_cost(adv, planned))
        for c in adv.costs:
            if c.note:
                text.append(f"  {c.placement}/{c.holds}: {c.note}")
                continue
            fit = (f"  {c.placement}/{c.holds}: first batch = {c.startup_seconds:.2f} s + "
                   f"{1e3 * c.fill_seconds:.3f} ms x pool")
            if c.check_pool:
                fit += (f"; check at pool {c.check_pool:,}: predicted "
                        f"{c.fill_seconds_at(c.check_pool):.2f} s, measured "
                        f"{c.check_seconds:.2f} s ({c.check_ratio:.2f}x)")
            else:
                fit += "; no larger pool fits the data to check the fit at"
            text.append(fit)
    return "\n".join(text)


def _lost_cells(p: Any, ranks: int) -> list[str]:
    """Lost compute, idle per step and per micro-batch, padding by tokens and per micro-batch."""
    return [_pct(p.lost(ranks)), _pct(p.idle_step[ranks]), _pct(p.idle[ranks]),
            _pct(p.padding_tokens), _pct(p.padding)]


def _worst_pool_step(adv: Any, p: Any) -> float:
    """A pool's worst per-step deviation of a source's count, in samples (from its worst share
    deviation in percentage points, times the global batch)."""
    g = adv.ranks * adv.batch_size * adv.micro_batches_per_step
    return max((w for _, w in p.step_share_pp.values()), default=0.0) / 100 * g


def _planned_lines(adv: Any, planned: Any) -> str:
    """What a planned row means: the plan itself, computed from the lengths, and its mix in
    samples (per step, and per window with ``planned_mix: window``) beside the pools'."""
    r = adv.ranks
    held = ("every optimizer step" if planned.mix == "step" else
            "every plan window, its steps free to take one band of lengths each")
    lines = [
        f"{planned.name}: length_sort_mode: planned, planned_mix: {planned.mix} (the mix held in "
        f"{held}), windows of {planned.window_steps} steps; not modelled but planned from the "
        f"same lengths (plan_window, {planned.steps[r]:,} steps at {r:,} ranks); needs a length "
        "index for every dataset."]
    if planned.step_share_pp:
        pools = [p for p in adv.predictions if p.step_share_pp]
        accepted = [p for p in pools if 0 < p.pool_size <= adv.share]
        shown = [p for p in pools if p.pool_size == 0]
        shown += [min(accepted, key=lambda p: p.lost(r))] if accepted else []
        pool_text = ", ".join(f"{p.name}: {_worst_pool_step(adv, p):,.0f}" for p in shown)
        window = (f"; worst window: {planned.worst_window_samples[r]:.2f} from the sum of its "
                  "steps' (exact: below 1)" if planned.mix == "window" else "")
        lines.append(
            f"  worst step at {r:,} ranks: a source's count {planned.worst_step_samples[r]:.2f} "
            "samples from weight x global batch"
            + (" (exact: below 1)" if planned.mix == "step" else "") + window
            + (f"; the pools' ({pool_text} samples)" if pool_text else ""))
    return "\n".join(lines)


def _planned_cost(adv: Any, planned: Any) -> str:
    """The planned order's cost line under the pools' costs."""
    per_rank = ", ".join(f"{r:,}: {1e3 * planned.plan_seconds[r]:,.1f}"
                         for r in sorted(planned.plan_seconds))
    from energon_ordering.inspect.advise import PLANNED_BYTES_PER_SAMPLE

    lengths = PLANNED_BYTES_PER_SAMPLE * adv.total_samples
    return (f"  {planned.name}: no pool (no pool memory, no pool to fill before the first "
            f"batch); every rank plans each window: {per_rank} ms per step at that many ranks "
            f"(plan_window timed here); a loader worker holds the lengths, "
            f"{_mib(lengths)} ({adv.total_samples:,} samples x {PLANNED_BYTES_PER_SAMPLE} bytes)")
