"""``energon-ordering check-resume``: a recipe's run uninterrupted against the same run cut,
saved with ``save_state_rank()`` and restored; exit code 1 at the first difference.

With ``--resume-ranks`` (planned recipes only) the run is restored onto another data-parallel
size, and the steps after the cut are compared by what the model sees: every optimizer step
the same samples, cut to the same token lengths (the warmup), in the same packs; only the rank
and micro-batch a sample lands on may change."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from energon_ordering.cli.index_encoder_note import index_encoder_note
from energon_ordering.cli.options import CONTEXT, resolve_task_encoder, with_task_encoder
from energon_ordering.cli.preflight import check_dataset, check_pool, missing_length_indexes
from energon_ordering.cli.recipe import RECIPE, load_recipe
from energon_ordering.cli.user_error import UserError, user_errors
from energon_ordering.errors import LengthIndexError

if TYPE_CHECKING:
    from energon_ordering.config import OrderingConfig

#: Micro-batches compared after the cut when ``--steps`` is not given (same-shape resume).
DEFAULT_AFTER_CUT = 50


def resume_line(path: str, cfg: OrderingConfig, *, cut: int, steps: int, num_workers: int,
                batch_size: int, task_encoder_factory: Any = None,
                ranks: int = 1) -> tuple[bool, str]:
    """Runs ``steps`` micro-batches uninterrupted and cut at ``cut`` then restored, on each of
    ``ranks`` ranks; whether they agree, and the line that says so (or names the first
    mismatch)."""
    from energon_ordering.inspect.inspection import check_resume

    for rank in range(ranks):
        with user_errors():
            res = check_resume(path, cfg, cut=cut, steps=steps, num_workers=num_workers,
                               batch_size=batch_size, rank=rank, world_size=ranks,
                               task_encoder_factory=task_encoder_factory)
        if res.mismatch is not None:
            where = f" of rank {rank} of {ranks}" if ranks > 1 else ""
            return False, (f"resume check FAILED: first mismatch at micro-batch {res.mismatch}"
                           f"{where} (cut at {cut}): expected {list(res.expected.keys)}, "
                           f"got {list(res.got.keys)}")
    on = f" on each of {ranks} ranks" if ranks > 1 else ""
    return True, (f"resume check: cut at micro-batch {cut}{on}, restored from save_state_rank(): "
                  f"the next {steps - cut} micro-batches are identical")


def elastic_shape(cfg: OrderingConfig, ranks: int, resume_ranks: int, cut: int,
                  steps: int | None, batch_size: int) -> tuple[int, int]:
    """``--cut`` and ``--steps`` (micro-batches per rank of the ``ranks``-rank run) as the
    optimizer steps an elastic check cuts at and runs to; a one-line :class:`UserError` for a
    recipe or shape that cannot resume elastically."""
    from energon_ordering.config import PLANNED
    from energon_ordering.planned.window import DEFAULT_WINDOW_STEPS

    if cfg.length_sort_mode != PLANNED:
        raise UserError(
            f"--resume-ranks {resume_ranks} needs a planned recipe, and the recipe has "
            f"length_sort_mode: {cfg.length_sort_mode} (only a planned state continues at "
            "another data-parallel size); set length_sort_mode: planned in the recipe, or drop "
            "--resume-ranks.")
    M = cfg.micro_batches_per_step
    total = ranks * M
    if total % resume_ranks:
        fits = ", ".join(str(d) for d in range(1, total + 1) if total % d == 0)
        raise UserError(
            f"--resume-ranks {resume_ranks}: the global batch of --ranks {ranks} x "
            f"micro_batches_per_step {M} = {total} micro-batches per step does not split over "
            f"{resume_ranks} ranks (an elastic resume keeps the global batch); use "
            f"--resume-ranks {fits}.")
    if cut % M:
        lower, upper = cut // M * M, (cut // M + 1) * M
        raise UserError(
            f"--cut {cut} lies inside optimizer step {cut // M} (micro_batches_per_step {M}), "
            f"and an elastic resume starts at a step boundary; use --cut {lower} or {upper}.")
    # every step after an elastic resume holds the same samples (contract 13), so the check
    # compares step by step; by default over two windows past the cut's, at most 64 steps
    K = cfg.window_steps(ranks, batch_size)
    span = min(K, DEFAULT_WINDOW_STEPS) * M  # micro-batches per rank
    if steps is None:
        steps = (cut // span + 2) * span
    elif steps % M:
        lower, upper = steps // M * M, (steps // M + 1) * M
        use = f"{lower} or {upper}" if lower > cut else f"{upper}"
        raise UserError(
            f"--steps {steps} ends inside optimizer step {steps // M} (micro_batches_per_step "
            f"{M}); the check compares whole optimizer steps: use --steps {use}.")
    if cut >= steps:
        raise click.BadParameter(f"cut {cut} must be below --steps {steps}", param_hint="--cut")
    return cut // M, steps // M


def elastic_line(path: str, cfg: OrderingConfig, *, cut: int, steps: int | None, ranks: int,
                 resume_ranks: int, num_workers: int, batch_size: int,
                 task_encoder_factory: Any = None) -> tuple[bool, str]:
    """The ``ranks``-rank run uninterrupted against the same run cut at micro-batch ``cut``
    and restored onto ``resume_ranks`` ranks; whether they agree, and the line that says so."""
    from energon_ordering.inspect.inspection import check_elastic_resume

    cut_step, end_step = elastic_shape(cfg, ranks, resume_ranks, cut, steps, batch_size)
    with user_errors():
        res = check_elastic_resume(path, cfg, cut_step=cut_step, end_step=end_step,
                                   world_size=ranks, resume_world_size=resume_ranks,
                                   num_workers=num_workers, batch_size=batch_size,
                                   task_encoder_factory=task_encoder_factory)
    cut_on = (f"cut at micro-batch {cut} = optimizer step {cut_step} on {ranks} ranks x "
              f"{res.micro_batches_per_step} micro-batches per step")
    onto = f"{resume_ranks} ranks x {res.resume_micro_batches_per_step}"
    if res.mismatch is not None:
        return False, f"resume check FAILED: {res.mismatch.reason} ({cut_on}, resumed onto {onto})"
    return True, (f"resume check: {cut_on}, restored from save_state_rank() onto {onto}: the "
                  f"next {end_step - cut_step} optimizer steps show the model the same "
                  f"{res.samples} samples, each step the same ones at the same token lengths in "
                  "the same packs")


@click.command("check-resume", context_settings=CONTEXT)
@click.argument("metadataset", type=click.Path(exists=True))
@click.option("--recipe", type=RECIPE, required=True, help="Recipe file, or a packaged recipe's name.")
@click.option("--cut", type=click.IntRange(min=0), required=True,
              help="Micro-batch (per rank) to cut at; with --resume-ranks it must start an "
                   "optimizer step (a multiple of the recipe's micro_batches_per_step).")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help=f"Micro-batches (per rank of --ranks) to compare in all [default: cut + "
                   f"{DEFAULT_AFTER_CUT}; with --resume-ranks, two plan windows (of at most "
                   "32 steps) past the cut's, and it must end an optimizer step].")
@click.option("--ranks", type=click.IntRange(min=1), default=1,
              help="Data-parallel size of the run that is cut (each rank is checked).")
@click.option("--resume-ranks", type=click.IntRange(min=1), default=None,
              help="Restore onto this many ranks instead (planned recipes only), with "
                   "micro_batches_per_step scaled to keep the global batch; rank r restores "
                   "rank r's state, ranks beyond --ranks rank 0's. Passes when every optimizer "
                   "step after the cut shows the model the same samples at the same token "
                   "lengths (the warmup's cuts) in the same packs (which rank and micro-batch a "
                   "sample lands on is re-dealt); else names the first step, rank and "
                   "micro-batch that differ, and how.")
@click.option("--num-workers", type=click.IntRange(min=0), default=0, help="Loader workers.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, help="Micro-batch size.")
@with_task_encoder
def command(metadataset: str, recipe: str, cut: int, steps: int | None, ranks: int,
            resume_ranks: int | None, num_workers: int, batch_size: int,
            task_encoder: str | None, tokens_per_media: int) -> None:
    """Run uninterrupted and cut-then-restored; exit 1 at the first difference."""
    if resume_ranks is None:
        steps = cut + DEFAULT_AFTER_CUT if steps is None else steps
        if cut >= steps:
            raise click.BadParameter(f"cut {cut} must be below --steps {steps}", param_hint="--cut")
    cfg = load_recipe(recipe)  # before torch and Energon are imported
    check_pool(cfg, batch_size)
    check_dataset(metadataset, "METADATASET", "--recipe")
    factory = resolve_task_encoder(task_encoder, tokens_per_media)
    try:
        with index_encoder_note(metadataset, task_encoder):
            if resume_ranks is None:
                ok, line = resume_line(metadataset, cfg, cut=cut, steps=steps,
                                       num_workers=num_workers, batch_size=batch_size,
                                       task_encoder_factory=factory, ranks=ranks)
            else:
                ok, line = elastic_line(metadataset, cfg, cut=cut, steps=steps, ranks=ranks,
                                        resume_ranks=resume_ranks, num_workers=num_workers,
                                        batch_size=batch_size, task_encoder_factory=factory)
    except UserError as e:  # the first dataset without a length index: name every one
        if isinstance(e.__cause__, LengthIndexError):
            missing_length_indexes(metadataset, cfg, e.__cause__)
        raise
    click.echo(line)
    if not ok:
        sys.exit(1)
