"""``energon-ordering plan``: before a run, a recipe's schedule at its boundaries, the implied
epochs per source, the warmup, packing and pool, and ``plan.png``. Needs no data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from energon_ordering.cli.options import CONTEXT
from energon_ordering.cli.preflight import check_dataset, check_out_dir, check_source_sizes
from energon_ordering.cli.recipe import RECIPE, load_recipe
from energon_ordering.cli.tables import epochs_rows, table
from energon_ordering.cli.user_error import UserError, user_errors
from energon_ordering.errors import show


def _parse_sizes(text: str) -> dict[str, int]:
    """``web=1000000,code=200000`` as ``{source: samples}``."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            sizes[name.strip()] = int(value)
        except ValueError:
            raise UserError(
                f"--source-sizes {show(part)}: expected NAME=SAMPLES, e.g. web=1000000,code=200000."
            ) from None
        if sizes[name.strip()] < 1:
            raise UserError(
                f"--source-sizes {show(part)}: a source's size is its number of samples, at least "
                f"1; give {name.strip()}=SAMPLES with SAMPLES >= 1.")
    if not sizes:
        raise UserError("--source-sizes: no sizes given; e.g. web=1000000,code=200000.")
    return sizes


def _parse_doc_tokens(text: str, sources: list[str]) -> dict[str, float]:
    """``--doc-tokens 900`` (every source) or ``web=600,code=1500`` as ``{source: tokens}``."""
    try:
        if "=" not in text:
            value = float(text)
            parsed = {s: value for s in sources}
        else:
            parsed = {n.strip(): float(v) for n, _, v in
                      (p.partition("=") for p in text.split(",") if p.strip())}
    except ValueError:
        raise UserError(f"--doc-tokens {show(text)}: expected TOKENS or NAME=TOKENS,..., e.g. "
                        "web=600,code=1500.") from None
    missing = [s for s in sources if s not in parsed]
    bad = {n: v for n, v in parsed.items() if not v >= 1}
    if missing or bad:
        raise UserError(f"--doc-tokens {show(text)}: give a mean of at least 1 token for every source "
                        f"of the schedule ({', '.join(sources)}); "
                        + (f"missing {missing}." if missing else f"not >= 1: {bad}."))
    return parsed


def _packed_epochs(cfg: Any, total_steps: int, packs_per_step: int, sizes: dict[str, int],
                   target: int, metadataset: str | None, doc_tokens: str | None,
                   warn_above: float) -> tuple[list[list[Any]], list[str], str]:
    """Rows ``source, samples, epochs, flag`` under packing, their warnings, and the line that
    says where the documents per pack come from."""
    import numpy as np

    from energon_ordering.mixture.packed_epochs import DEFAULT_PACK_FILL, packed_implied_epochs

    sched = cfg.mixture_schedule
    lengths: dict[str, Any] = {}
    basis = ""
    if doc_tokens is not None:
        lengths = {s: np.array([v]) for s, v in _parse_doc_tokens(doc_tokens, sched.sources).items()}
        basis = "an estimate from --doc-tokens (mean tokens per document)"
    elif metadataset is not None:
        from energon_ordering.inspect.inspection import source_lengths_from_indexes

        with user_errors():
            found, missing = source_lengths_from_indexes(
                metadataset, name=cfg.length_index, index_dir=cfg.length_index_dir)
        absent = [s for s in sched.sources if s not in found]
        if not absent:
            lengths = {s: np.asarray(found[s]) for s in sched.sources}
            basis = "the length indexes of --metadataset"
        else:
            basis = (f"no length index for {absent} (build them with `energon-ordering index "
                     f"{metadataset}`, or pass --doc-tokens)")
    else:
        basis = "no document lengths (pass --metadataset with length indexes, or --doc-tokens)"
    if not lengths:
        # No lengths: one document per pack, a lower bound on every source's epochs.
        lengths = {s: np.array([float(target)]) for s in sched.sources}
        basis += "; assumed 1 document per pack, so the epochs below are LOWER BOUNDS"
    warmup = cfg.seq_length_warmup
    epochs = packed_implied_epochs(sched, total_steps, packs_per_step, sizes, lengths,
                                   pack_seq_length=target,
                                   max_seq_len=warmup.max_seq_len if warmup else None)
    rows = [[name, f"{sizes[name]:,}", f"{e:.2f}", "!" if e > warn_above else ""]
            for name, e in epochs.items()]
    over = {n: round(e, 2) for n, e in epochs.items() if e > warn_above}
    warns = ([f"implied epochs above {warn_above} for {over}: these sources repeat often enough "
              "to risk memorisation; lower their weight or add data."] if over else [])
    line = (f"documents per pack: {epochs.docs_per_pack:.2f} on average over the run, from "
            f"{basis}; a pack holds {target:,} tokens (less under the warmup), filled to "
            f"{DEFAULT_PACK_FILL:.0%} (first-fit decreasing).")
    return rows, warns, line


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
@click.option("--global-batch-size", type=click.IntRange(min=1), required=True,
              help="Samples per optimizer step; with packing, packs per step (Megatron counts "
                   "packs).")
