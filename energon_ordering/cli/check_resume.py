"""``energon-ordering check-resume``: a recipe's run uninterrupted against the same run cut,
saved with ``save_state_rank()`` and restored; exit code 1 at the first differing micro-batch."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from energon_ordering.cli.options import CONTEXT, resolve_task_encoder, with_task_encoder
from energon_ordering.cli.preflight import check_dataset, check_pool
from energon_ordering.cli.recipe import RECIPE, load_recipe
from energon_ordering.cli.user_error import user_errors

if TYPE_CHECKING:
    from energon_ordering.config import OrderingConfig


def resume_line(path: str, cfg: OrderingConfig, *, cut: int, steps: int, num_workers: int,
                batch_size: int, task_encoder_factory: Any = None) -> tuple[bool, str]:
    """Runs ``steps`` micro-batches uninterrupted and cut at ``cut`` then restored; whether they
    agree, and the line that says so (or names the first mismatch)."""
    from energon_ordering.inspect.inspection import check_resume

    with user_errors():
        res = check_resume(path, cfg, cut=cut, steps=steps, num_workers=num_workers,
                           batch_size=batch_size, task_encoder_factory=task_encoder_factory)
    if res.mismatch is None:
        return True, (f"resume check: cut at micro-batch {cut}, restored from save_state_rank(): "
                      f"the next {steps - cut} micro-batches are identical")
    return False, (f"resume check FAILED: first mismatch at micro-batch {res.mismatch} "
                   f"(cut at {cut}): expected {list(res.expected.keys)}, got {list(res.got.keys)}")


@click.command("check-resume", context_settings=CONTEXT)
@click.argument("metadataset", type=click.Path(exists=True))
@click.option("--recipe", type=RECIPE, required=True, help="Recipe file, or a packaged recipe's name.")
@click.option("--cut", type=click.IntRange(min=0), required=True, help="Micro-batch to cut at.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Micro-batches to compare in all [default: cut + 50].")
@click.option("--num-workers", type=click.IntRange(min=0), default=0, help="Loader workers.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, help="Micro-batch size.")
@with_task_encoder
def command(metadataset: str, recipe: str, cut: int, steps: int | None, num_workers: int,
            batch_size: int, task_encoder: str | None, tokens_per_media: int) -> None:
    """Run uninterrupted and cut-then-restored; exit 1 at the first differing micro-batch."""
    steps = cut + 50 if steps is None else steps
    if cut >= steps:
        raise click.BadParameter(f"cut {cut} must be below --steps {steps}", param_hint="--cut")
    check_dataset(metadataset, "METADATASET", "--recipe")
    cfg = load_recipe(recipe)
    check_pool(cfg, batch_size)
    ok, line = resume_line(metadataset, cfg, cut=cut, steps=steps,
                           num_workers=num_workers, batch_size=batch_size,
                           task_encoder_factory=resolve_task_encoder(task_encoder, tokens_per_media))
    click.echo(line)
    if not ok:
        sys.exit(1)
