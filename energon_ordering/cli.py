"""The ``energon-ordering`` command: demo, plan, inspect, check-resume, index."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from energon_ordering import __version__
from energon_ordering.config import OrderingConfig
from energon_ordering.errors import OrderingError
from energon_ordering.mixture.schedule import RepetitionWarning, implied_epochs

CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}
REPO_RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Turns the package's typed errors into one clear line and exit code 1."""
    try:
        yield
    except OrderingError as e:
        raise click.ClickException(str(e)) from e


def _progress(label: str):
    def wrap(it):
        items = list(it)
        with click.progressbar(items, label=label, file=sys.stderr) as bar:
            yield from bar

    return wrap


def _load_recipe(path: str, **overrides: Any) -> OrderingConfig:
    with _user_errors():
        cfg = OrderingConfig.from_yaml(path)
        if overrides:
            cfg = OrderingConfig.from_dict({**cfg.to_dict(), **overrides})
    return cfg


def _parse_sizes(text: str) -> dict[str, int]:
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        try:
            sizes[name.strip()] = int(value)
        except ValueError:
            raise click.BadParameter(
                f"{part!r}: expected NAME=SAMPLES, e.g. web=1000000,code=200000",
                param_hint="--source-sizes",
            ) from None
    if not sizes:
        raise click.BadParameter("no sizes given", param_hint="--source-sizes")
    return sizes


def _task_encoder_factory(spec: str | None, tokens_per_media: int):
    """``MODULE:CLASS`` of a task encoder with the OrderingTaskEncoder mixin, or the estimator."""
    import functools
    import importlib

    from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder
    from energon_ordering.task_encoder import OrderingTaskEncoder

    if spec is None:
        return functools.partial(LengthEstimateTaskEncoder, tokens_per_media)
    module, _, name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise click.BadParameter(f"{spec!r}: cannot import it ({e}); give MODULE:CLASS.",
                                 param_hint="--task-encoder") from e
    if not (isinstance(cls, type) and issubclass(cls, OrderingTaskEncoder)):
        raise click.BadParameter(
            f"{spec!r} is not a task encoder class with the OrderingTaskEncoder mixin; define "
            "class MyTE(OrderingTaskEncoder, YourTaskEncoder).", param_hint="--task-encoder")
    return cls


TASK_ENCODER_OPTIONS = [
    click.option("--task-encoder", default=None, metavar="MODULE:CLASS",
                 help="Your task encoder (with the OrderingTaskEncoder mixin) for exact lengths "
                      "[default: estimate lengths from text tokens and media count]."),
    click.option("--tokens-per-media", type=click.IntRange(min=0), default=256,
                 help="Tokens per image/video for the length estimate."),
]


def _with_task_encoder(fn):
    for opt in reversed(TASK_ENCODER_OPTIONS):
        fn = opt(fn)
    return fn


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])])


def _epochs_rows(cfg: OrderingConfig, total_steps: int, global_batch: int, sizes: dict[str, int],
                 warn_above: float) -> tuple[list[list[Any]], list[str]]:
    assert cfg.mixture_schedule is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RepetitionWarning)
        with _user_errors():
            epochs = implied_epochs(cfg.mixture_schedule, total_steps, global_batch, sizes,
                                    warn_above=warn_above)
    rows = [[name, f"{sizes[name]:,}", f"{e:.2f}", "!" if e > warn_above else ""]
            for name, e in epochs.items()]
    return rows, [str(w.message) for w in caught]


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="energon-ordering")
def main() -> None:
    """Sample ordering for Megatron-LM + Energon: plan, inspect and check a recipe."""


# ---- plan ------------------------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@click.argument("recipe", type=click.Path(exists=True, dir_okay=False))
@click.option("--total-steps", type=click.IntRange(min=1), required=True, help="Optimizer steps of the run.")
@click.option("--global-batch-size", type=click.IntRange(min=1), required=True, help="Samples per optimizer step.")
@click.option("--metadataset", type=click.Path(exists=True), default=None,
              help="Prepared metadataset to read the source sizes from.")
