"""``energon-ordering index``: the length index of a prepared dataset (or of every dataset in a
metadataset), which the lean pool (``length_sort_placement: pre-encode``) sorts by."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable

import click

from energon_ordering.cli.options import (
    CONTEXT,
    import_function,
    resolve_task_encoder,
    with_task_encoder,
)
from energon_ordering.cli.preflight import check_dataset
from energon_ordering.cli.tables import index_table
from energon_ordering.cli.user_error import UserError, user_errors

#: Energon's image decoders (``SampleDecoder(image_decode=...)``).
IMAGE_DECODERS = ("l8", "rgb8", "rgba8", "l", "rgb", "rgba", "torchl8", "torchrgb8",
                  "torchrgba8", "torchl", "torchrgb", "torch", "torchrgba", "pill", "pil",
                  "pilrgb", "pilrgba")


@click.command("index", context_settings=CONTEXT)
@click.argument("dataset", type=click.Path(exists=True))
@with_task_encoder
@click.option("--raw-length-fn", default=None, metavar="MODULE:FUNCTION",
              help="Compute lengths from the raw files ({'txt': b'...', 'jpg': b'...'}) instead "
                   "of the task encoder; nothing is decoded.")
@click.option("--split-part", default="train", help="The split whose samples are indexed.")
@click.option("--workers", type=click.IntRange(min=1), default=1,
              help="Processes that decode and measure samples.")
@click.option("--name", "--length-index", "name", default=None, metavar="NAME",
              help="Name of the index (OrderingConfig.length_index; `advise --length-index`); "
                   "default: named after what computed the lengths, so indexes of several length "
                   "functions sit side by side.")
@click.option("--index-dir", default=None, type=click.Path(file_okay=False),
              help="Write the index to DIR/<index.uuid>/ instead of <dataset>/.nv-meta/ (for a "
                   "read-only dataset; set OrderingConfig.length_index_dir = DIR).")
@click.option("--skip-bad-samples", is_flag=True,
              help="Index a sample that fails to decode or measure with length 0 and count it, "
                   "instead of stopping at it.")
@click.option("--image-decode", default=None, metavar="DECODER",
              type=click.Choice(IMAGE_DECODERS),
              help="Decode images as get_train_dataset(image_decode=...) does in your loader "
                   "(Megatron-LM's examples/multimodal passes pil); default: the task "
                   "encoder's own decoder.")
@click.option("--verify", "verify", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --raw-length-fn: first run the task encoder on N random samples of each "
                   "dataset and compare; every mismatch is listed and the build stops (exit 2) "
                   "unless --allow-mismatch.")
@click.option("--megatron-args", default=None, metavar='"FLAGS"',
              help="The training flags, for a task encoder that reads Megatron-LM's arguments "
                   "when built (examples/multimodal's): parsed by Megatron's own parser first.")
@click.option("--allow-mismatch", is_flag=True,
              help="With --verify: list the mismatches and build the index anyway.")
@click.option("--no-reuse", is_flag=True,
              help="Measure every sample, also of the shards whose content is unchanged since "
                   "the index of the data before `energon prepare` ran again.")
# -- distributed builds (under torchrun or srun) --
@click.option("--rendezvous", default=None, metavar="HOST:PORT",
              help="Under srun: the rendezvous rank 0 hosts (HOST: the step's first node); "
                   "default MASTER_ADDR:MASTER_PORT. torchrun names its own.")
@click.option("--rendezvous-timeout", type=click.FloatRange(min=1), default=300.0,
              metavar="SECONDS", help="Seconds for every process to join the rendezvous.")
@click.option("--stall-timeout", type=click.FloatRange(min=1), default=1800.0,
              metavar="SECONDS",
              help="Fail when no process of a distributed build made progress for this long.")
def command(dataset: str, task_encoder: str | None, tokens_per_media: int,
            raw_length_fn: str | None, split_part: str, workers: int, name: str | None,
            index_dir: str | None, skip_bad_samples: bool, image_decode: str | None,
            verify: int | None, allow_mismatch: bool, no_reuse: bool, rendezvous: str | None,
            rendezvous_timeout: float, stall_timeout: float,
            megatron_args: str | None) -> None:
    """Build the length index of DATASET (a prepared folder or a metadataset: every dataset in
    it), for length_sort_placement = pre-encode. Written to <dataset>/.nv-meta/ (or --index-dir),
    tied to the dataset's index.uuid; run it again after `energon prepare` (shards whose content
    is unchanged keep their lengths). Under torchrun or srun every process measures a share of
    the shards and rank 0 writes the index."""
    from energon_ordering.length_index.index import check_index_name  # neither torch nor Energon
    from energon_ordering.length_index.launcher import launch_from_env

    with user_errors():
        check_index_name(name, "--name")
        launch = launch_from_env(os.environ, rendezvous)
    from energon_ordering.length_index.build import build_length_index
    check_dataset(dataset, "DATASET", open_train_split=False)  # the split is --split-part
    fn = import_function(raw_length_fn, "--raw-length-fn") if raw_length_fn else None
    if verify is not None and fn is None:
        raise UserError(f"--verify {verify} compares --raw-length-fn with the task encoder; "
                        "give --raw-length-fn MODULE:FUNCTION (and --task-encoder), or drop "
                        "--verify.")
    from energon_ordering.cli.heap import keep_large_buffers_on_heap
    from energon_ordering.integrations.megatron_encoder import build_task_encoder

    keep_large_buffers_on_heap()  # before the encoder's first buffers (cli/heap.py says why)

    with user_errors():
        encoder = build_task_encoder(resolve_task_encoder(task_encoder, tokens_per_media),
                                     megatron_args)
    if image_decode is not None:
        from megatron.energon import SampleDecoder

        encoder.decoder = SampleDecoder(image_decode=image_decode)
    # the task encoder measures unless a raw length function does (then it only verifies it)
    te = None if fn is not None and task_encoder is None else encoder
    if verify is not None:
        from energon_ordering.length_index.verify import verify_raw_length

        with user_errors():
            report = verify_raw_length(dataset, raw_length_fn=fn, task_encoder=encoder,
                                       samples=verify, split_part=split_part)
            for mismatch in report.mismatches:
                click.echo(str(mismatch), err=True)
            click.echo(f"verified {report.checked} samples: {len(report.mismatches)} "
                       "mismatch(es)", err=True)
            if not allow_mismatch:
                report.check(fn)
    with contextlib.ExitStack() as bars, user_errors():
        from energon_ordering.length_index.distributed import joined

        coord = bars.enter_context(joined(launch, rendezvous_timeout, stall_timeout))
        prefix = f"[rank {coord.rank}] " if coord.distributed else ""
        lines = itertools.count()  # each bar on its own line (rank 0: its own and all ranks')

        def progress(name: str, total: int) -> Callable[[int], None]:
            from tqdm import tqdm

            bar = bars.enter_context(tqdm(total=total, desc=f"indexing {name}", file=sys.stderr,
                                          unit="sample", position=next(lines),
                                          dynamic_ncols=True, mininterval=0.5))
            return bar.update

        def log(message: str) -> None:
            from tqdm import tqdm

            tqdm.write(f"{prefix}{message}", file=sys.stderr)  # above the bars, not over them

        built = build_length_index(dataset, task_encoder=te, raw_length_fn=fn,
                                   split_part=split_part, workers=workers, progress=progress,
                                   name=name, index_dir=index_dir,
                                   skip_bad_samples=skip_bad_samples, reuse=not no_reuse,
                                   log=log, coordinator=coord)
    if coord.rank != 0:
        return
    click.echo(index_table(built))
    for b in built:
        if b.measured < b.summary.samples:
            click.echo(f"{b.dataset}: measured {b.measured} of {b.summary.samples} samples; the "
                       "others kept their lengths (shards unchanged since the previous index)")
    for b in built:
        if b.skipped:
            click.echo(f"{b.dataset}: skipped {len(b.skipped)} sample(s) that failed to decode "
                       f"(indexed with length 0): {', '.join(b.skipped[:5])}"
                       f"{' ...' if len(b.skipped) > 5 else ''}")