@click.option("--metadataset", type=click.Path(exists=True), default=None,
              help="Prepared metadataset to read the source sizes from.")
@click.option("--source-sizes", default=None, help="Samples per source, e.g. web=1000000,code=200000.")
@click.option("--doc-tokens", default=None,
              help="With packing: mean tokens per document, one number or per source "
                   "(web=600,code=1500), for documents per pack [default: from the length "
                   "indexes of --metadataset].")
@click.option("--warn-above", default=4.0, help="Flag sources repeated more than this many epochs.")
@click.option("--out", type=click.Path(file_okay=False), default=".", help="Folder for plan.png.")
def command(recipe: str, total_steps: int | None, global_batch_size: int, metadataset: str | None,
            source_sizes: str | None, doc_tokens: str | None, warn_above: float, out: str) -> None:
    """Before a run: the schedule at its boundaries, implied epochs, warmup, plan.png."""
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
        from energon_ordering.inspect.inspection import source_sizes_from_metadataset

        check_dataset(metadataset, "--metadataset", "RECIPE")
        with user_errors():
            sizes = source_sizes_from_metadataset(metadataset)
    elif source_sizes:
        sizes = _parse_sizes(source_sizes)
    w = cfg.seq_length_warmup
    packing = cfg.packing_buffer_size is not None or cfg.pack_seq_length is not None
    pack_target = cfg.pack_seq_length or (w.full if packing and w is not None else None)
    epochs, pack_line = None, None
    if sched is not None and sizes is not None:
        check_source_sizes(sched.sources, sizes, metadataset=metadataset)
        if pack_target:
            *epochs, pack_line = _packed_epochs(cfg, total_steps, global_batch_size, sizes,
                                                pack_target, metadataset, doc_tokens, warn_above)
        else:
            epochs = epochs_rows(cfg, total_steps, global_batch_size, sizes, warn_above)
    if doc_tokens is not None and not pack_target:
        raise UserError("--doc-tokens is for packing recipes (pack_seq_length); this recipe does "
                        "not pack, so its global batch counts documents: drop --doc-tokens.")
    check_out_dir(out, "plan.png")

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
            unit = "packs" if pack_line else "samples"
            click.echo(f"\nImplied epochs ({total_steps:,} steps x {global_batch_size:,} {unit})\n")
            if pack_line:
                click.echo(pack_line + "\n")
            click.echo(table(["source", "samples", "epochs", f"> {warn_above}"], rows))
            for warning in warns:
                click.echo(f"warning: {warning}")
        else:
            click.echo("\n(implied epochs: pass --metadataset or --source-sizes)")
    else:
        click.echo("No mixture schedule in this recipe (the metadataset weights apply).")
    if w is not None:
        click.echo(f"\nSequence-length warmup ({w.kind}, multiple of {w.multiple_of}, overflow "
                   f"{cfg.seq_length_overflow})\n")
        marks = sorted({0, w.warmup_steps // 4, w.warmup_steps // 2, 3 * w.warmup_steps // 4,
                        w.warmup_steps - 1, w.warmup_steps})
        click.echo(table(["step", "max_seq_len"], [[f"{m:,}", f"{w.max_seq_len(m):,}"] for m in marks]))
    else:
        click.echo("\nNo sequence-length warmup.")
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
    from energon_ordering.inspect.plots import plot_plan

    try:
        Path(out).mkdir(parents=True, exist_ok=True)  # as inspect and advise do
        png = plot_plan(Path(out) / "plan.png", total_steps=total_steps, schedule=sched, warmup=w,
                        name=name)
    except OSError as e:
        raise UserError(
            f"--out {out}: cannot write plan.png there ({e.strerror or e}); pass a writable folder."
        ) from e
    click.echo(f"\nwrote {png}")