@click.option("--source-sizes", default=None, help="Samples per source, e.g. web=1000000,code=200000.")
@click.option("--warn-above", default=4.0, help="Flag sources repeated more than this many epochs.")
@click.option("--out", type=click.Path(file_okay=False), default=".", help="Folder for plan.png.")
def plan(recipe: str, total_steps: int, global_batch_size: int, metadataset: str | None,
         source_sizes: str | None, warn_above: float, out: str) -> None:
    """Before a run: the schedule at its boundaries, implied epochs, warmup, plan.png."""
    from energon_ordering.inspect.inspection import source_sizes_from_metadataset
    from energon_ordering.inspect.plots import plot_plan

    if metadataset and source_sizes:
        raise click.UsageError("give either --metadataset or --source-sizes, not both")
    cfg = _load_recipe(recipe, total_steps=total_steps)
    sched = cfg.mixture_schedule
    if sched is not None:
        marks = sorted({0, total_steps - 1} | {
            s for b in sched._breakpoints().tolist() if 0 < b < total_steps for s in (b - 1, b)})
        click.echo(f"Mixture schedule {sched.fingerprint} ({len(sched.sources)} sources)\n")
        rows = [[f"{m:,}", *(f"{w:.3f}" for w in sched.weights(m).values())] for m in marks]
        click.echo(_table(["step", *sched.sources], rows))
        sizes = None
        if metadataset:
            with _user_errors():
                sizes = source_sizes_from_metadataset(metadataset)
        elif source_sizes:
            sizes = _parse_sizes(source_sizes)
        if sizes is not None:
            rows, warns = _epochs_rows(cfg, total_steps, global_batch_size, sizes, warn_above)
            click.echo(f"\nImplied epochs ({total_steps:,} steps x {global_batch_size:,} samples)\n")
            click.echo(_table(["source", "samples", "epochs", f"> {warn_above}"], rows))
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
        click.echo(_table(["step", "max_seq_len"], [[f"{m:,}", f"{w.max_seq_len(m):,}"] for m in marks]))
    else:
        click.echo("\nNo sequence-length warmup.")
    if cfg.length_sort_enabled:
        click.echo(f"\nLength pool: {cfg.length_sort_pool_size} samples per loader worker, "
                   f"mode {cfg.length_sort_mode}.")
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        png = plot_plan(Path(out) / "plan.png", total_steps=total_steps, schedule=sched, warmup=w)
    except OSError as e:
        raise click.ClickException(
            f"--out {out}: cannot write plan.png there ({e.strerror or e}); pass a writable folder."
        ) from e
    click.echo(f"\nwrote {png}")


# ---- inspect ---------------------------------------------------------------------------------


def _measure_table(results: dict[str, Any]) -> str:
    names = list(results)
    rows = [
        ["straggler idle", *(f"{100 * results[n].straggler_idle:.1f}%" for n in names)],
        ["padding waste", *(f"{100 * results[n].padding_waste:.1f}%" for n in names)],
        ["tokens per step", *(f"{results[n].tokens_per_step:,.0f}" for n in names)],
        ["source histogram dispersion (1 = iid)", *(f"{results[n].histogram_dispersion:.2f}" for n in names)],
        ["keys on two ranks (must be 0)", *(str(results[n].overlapping_keys) for n in names)],
        ["sawtooth at shard period", *("yes" if results[n].sawtooth else "no" for n in names)],
    ]
    return _table(["", *names], rows)


