"""``energon-ordering inspect``: on a prepared dataset, simulated ranks with the pool off and the
recipe's pool or planned order (and, for the demo, the planned order beside a pool), and their
lost compute (straggler idle per optimizer step + padding by tokens, beside idle per micro-batch
and the mean padding per micro-batch), mix and overlap diagnostics (``inspect.png``)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from energon_ordering.cli.index_encoder_note import index_encoder_note
from energon_ordering.cli.options import CONTEXT, resolve_task_encoder, with_task_encoder
from energon_ordering.cli.preflight import check_out_dir, preflight
from energon_ordering.cli.recipe import RECIPE, load_recipe
from energon_ordering.cli.tables import definitions, measure_table
from energon_ordering.cli.user_error import user_errors

if TYPE_CHECKING:
    from energon_ordering.config import OrderingConfig


def _progress(label: str) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """Wraps the steps of a run in a progress bar on stderr."""

    def wrap(it: Iterable[Any]) -> Iterator[Any]:
        items = list(it)
        with click.progressbar(items, label=label, file=sys.stderr) as bar:
            yield from bar

    return wrap


def _mix_note(cfg: OrderingConfig, results: dict[str, Any], window: int) -> str | None:
    """Why the mix is noisy per step with the pool on (None without a pool and a schedule)."""
    if not (cfg.length_sort_enabled and cfg.mixture_schedule is not None and len(results) > 1):
        return None
    off, on = (results[n].step_histogram_dispersion for n in (list(results)[0], list(results)[1]))
    return (f"Why the mix is noisy with the pool: the blend draws the scheduled mix "
            f"({cfg.blend_policy} policy), then the length pool reorders its output by length, "
            "and sources differ in length; so the mix is exact at the blend but noisy per step "
            f"(dispersion per step {on:.2f} with the pool, {off:.2f} without), and follows the "
            f"schedule on average over a pool's worth of steps ({window}).")


#: Settings a pool recipe's planned run replaces (the planned order has no pool), and the
#: planned order's own (a pool-off run of a planned recipe drops them).
_POOL_FIELDS = ("length_sort_pool_size", "length_sort_mode", "length_sort_placement",
                "length_sort_pool_holds", "length_sort_pool_ramp", "plan_window_steps",
                "planned_mix", "allow_global_batch_change")

#: Settings of a pool run the planned order refuses (it draws each step's exact counts: no
#: blend policy, no lag behind a pool).
_NOT_PLANNED = (*_POOL_FIELDS, "blend_policy", "schedule_lag_compensation")


def pool_off(cfg: OrderingConfig) -> OrderingConfig:
    """``cfg`` without a length pool or a plan: Energon's own order, the reference run."""
    from energon_ordering.config import OrderingConfig

    d = {k: v for k, v in cfg.to_dict().items() if k not in _POOL_FIELDS}
    return OrderingConfig.from_dict({**d, "length_sort_pool_size": 0})


def as_planned(cfg: OrderingConfig, mix: str | None = None) -> OrderingConfig:
    """``cfg`` in the planned global order (the settings it needs; the default window), with
    ``planned_mix = mix`` (None: the recipe's, else the default)."""
    from energon_ordering.config import PLANNED, OrderingConfig

    if cfg.planned:
        return cfg if mix is None else dataclasses.replace(cfg, planned_mix=mix)
    d = {k: v for k, v in cfg.to_dict().items() if k not in _NOT_PLANNED}
    return OrderingConfig.from_dict({**d, "length_sort_mode": PLANNED,
                                     "length_sort_placement": "pre-encode",
                                     "length_sort_pool_holds": "keys",
                                     **({} if mix is None else {"planned_mix": mix})})


def planned_name(cfg: OrderingConfig, ranks: int, batch_size: int,
                 window_steps: int | None = None) -> str:
    """A planned run's column name: the mode, its window (``window_steps``, None: the
    config's at ``ranks`` x micro-batches of ``batch_size``) and its mix granularity."""
    k = cfg.window_steps(ranks, batch_size) if window_steps is None else window_steps
    return f"planned (K={k}, {cfg.resolved_planned_mix})"


