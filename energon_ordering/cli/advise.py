"""``energon-ordering advise``: predicted lost compute (idle per optimizer step + padding by
tokens, beside idle per micro-batch and the mean padding per micro-batch) and source mix of pool
settings and of the planned order at both mix granularities (``planned_mix: step`` and
``window``) at several rank counts, measured costs, and one recommended setting
(``advise.png``)."""

from __future__ import annotations

import click

from energon_ordering.cli.index_encoder_note import index_encoder_note
from energon_ordering.cli.options import CONTEXT, resolve_task_encoder, with_task_encoder
from energon_ordering.cli.preflight import check_dataset, check_length_index_choice, check_out_dir
from energon_ordering.cli.tables import advice_tables
from energon_ordering.cli.user_error import user_errors
from energon_ordering.errors import show

_SIZE_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
               "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def _parse_bytes(text: str) -> float:
    """``2GiB``, ``512MiB`` or ``64MB`` in bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise click.BadParameter(f"{show(text)}: expected a size like 2GiB, 512MiB or 64MB",
                                 param_hint="--memory-per-worker")
    return float(m.group(1)) * _SIZE_UNITS[unit]


@click.command("advise", context_settings=CONTEXT)
@click.argument("dataset", type=click.Path(exists=True))
@click.option("--ranks", type=click.IntRange(min=1), required=True, help="Data-parallel ranks of the run.")
@click.option("--micro-batch", type=click.IntRange(min=1), required=True, help="Micro-batch size, in samples.")
@click.option("--num-workers", type=click.IntRange(min=0), default=0, help="Loader workers per rank.")
@click.option("--memory-per-worker", default="2GiB", help="Memory a pool may hold per loader worker.")
@click.option("--micro-batches-per-step", type=click.IntRange(min=1), default=1,
              help="Micro-batches per rank per optimizer step (gradient accumulation).")
@click.option("--steps", type=click.IntRange(min=16), default=1000, help="Micro-batches simulated per rank.")
@click.option("--seed", type=int, default=0, help="Ordering seed.")
@click.option("--measure/--no-measure", default=True,
              help="Measure time to first batch and memory per loader worker on real loaders "
                   "(--measure), which choose the placement within --memory-per-worker; "
                   "--no-measure skips that (seconds instead of minutes on a large dataset) and "
                   "recommends from the predicted idle and padding alone, with the default "
                   "placement (post-encode), and says so.")
@click.option("--out", type=click.Path(file_okay=False), default=".", help="Folder for advise.png.")
@click.option("--length-index", default=None, metavar="NAME",
              help="Which length index to read where a dataset has several (the --name given "
                   "to `energon-ordering index`; OrderingConfig.length_index) [default: the "
                   "unnamed one, else the only one].")
@with_task_encoder
def command(dataset: str, ranks: int, micro_batch: int, num_workers: int, memory_per_worker: str,
            micro_batches_per_step: int, steps: int, seed: int, measure: bool, out: str,
            length_index: str | None, task_encoder: str | None, tokens_per_media: int) -> None:
    """Predicted idle, padding and mix of pools 1k..1M and the planned order (mix per step or per window) at 8..1,024 ranks; recommends the setting that loses the least compute."""
    from energon_ordering.inspect.advise import advise as run_advise
    from energon_ordering.inspect.advise import (
        planned_note,
        planned_requirements,
        plot_advice,
        source_mix_note,
    )

    budget = _parse_bytes(memory_per_worker)
    out_dir = check_out_dir(out, "advise.png")
    check_dataset(dataset, "DATASET")
    check_length_index_choice(dataset, length_index)
    factory = resolve_task_encoder(task_encoder, tokens_per_media)
    with user_errors(), index_encoder_note(dataset, task_encoder):
        adv = run_advise(dataset, ranks=ranks, batch_size=micro_batch, num_workers=num_workers,
                         memory_per_worker=budget, micro_batches_per_step=micro_batches_per_step,
                         steps=steps, seed=seed, task_encoder_factory=factory, measure=measure,
                         progress=lambda line: click.echo(f"... {line}", err=True),
                         **({} if length_index is None else {"length_index": length_index}))
    pop = adv.population
    click.echo(f"dataset: {adv.total_samples:,} samples; lengths: {pop.origin} ({len(pop.lengths):,} "
               f"drawn), mean {pop.lengths.mean():,.0f} tokens, sources {', '.join(pop.source_names)}")
    click.echo(advice_tables(adv))
    if adv.recommended is None:
        click.echo(f"\nrecommended: none ({adv.reason})")
    elif adv.recommended[2] == "planned":
        click.echo(f"\nrecommended: length_sort_mode: planned, planned_mix: {adv.planned.mix}, "
                   "length_sort_placement: pre-encode, length_sort_pool_holds: keys (no "
                   f"length_sort_pool_size)\n  ({adv.reason})\n  {planned_requirements()}")
    else:
        placement, holds, mode, size = adv.recommended
        click.echo(f"\nrecommended: length_sort_pool_size: {size}, length_sort_mode: {mode}, "
                   f"length_sort_placement: {placement}"
                   + (f", length_sort_pool_holds: {holds}" if placement == "pre-encode" else "")
                   + f"\n  ({adv.reason})")
    no_index = planned_note(adv)
    if no_index:
        click.echo(no_index)
    if adv.other_mode:
        click.echo(adv.other_mode)
    note = source_mix_note(adv)
    if note:
        click.echo(note)
    click.echo(f"wrote {plot_advice(out_dir / 'advise.png', adv)}")