def _inspect(path: str, cfg: OrderingConfig, *, ranks: int, steps: int, num_workers: int,
             batch_size: int, out: Path, task_encoder_factory: Any = None,
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    from energon_ordering.inspect.inspection import measure, shard_length
    from energon_ordering.inspect.plots import plot_run
    from energon_ordering.inspect.rank_simulation import run_ranks

    configs = {"pool off": OrderingConfig.from_dict({**cfg.to_dict(), "length_sort_pool_size": 0})}
    if cfg.length_sort_enabled:
        configs[f"pool {cfg.length_sort_pool_size} ({cfg.length_sort_mode})"] = cfg
    period = max(1, shard_length(path) // batch_size)
    records, results = {}, {}
    with _user_errors():
        for name, c in configs.items():
            records[name] = run_ranks(
                path, ordering=c, world_size=ranks, steps=steps, num_workers=num_workers,
                batch_size=batch_size, task_encoder_factory=task_encoder_factory,
                progress=_progress(f"{name}: {ranks} ranks x {steps} micro-batches"))
            results[name] = measure(records[name], period)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_run(out / "inspect.png", runs=records, micro_batches_per_step=cfg.micro_batches_per_step,
                   schedule=cfg.mixture_schedule, warmup=cfg.seq_length_warmup)
    return results, {"png": png, "period": period}


@main.command(context_settings=CONTEXT)
@click.argument("metadataset", type=click.Path(exists=True))
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False), required=True)
@click.option("--ranks", type=click.IntRange(min=1), default=8, help="Simulated data-parallel ranks.")
@click.option("--steps", type=click.IntRange(min=1), default=200, help="Micro-batches per rank.")
@click.option("--num-workers", type=click.IntRange(min=0), default=0, help="Loader workers per rank.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, help="Micro-batch size.")
@click.option("--out", type=click.Path(file_okay=False), default=".", help="Folder for inspect.png.")
@_with_task_encoder
def inspect(metadataset: str, recipe: str, ranks: int, steps: int, num_workers: int,
            batch_size: int, out: str, task_encoder: str | None, tokens_per_media: int) -> None:
    """On your prepared dataset: sync, padding, mix and overlap diagnostics, pool off vs on."""
    cfg = _load_recipe(recipe)
    factory = _task_encoder_factory(task_encoder, tokens_per_media)
    results, extra = _inspect(metadataset, cfg, ranks=ranks, steps=steps, num_workers=num_workers,
                              batch_size=batch_size, out=Path(out), task_encoder_factory=factory)
    click.echo(_measure_table(results))
    click.echo(f"(sawtooth: share autocorrelation at {extra['period']} micro-batches = one shard)")
    click.echo(f"wrote {extra['png']}")


# ---- index -----------------------------------------------------------------------------------


def _import_function(spec: str, param_hint: str):
    import importlib

    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise click.BadParameter(f"{spec!r}: cannot import it ({e}); give MODULE:FUNCTION.",
                                 param_hint=param_hint) from e
    if not callable(fn):
        raise click.BadParameter(f"{spec!r} is not callable.", param_hint=param_hint)
    return fn


@main.command(context_settings=CONTEXT)
@click.argument("dataset", type=click.Path(exists=True))
@_with_task_encoder
@click.option("--raw-length-fn", default=None, metavar="MODULE:FUNCTION",
              help="Compute lengths from the raw files ({'txt': b'...', 'jpg': b'...'}) instead "
                   "of the task encoder; nothing is decoded.")
@click.option("--split-part", default="train", help="The split whose samples are indexed.")
@click.option("--workers", type=click.IntRange(min=1), default=1,
              help="Processes that decode and measure samples.")
@click.option("--name", default=None,
              help="Name of the index (OrderingConfig.length_index); default: named after what "
                   "computed the lengths, so indexes of several length functions sit side by side.")
@click.option("--index-dir", default=None, type=click.Path(file_okay=False),
              help="Write the index to DIR/<index.uuid>/ instead of <dataset>/.nv-meta/ (for a "
                   "read-only dataset; set OrderingConfig.length_index_dir = DIR).")
@click.option("--skip-bad-samples", is_flag=True,
              help="Index a sample that fails to decode or measure with length 0 and count it, "
                   "instead of stopping at it.")
def index(dataset: str, task_encoder: str | None, tokens_per_media: int,
          raw_length_fn: str | None, split_part: str, workers: int, name: str | None,
          index_dir: str | None, skip_bad_samples: bool) -> None:
    """Build the length index of DATASET (a prepared folder or a metadataset: every dataset in
    it), for length_sort_placement = pre-encode. Written to <dataset>/.nv-meta/ (or --index-dir),
    tied to the dataset's index.uuid; run it again after `energon prepare`."""
    from energon_ordering.length_index.build import build_length_index

    fn = _import_function(raw_length_fn, "--raw-length-fn") if raw_length_fn else None
    te = None if fn is not None and task_encoder is None else _task_encoder_factory(
        task_encoder, tokens_per_media)()
    with contextlib.ExitStack() as bars, _user_errors():

        def progress(name: str, total: int):
            return bars.enter_context(click.progressbar(
                length=total, label=f"indexing {name}", file=sys.stderr)).update

        built = build_length_index(dataset, task_encoder=te, raw_length_fn=fn,
                                   split_part=split_part, workers=workers, progress=progress,
                                   name=name, index_dir=index_dir,
                                   skip_bad_samples=skip_bad_samples)
    rows = [[b.dataset, f"{b.summary.samples:,}",
             f"{b.summary.total_tokens / max(1, b.summary.samples):,.1f}", f"{b.seconds:.1f}",
             str(b.summary.path)] for b in built]
    click.echo(_table(["dataset", "samples", "mean length", "seconds", "index file"], rows))
    for b in built:
        if b.skipped:
            click.echo(f"{b.dataset}: skipped {len(b.skipped)} sample(s) that failed to decode "
                       f"(indexed with length 0): {', '.join(b.skipped[:5])}"
                       f"{' ...' if len(b.skipped) > 5 else ''}")


# ---- check-resume ----------------------------------------------------------------------------


def _resume_line(path: str, cfg: OrderingConfig, *, cut: int, steps: int, num_workers: int,
                 batch_size: int, task_encoder_factory: Any = None) -> tuple[bool, str]:
    from energon_ordering.inspect.inspection import check_resume

    with _user_errors():
        res = check_resume(path, cfg, cut=cut, steps=steps, num_workers=num_workers,
                           batch_size=batch_size, task_encoder_factory=task_encoder_factory)
    if res.mismatch is None:
        return True, (f"resume check: cut at micro-batch {cut}, restored from save_state_rank(): "
                      f"the next {steps - cut} micro-batches are identical")
    return False, (f"resume check FAILED: first mismatch at micro-batch {res.mismatch} "
                   f"(cut at {cut}): expected {list(res.expected.keys)}, got {list(res.got.keys)}")


@main.command("check-resume", context_settings=CONTEXT)
@click.argument("metadataset", type=click.Path(exists=True))
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False), required=True)
@click.option("--cut", type=click.IntRange(min=0), required=True, help="Micro-batch to cut at.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Micro-batches to compare in all [default: cut + 50].")
@click.option("--num-workers", type=click.IntRange(min=0), default=0, help="Loader workers.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, help="Micro-batch size.")
@_with_task_encoder
def check_resume_cmd(metadataset: str, recipe: str, cut: int, steps: int | None, num_workers: int,
                     batch_size: int, task_encoder: str | None, tokens_per_media: int) -> None:
    """Run uninterrupted and cut-then-restored; exit 1 at the first differing micro-batch."""
    steps = cut + 50 if steps is None else steps
    if cut >= steps:
        raise click.BadParameter(f"cut {cut} must be below --steps {steps}", param_hint="--cut")
    ok, line = _resume_line(metadataset, _load_recipe(recipe), cut=cut, steps=steps,
                            num_workers=num_workers, batch_size=batch_size,
                            task_encoder_factory=_task_encoder_factory(task_encoder, tokens_per_media))
    click.echo(line)
    if not ok:
        sys.exit(1)


# ---- demo ------------------------------------------------------------------------------------


DEMO_SOURCES = (("caption", 1600, "trimodal"), ("vqa", 1600, "short"), ("ocr", 1200, "medium"),
                ("curated", 800, "trimodal"))


@main.command(context_settings=CONTEXT)
@click.option("--out", type=click.Path(file_okay=False), default="energon_ordering_demo",
              help="Folder for the dataset, plots and results.json.")
@click.option("--recipe", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Recipe to run [default: recipes/demo.yaml of this repository].")
@click.option("--ranks", type=click.IntRange(min=1), default=8, help="Simulated data-parallel ranks.")
@click.option("--steps", type=click.IntRange(min=2), default=300, help="Micro-batches per rank.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, help="Micro-batch size.")
@click.option("--scale", type=click.FloatRange(min=0.01, max=100), default=1.0,
              help="Multiplies the synthetic dataset's size (5,200 samples at 1).")
def demo(out: str, recipe: str | None, ranks: int, steps: int, batch_size: int, scale: float) -> None:
    """End to end on a synthetic multimodal dataset: blend, pool, warmup, diagnostics, resume."""
    from energon_ordering.inspect.inspection import source_sizes_from_metadataset
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    if recipe is None:
        recipe = str(REPO_RECIPES / "demo.yaml")
        if not Path(recipe).is_file():
            raise click.ClickException(f"no default recipe at {recipe}; pass --recipe PATH.")
    cfg = _load_recipe(recipe)
    out_dir = Path(out)
    specs = [SourceSpec(n, max(1, round(c * scale)), p) for n, c, p in DEMO_SOURCES]
    meta = out_dir / f"data_{sum(s.num_samples for s in specs)}" / "metadataset.yaml"
    if not meta.is_file():
        click.echo(f"writing a synthetic multimodal dataset to {meta.parent} (energon prepare) ...")
        with _user_errors():
            make_synthetic_dataset(meta.parent, specs, shard_size=100)
    click.echo(f"recipe {recipe}: {ranks} ranks x {steps} micro-batches of {batch_size}\n")
    from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder

    results, extra = _inspect(str(meta), cfg, ranks=ranks, steps=steps, num_workers=0,
                              batch_size=batch_size, out=out_dir,
                              task_encoder_factory=SyntheticTaskEncoder)
    click.echo(_measure_table(results))
    if cfg.mixture_schedule is not None:
        total = cfg.total_steps or cfg.mixture_schedule.total_steps or steps
        rows, warns = _epochs_rows(cfg, total, ranks * batch_size * cfg.micro_batches_per_step,
                                   source_sizes_from_metadataset(meta), warn_above=4.0)
        click.echo(f"\nImplied epochs over {total} steps\n")
        click.echo(_table(["source", "samples", "epochs", "> 4"], rows))
        for w in warns:
            click.echo(f"warning: {w}")
    ok, line = _resume_line(str(meta), cfg, cut=steps // 2, steps=steps, num_workers=0,
                            batch_size=batch_size, task_encoder_factory=SyntheticTaskEncoder)
    click.echo("\n" + line)
    from energon_ordering.inspect.plots import plot_plan

    plan_png = plot_plan(out_dir / "plan.png", total_steps=cfg.total_steps or steps,
                         schedule=cfg.mixture_schedule, warmup=cfg.seq_length_warmup)
    click.echo(f"wrote {extra['png']} and {plan_png}")
    (out_dir / "results.json").write_text(json.dumps(
        {name: dataclasses.asdict(m) for name, m in results.items()} | {"resume_identical": ok},
        indent=2))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
