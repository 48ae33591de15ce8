"""``energon-ordering plan``: before a run, a recipe's schedule at its boundaries, the implied
epochs per source, the warmup, packing and pool, and ``plan.png``. Needs no data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from energon_ordering.cli.options import CONTEXT
from energon_ordering.cli.preflight import check_dataset, check_source_sizes
from energon_ordering.cli.recipe import RECIPE, load_recipe
from energon_ordering.cli.tables import epochs_rows, table
from energon_ordering.cli.user_error import UserError, user_errors


def _parse_sizes(text: str) -> dict[str, int]:
    """``web=1000000,code=200000`` as ``{source: samples}``."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            sizes[name.strip()] = int(value)
        except ValueError:
            raise UserError(
                f"--source-sizes {part!r}: expected NAME=SAMPLES, e.g. web=1000000,code=200000."
            ) from None
    if not sizes:
        raise UserError("--source-sizes: no sizes given; e.g. web=1000000,code=200000.")
    return sizes


def _schedule_marks(sched: Any, total_steps: int) -> list[tuple[int, str]]:
    """The steps at which the weights change, with what happens there: each phase boundary
    (last step before, first step after) and the last step of each ramp; each knot."""
    notes: dict[int, list[str]] = {0: ["start"]}

    def note(step: int, text: str) -> None:
        if 0 <= step < total_steps:
            notes.setdefault(step, []).append(text)

    if sched.phases is not None:
        for i, (prev, ph) in enumerate(zip(sched.phases, sched.phases[1:]), start=1):
            b = prev.end
            note(b - 1, f"last step of phase {i - 1}")
            if ph.ramp_steps:
                note(b, f"phase {i}: ramp of {ph.ramp_steps:,} steps starts")
                note(b + ph.ramp_steps - 1, f"ramp ends: phase {i} weights")
            else:
                note(b, f"phase {i} starts")
    else:
        for b in sched._breakpoints().tolist():
            if b > 0:
                note(b - 1, "before a knot")
                note(b, "knot")
    note(total_steps - 1, "last step")
    return [(m, "; ".join(notes[m])) for m in sorted(notes)]


@click.command("plan", context_settings=CONTEXT)
@click.argument("recipe", type=RECIPE)
@click.option("--total-steps", type=click.IntRange(min=1), default=None,
              help="Optimizer steps of the run; overrides the recipe's total_steps "
                   "[default: the recipe's total_steps].")
@click.option("--global-batch-size", type=click.IntRange(min=1), required=True, help="Samples per optimizer step.")
@click.option("--metadataset", type=click.Path(exists=True), default=None,
              help="Prepared metadataset to read the source sizes from.")
@click.option("--source-sizes", default=None, help="Samples per source, e.g. web=1000000,code=200000.")
@click.option("--warn-above", default=4.0, help="Flag sources repeated more than this many epochs.")
@click.option("--out", type=click.Path(file_okay=False), default=".", help="Folder for plan.png.")
def command(recipe: str, total_steps: int | None, global_batch_size: int, metadataset: str | None,
            source_sizes: str | None, warn_above: float, out: str) -> None:
    """Before a run: the schedule at its boundaries, implied epochs, warmup, plan.png."""
    from energon_ordering.inspect.inspection import source_sizes_from_metadataset
    from energon_ordering.inspect.plots import plot_plan

    # Everything is checked before anything is printed.
    if metadataset and source_sizes:
        raise UserError("give either --metadataset or --source-sizes, not both.")
    cfg = load_recipe(recipe, total_steps=total_steps)
    sched = cfg.mixture_schedule
    total_steps = total_steps or cfg.total_steps or (sched.total_steps if sched else None)
    if total_steps is None:
        raise UserError(f"the recipe {recipe} has no total_steps; add `total_steps: N` to it "
                        "or pass --total-steps N.")
    sizes = None
    if metadataset:
        check_dataset(metadataset, "--metadataset", "RECIPE")
        with user_errors():
            sizes = source_sizes_from_metadataset(metadataset)
    elif source_sizes:
        sizes = _parse_sizes(source_sizes)
    epochs = None
    if sched is not None and sizes is not None:
        check_source_sizes(sched.sources, sizes, metadataset=metadataset)
        epochs = epochs_rows(cfg, total_steps, global_batch_size, sizes, warn_above)
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"--out {out}: cannot write plan.png there ({e.strerror or e}); pass a writable folder."
        ) from e

    name = Path(recipe).name
    if sched is not None:
        click.echo(f"Mixture schedule of {name} ({len(sched.sources)} sources, fingerprint "
                   f"{sched.fingerprint})\n")
        marks = _schedule_marks(sched, total_steps)
        rows = [[f"{m:,}", *(f"{w:.3f}" for w in sched.weights(m).values()), text]
                for m, text in marks]
        click.echo(table(["step", *sched.sources, "note"], rows, left=("note",)))
        if epochs is not None:
            rows, warns = epochs
            click.echo(f"\nImplied epochs ({total_steps:,} steps x {global_batch_size:,} samples)\n")
            click.echo(table(["source", "samples", "epochs", f"> {warn_above}"], rows))
            for w in warns:
                click.echo(f"warning: {w}")
        else:
            click.echo("\n(implied epochs: pass --metadataset or --source-sizes)")
    else:
        click.echo("No mixture schedule in this recipe (the metadataset weights apply).")
    w = cfg.seq_length_warmup
    if w is not None:
        click.echo(f"\nSequence-length warmup ({w.kind}, multiple of {w.multiple_of}, overflow "
                   f"{cfg.seq_length_overflow})\n")
        marks = sorted({0, w.warmup_steps // 4, w.warmup_steps // 2, 3 * w.warmup_steps // 4,
                        w.warmup_steps - 1, w.warmup_steps})
        click.echo(table(["step", "max_seq_len"], [[f"{m:,}", f"{w.max_seq_len(m):,}"] for m in marks]))
    else:
        click.echo("\nNo sequence-length warmup.")
    packing = cfg.packing_buffer_size is not None or cfg.pack_seq_length is not None
    if packing:
        target = f"{cfg.pack_seq_length:,} tokens" if cfg.pack_seq_length else "the warmup cap"
        click.echo(f"\nSequence packing: buffer of {cfg.packing_buffer_size or '(get_train_dataset)'} "
                   f"samples, packs of {target}"
                   + (" (min(pack_seq_length, max_seq_len) of the step during the warmup)" if w else "")
                   + ", default packer first-fit decreasing.")
    if cfg.length_sort_enabled:
        if packing and cfg.pack_pool_placement == "packs":
            click.echo(f"\nLength pool: {cfg.length_sort_pool_size} packs per loader worker after "
                       f"packing, sorted by cost sum(L + L^2/4096), mode {cfg.length_sort_mode}.")
        else:
            click.echo(f"\nLength pool: {cfg.length_sort_pool_size} samples per loader worker"
                       + (", before packing" if packing else "") + f", mode {cfg.length_sort_mode}.")
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        png = plot_plan(Path(out) / "plan.png", total_steps=total_steps, schedule=sched, warmup=w,
                        name=name)
    except OSError as e:
        raise UserError(
            f"--out {out}: cannot write plan.png there ({e.strerror or e}); pass a writable folder."
        ) from e
    click.echo(f"\nwrote {png}")
