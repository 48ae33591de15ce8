"""``energon-ordering inspect``: on a prepared dataset, simulated ranks with the pool off and on,
and their sync, padding, mix and overlap diagnostics (``inspect.png``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from energon_ordering.cli.options import CONTEXT, resolve_task_encoder, with_task_encoder
from energon_ordering.cli.preflight import preflight
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
    off, on = (results[n].step_histogram_dispersion for n in (list(results)[0], list(results)[-1]))
    return (f"Why the mix is noisy with the pool: the blend draws the scheduled mix "
            f"({cfg.blend_policy} policy), then the length pool reorders its output by length, "
            "and sources differ in length; so the mix is exact at the blend but noisy per step "
            f"(dispersion per step {on:.2f} with the pool, {off:.2f} without), and follows the "
            f"schedule on average over a pool's worth of steps ({window}).")


def run_inspection(path: str, cfg: OrderingConfig, *, ranks: int, steps: int, num_workers: int,
                   batch_size: int, out: Path, task_encoder_factory: Any = None,
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs ``ranks`` simulated ranks for ``steps`` micro-batches with the pool off and, if the
    recipe has one, on; measures each run and writes ``out/inspect.png``.

    Returns:
        ``({run name: Measurement}, {"png", "period", "note", "window_steps"})``.
    """
    from energon_ordering.config import OrderingConfig
    from energon_ordering.inspect.inspection import measure, shard_length
    from energon_ordering.inspect.plots import plot_run
    from energon_ordering.inspect.rank_simulation import run_ranks

    with user_errors():
        configs = {"pool off": OrderingConfig.from_dict({**cfg.to_dict(), "length_sort_pool_size": 0})}
    if cfg.length_sort_enabled:
        configs[f"pool {cfg.length_sort_pool_size} ({cfg.length_sort_mode})"] = cfg
    preflight(path, list(configs.values())[::-1], batch_size=batch_size, num_workers=num_workers,
              world_size=ranks, task_encoder_factory=task_encoder_factory)
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
    out.mkdir(parents=True, exist_ok=True)
    note = _mix_note(cfg, results, window)
    png = plot_run(out / "inspect.png", runs=records, micro_batches_per_step=mbps,
                   schedule=cfg.mixture_schedule, warmup=cfg.seq_length_warmup,
                   window_steps=window, note=note)
    packed = any(r.docs_per_pack == r.docs_per_pack for r in results.values())
    return results, {"png": png, "period": period, "note": note, "window_steps": window,
                     "packed": packed}


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
    """On your prepared dataset: sync, padding, mix and overlap diagnostics, pool off vs on."""
    cfg = load_recipe(recipe)
    factory = resolve_task_encoder(task_encoder, tokens_per_media)
    results, extra = run_inspection(metadataset, cfg, ranks=ranks, steps=steps,
                                    num_workers=num_workers, batch_size=batch_size,
                                    out=Path(out), task_encoder_factory=factory)
    click.echo(measure_table(results))
    click.echo("\n" + definitions(extra))
    if extra["note"]:
        click.echo("\n" + extra["note"])
    click.echo(f"\nwrote {extra['png']}")