def planned_repeats(path: str, cfg: OrderingConfig, records: list[list[Any]], *,
                    ranks: int, batch_size: int, window_steps: int | None = None) -> int:
    """Samples a planned run drew more often than their source's epochs allow (must be 0).

    A planned source's next epoch is a new permutation dealt over all ranks, so once a source
    wraps its samples return, on any rank: "keys on two ranks" does not apply. Within one epoch
    each sample is drawn once; the run's windows draw at most ``integral of weight x G + 1``
    samples of a source (the carry keeps each source within one sample of it), so a sample may
    appear at most ``ceil(that / source size)`` times. ``window_steps``: the run's K (the
    build's, :func:`~energon_ordering.inspect.rank_simulation.planned_window_steps`); None: the
    config's for the global batch.
    """
    from collections import Counter

    import numpy as np

    from energon_ordering.inspect.advise import data_sizes

    sizes = data_sizes(path)
    names = [n for n, _, _ in sizes]
    k = cfg.window_steps(ranks, batch_size) if window_steps is None else window_steps
    m = cfg.micro_batches_per_step
    steps = min(len(r) for r in records) // m
    planned_steps = -(-steps // k) * k
    g = ranks * m * batch_size
    size = {n: c for n, c, _ in sizes}
    seen = Counter((s, key) for rank in records for b in rank
                   for key, s in zip(b.keys, b.sources or ("-",) * len(b.keys)))
    if any(b.pack_lengths for rank in records for b in rank):
        # packed: a step's sample count follows the lengths drawn; the run's own draws of
        # each source bound its epochs (its windows drew at most one step more of each)
        drawn = Counter(s for s, _ in seen.elements())
        allowed = {n: max(1, -(-(drawn.get(n, 0) + 1) // max(1, size[n]))) for n in names}
        return sum(1 for (s, _), c in seen.items() if c > allowed.get(s, 1))
    if cfg.mixture_schedule is not None:
        table = cfg.mixture_schedule.weights_table(np.arange(planned_steps))
        column = {s: table[:, j] for j, s in enumerate(cfg.mixture_schedule.sources)}
        drawn = {n: float(column[n].sum()) * g if n in column else 0.0 for n in names}
    else:
        w = np.array([1.0 if wt is None else float(wt) for _, _, wt in sizes])
        w = w / w.sum()
        drawn = {n: float(wj) * g * planned_steps for n, wj in zip(names, w)}
    allowed = {n: max(1, -(-int(np.floor(drawn[n] + 1)) // max(1, size[n]))) for n in names}
    return sum(1 for (s, _), c in seen.items() if c > allowed.get(s, 1))


def run_inspection(path: str, cfg: OrderingConfig, *, ranks: int, steps: int, num_workers: int,
                   batch_size: int, out: Path, task_encoder_factory: Any = None,
                   planned: bool = False, planned_mix: str | None = None,
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs ``ranks`` simulated ranks for ``steps`` micro-batches with the pool off and with the
    recipe's pool or planned order; with ``planned`` also the recipe in the planned order (the
    dataset needs a length index), at ``planned_mix`` (None: the recipe's); measures each run
    and writes ``out/inspect.png``.

    A planned run's "keys on two ranks" counts the samples drawn more often than their
    source's epochs allow instead (:func:`planned_repeats`; ``extra["planned"]`` names those
    runs).

    Returns:
        ``({run name: Measurement}, {"png", "period", "note", "window_steps", "packed",
        "planned", "planned_mix", "plan_window_steps"})``: ``planned`` names the planned
        runs, ``planned_mix`` maps each to its mix granularity, ``plan_window_steps`` to the
        steps of its plan windows (``window_steps`` is the mix plot's averaging window).
    """
    from energon_ordering.inspect.inspection import measure, shard_length
    from energon_ordering.inspect.plots import plot_run
    from energon_ordering.inspect.rank_simulation import planned_window_steps, run_ranks

    with user_errors():
        configs = {"pool off": pool_off(cfg)}
        if cfg.length_sort_enabled:
            configs[f"pool {cfg.length_sort_pool_size} ({cfg.length_sort_mode})"] = cfg
        plan_cfg = as_planned(cfg, planned_mix) if cfg.planned or planned else None
    preflight(path, ([plan_cfg] if plan_cfg else []) + list(configs.values())[::-1],
              batch_size=batch_size, num_workers=num_workers, world_size=ranks,
              task_encoder_factory=task_encoder_factory)
    if plan_cfg is not None:
        k = None
        if plan_cfg.plan_window_steps is None:
            with user_errors():  # the default reads the length index (sizes; packed, lengths)
                k = planned_window_steps(path, plan_cfg, world_size=ranks,
                                         batch_size=batch_size,
                                         task_encoder_factory=task_encoder_factory)
        k = plan_cfg.window_steps(ranks, batch_size) if k is None else k
        configs[planned_name(plan_cfg, ranks, batch_size, k)] = plan_cfg
    period = max(1, shard_length(path) // batch_size)
    mbps = cfg.micro_batches_per_step
    # The averaging window of the mix plot: one pool's worth of steps (10 without a pool).
    window = max(1, cfg.length_sort_pool_size // (batch_size * mbps)) if cfg.length_sort_enabled else 10
    records, results = {}, {}
    with user_errors():
        for name, c in configs.items():
            records[name] = run_ranks(
                path, ordering=c, world_size=ranks, steps=steps, num_workers=num_workers,
                batch_size=batch_size, task_encoder_factory=task_encoder_factory,
                progress=_progress(f"{name}: {ranks} ranks x {steps} micro-batches"))
            results[name] = measure(records[name], period, mbps, cfg.mixture_schedule)
            if c.planned:
                results[name] = dataclasses.replace(results[name], overlapping_keys=planned_repeats(
                    path, c, records[name], ranks=ranks, batch_size=batch_size, window_steps=k))
    out.mkdir(parents=True, exist_ok=True)
    note = _mix_note(cfg, results, window)
    png = plot_run(out / "inspect.png", runs=records, micro_batches_per_step=mbps,
                   schedule=cfg.mixture_schedule, warmup=cfg.seq_length_warmup,
                   window_steps=window, note=note, measurements=results)
    packed = any(r.docs_per_pack == r.docs_per_pack for r in results.values())
    mixes = {n: c.resolved_planned_mix for n, c in configs.items() if c.planned}
    return results, {"png": png, "period": period, "note": note, "window_steps": window,
                     "packed": packed, "planned": list(mixes), "planned_mix": mixes,
                     "plan_window_steps": {n: k for n in mixes}}


@click.command("inspect", context_settings=CONTEXT)
@click.argument("metadataset", type=click.Path(exists=True))
@click.option("--recipe", type=RECIPE, required=True, help="Recipe file, or a packaged recipe's name.")
@click.option("--ranks", type=click.IntRange(min=1), default=8, help="Simulated data-parallel ranks.")
@click.option("--steps", type=click.IntRange(min=1), default=200, help="Micro-batches per rank.")
@click.option("--num-workers", type=click.IntRange(min=0), default=0, help="Loader workers per rank.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, help="Micro-batch size.")
@click.option("--out", type=click.Path(file_okay=False), default=".", help="Folder for inspect.png.")
@with_task_encoder
def command(metadataset: str, recipe: str, ranks: int, steps: int, num_workers: int,
            batch_size: int, out: str, task_encoder: str | None, tokens_per_media: int) -> None:
    """On your prepared dataset: sync, padding, mix and overlap diagnostics, pool off vs the recipe's pool or planned order."""
    cfg = load_recipe(recipe)  # before torch and Energon are imported
    out_dir = check_out_dir(out, "inspect.png")
    factory = resolve_task_encoder(task_encoder, tokens_per_media)
    with index_encoder_note(metadataset, task_encoder):
        results, extra = run_inspection(metadataset, cfg, ranks=ranks, steps=steps,
                                        num_workers=num_workers, batch_size=batch_size,
                                        out=out_dir, task_encoder_factory=factory)
    click.echo(measure_table(results, extra["planned"]))
    click.echo("\n" + definitions(extra))
    if extra["note"]:
        click.echo("\n" + extra["note"])
    click.echo(f"\nwrote {extra['png']}")
