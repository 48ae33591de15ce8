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
from energon_ordering.packaged_recipes import resolve_recipe

CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}


class _RecipeType(click.ParamType):
    """A recipe file's path, or the name of a packaged recipe (``demo``, ``slm_350m_20b``)."""

    name = "recipe"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return str(resolve_recipe(value))
        except OrderingError as e:
            self.fail(str(e), param, ctx)


RECIPE = _RecipeType()


class UserError(click.ClickException):
    """A mistake in the command's input: one line ``Error: ...`` and exit code 2, like click's
    own usage errors (exit code 1 means a check ran and failed, e.g. ``check-resume``)."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))  # one line, whatever the message holds


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Turns the package's typed errors into one clear line and exit code 2."""
    try:
        yield
    except OrderingError as e:
        raise UserError(str(e)) from e


# ---- pre-flight: every input checked before any work starts ---------------------------------


def _looks_like_recipe(path: Path) -> bool:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    fields = {f.name for f in dataclasses.fields(OrderingConfig)} | {"placement"}
    return isinstance(data, dict) and bool(fields & set(data)) and "splits" not in data


def _check_dataset(path: str, what: str, recipe_goes: str | None = None, *,
                   open_train_split: bool = True) -> None:
    """Raises a one-line :class:`UserError` unless ``path`` is a prepared Energon dataset folder
    or a metadataset YAML (whose train split opens, with ``open_train_split``); ``what`` names
    the argument (e.g. ``METADATASET``), ``recipe_goes`` where a recipe belongs instead (e.g.
    ``--recipe``), if the command takes one."""
    from megatron.energon.metadataset import load_dataset

    how = ("prepare a folder of WebDataset shards with `energon prepare DIR`, or pass a "
           "metadataset YAML that lists prepared folders")
    if Path(path).is_file() and _looks_like_recipe(Path(path)):
        where = f"pass it as {recipe_goes}, and " if recipe_goes else ""
        raise UserError(f"{what} {path} is a recipe (ordering settings), not a dataset: {where}"
                        f"give as {what} a prepared dataset: {how}.")
    try:
        dataset = load_dataset(path)
        if open_train_split:  # a metadataset's entries must be prepared datasets too
            from megatron.energon import WorkerConfig

            dataset.get_datasets(training=True, split_part="train",
                                 worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    except Exception as e:  # Energon raises ValueError, TypeError, OSError or YAML errors here
        raise UserError(f"{what} {path} is not a prepared Energon dataset or metadataset "
                        f"({type(e).__name__}: {e}); {how}.") from e


def _check_pool(cfg: OrderingConfig, batch_size: int) -> None:
    """The recipe's pool against the micro-batch size (checked without any data)."""
    if not (cfg.length_sort_enabled and cfg.length_sort_mode == "batch"):
        return
    pool = cfg.length_sort_pool_size
    if pool % batch_size:
        lower, upper = pool // batch_size * batch_size, (pool // batch_size + 1) * batch_size
        fix = f"{lower} or {upper}" if lower else f"{upper}"
        raise UserError(f"the recipe's length_sort_pool_size = {pool} is not a multiple of the "
                        f"micro-batch size --batch-size {batch_size} (length_sort_mode: batch); "
                        f"set length_sort_pool_size to {fix}, or change --batch-size.")


def _preflight(path: str, configs: list[OrderingConfig], *, batch_size: int, num_workers: int,
               world_size: int, task_encoder_factory: Any) -> None:
    """Checks every input before any work starts: the dataset, the pool against the
    micro-batch, and then builds (without iterating) the last rank's pipeline for each
    configuration, which raises every construction-time error (sources against the schedule,
    a missing length index, the task encoder) before the first run begins."""
    from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader

    _check_dataset(path, "METADATASET", "--recipe")
    for cfg in configs:
        _check_pool(cfg, batch_size)
    with _user_errors():
        for cfg in configs:
            loader = build_train_loader(path, ordering=cfg, rank=world_size - 1,
                                        world_size=world_size, num_workers=num_workers,
                                        batch_size=batch_size,
                                        task_encoder_factory=task_encoder_factory)
            close_loader(loader)


def _progress(label: str):
    def wrap(it):
        items = list(it)
        with click.progressbar(items, label=label, file=sys.stderr) as bar:
            yield from bar

    return wrap


def _load_recipe(path: str, *, total_steps: int | None = None) -> OrderingConfig:
    """Loads a recipe; ``total_steps`` overrides the recipe's (and its schedule's) before the
    schedule's fractional phase ends are resolved."""
    from collections.abc import Mapping

    from energon_ordering.yaml_file import load_yaml

    with _user_errors():
        if total_steps is None:
            return OrderingConfig.from_yaml(path)
        data = load_yaml(path, "OrderingConfig.from_yaml")
        if not isinstance(data, Mapping):
            return OrderingConfig.from_yaml(path)  # raises its own error
        sched = data.get("mixture_schedule")
        if isinstance(sched, str):
            sched_path = Path(sched) if Path(sched).is_absolute() else Path(path).parent / sched
            sched = load_yaml(sched_path, "MixtureSchedule.from_yaml")
        if isinstance(sched, Mapping) and "total_steps" in sched:
            sched = {**sched, "total_steps": total_steps}
        data = {**data, "total_steps": total_steps,
                **({"mixture_schedule": sched} if "mixture_schedule" in data else {})}
        try:
            return OrderingConfig.from_dict(data)
        except OrderingError as e:
            raise type(e)(f"{path}: {e}") from e


def _parse_sizes(text: str) -> dict[str, int]:
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


def _table(headers: list[str], rows: list[list[Any]], left: tuple[str, ...] = ()) -> str:
    """A plain text table: the first column and the ``left`` columns left-aligned."""
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lefts = {0} | {i for i, h in enumerate(headers) if h in left}
    line = lambda r: "  ".join(c.ljust(w) if i in lefts else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()  # noqa: E731
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


@main.command(context_settings=CONTEXT)
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
def plan(recipe: str, total_steps: int | None, global_batch_size: int, metadataset: str | None,
         source_sizes: str | None, warn_above: float, out: str) -> None:
    """Before a run: the schedule at its boundaries, implied epochs, warmup, plan.png."""
    from energon_ordering.inspect.inspection import source_sizes_from_metadataset
    from energon_ordering.inspect.plots import plot_plan

    # Everything is checked before anything is printed.
    if metadataset and source_sizes:
        raise UserError("give either --metadataset or --source-sizes, not both.")
    cfg = _load_recipe(recipe, total_steps=total_steps)
    sched = cfg.mixture_schedule
    total_steps = total_steps or cfg.total_steps or (sched.total_steps if sched else None)
    if total_steps is None:
        raise UserError(f"the recipe {recipe} has no total_steps; add `total_steps: N` to it "
                        "or pass --total-steps N.")
    sizes = None
    if metadataset:
        _check_dataset(metadataset, "--metadataset", "RECIPE")
        with _user_errors():
            sizes = source_sizes_from_metadataset(metadataset)
    elif source_sizes:
        sizes = _parse_sizes(source_sizes)
    epochs = None
    if sched is not None and sizes is not None:
        epochs = _epochs_rows(cfg, total_steps, global_batch_size, sizes, warn_above)
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
        click.echo(_table(["step", *sched.sources, "note"], rows, left=("note",)))
        if epochs is not None:
            rows, warns = epochs
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


# ---- inspect ---------------------------------------------------------------------------------


def _measure_table(results: dict[str, Any]) -> str:
    names = list(results)
    rows = [
        ["straggler idle", *(f"{100 * results[n].straggler_idle:.1f}%" for n in names)],
        ["padding waste", *(f"{100 * results[n].padding_waste:.1f}%" for n in names)],
        ["tokens per step", *(f"{results[n].tokens_per_step:,.0f}" for n in names)],
        ["source histogram dispersion (1 = iid)", *(f"{results[n].histogram_dispersion:.2f}" for n in names)],
        ["  per optimizer step (1 = iid)", *(f"{results[n].step_histogram_dispersion:.2f}" for n in names)],
        ["keys on two ranks (must be 0)", *(str(results[n].overlapping_keys) for n in names)],
        ["sawtooth at shard period", *("yes" if results[n].sawtooth else "no" for n in names)],
    ]
    return _table(["", *names], rows)


def _definitions(extra: dict[str, Any]) -> str:
    """One line per term of :func:`_measure_table`, printed under it."""
    return "\n".join([
        "straggler idle: share of each step the ranks wait for the slowest (cost L + L^2/4096 "
        "per sample); lower is better.",
        "padding waste: share of a micro-batch that is padding up to its longest sample; lower "
        "is better.",
        "tokens per step: tokens of one micro-batch of every rank together, before padding.",
        "source histogram dispersion: variance of each source's count per micro-batch (per "
        "step: all ranks' micro-batches of the step, against the schedule at that step) over "
        "that of independent draws; 1 = iid, below 1 more even, above 1 clumped by source "
        "(worse: the mix swings from batch to batch).",
        "keys on two ranks: samples drawn by more than one rank; anything but 0 means ranks "
        "train on the same data.",
        f"sawtooth at shard period: 'yes' if each source's share repeats every shard "
        f"({extra['period']} micro-batches) while batches are clumped by source (shards read in "
        "blocks: a sawtooth in the per-source loss); 'no' is good.",
    ])


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


def _inspect(path: str, cfg: OrderingConfig, *, ranks: int, steps: int, num_workers: int,
             batch_size: int, out: Path, task_encoder_factory: Any = None,
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    from energon_ordering.inspect.inspection import measure, shard_length
    from energon_ordering.inspect.plots import plot_run
    from energon_ordering.inspect.rank_simulation import run_ranks

    with _user_errors():
        configs = {"pool off": OrderingConfig.from_dict({**cfg.to_dict(), "length_sort_pool_size": 0})}
    if cfg.length_sort_enabled:
        configs[f"pool {cfg.length_sort_pool_size} ({cfg.length_sort_mode})"] = cfg
    _preflight(path, list(configs.values())[::-1], batch_size=batch_size, num_workers=num_workers,
               world_size=ranks, task_encoder_factory=task_encoder_factory)
    period = max(1, shard_length(path) // batch_size)
    mbps = cfg.micro_batches_per_step
    # The averaging window of the mix plot: one pool's worth of steps (10 without a pool).
    window = max(1, cfg.length_sort_pool_size // (batch_size * mbps)) if cfg.length_sort_enabled else 10
    records, results = {}, {}
    with _user_errors():
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
    return results, {"png": png, "period": period, "note": note, "window_steps": window}


@main.command(context_settings=CONTEXT)
@click.argument("metadataset", type=click.Path(exists=True))
@click.option("--recipe", type=RECIPE, required=True, help="Recipe file, or a packaged recipe's name.")
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
    click.echo("\n" + _definitions(extra))
    if extra["note"]:
        click.echo("\n" + extra["note"])
    click.echo(f"\nwrote {extra['png']}")


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

    _check_dataset(dataset, "DATASET", open_train_split=False)  # the split is --split-part
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
    click.echo(_index_table(built))
    for b in built:
        if b.skipped:
            click.echo(f"{b.dataset}: skipped {len(b.skipped)} sample(s) that failed to decode "
                       f"(indexed with length 0): {', '.join(b.skipped[:5])}"
                       f"{' ...' if len(b.skipped) > 5 else ''}")


def _index_table(built: list[Any]) -> str:
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
        _table(["dataset", "samples", "mean length (tokens)", "seconds"], rows),
        f"\n{where}",
        f"datasets in {parent}",
    ])


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
@click.option("--recipe", type=RECIPE, required=True, help="Recipe file, or a packaged recipe's name.")
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
    _check_dataset(metadataset, "METADATASET", "--recipe")
    cfg = _load_recipe(recipe)
    _check_pool(cfg, batch_size)
    ok, line = _resume_line(metadataset, cfg, cut=cut, steps=steps,
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
@click.option("--recipe", type=RECIPE, default="demo",
              help="Recipe file, or a packaged recipe's name.")
@click.option("--ranks", type=click.IntRange(min=1), default=8, help="Simulated data-parallel ranks.")
@click.option("--steps", type=click.IntRange(min=2), default=300, help="Micro-batches per rank.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, help="Micro-batch size.")
@click.option("--scale", type=click.FloatRange(min=0.01, max=100), default=1.0,
              help="Multiplies the synthetic dataset's size (5,200 samples at 1).")
def demo(out: str, recipe: str, ranks: int, steps: int, batch_size: int, scale: float) -> None:
    """End to end on a synthetic multimodal dataset: blend, pool, warmup, diagnostics, resume."""
    from energon_ordering.inspect.inspection import source_sizes_from_metadataset
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    cfg = _load_recipe(recipe)
    _check_pool(cfg, batch_size)
    out_dir = Path(out)
    specs = [SourceSpec(n, max(1, round(c * scale)), p) for n, c, p in DEMO_SOURCES]
    meta = out_dir / f"data_{sum(s.num_samples for s in specs)}" / "metadataset.yaml"
    if not meta.is_file():
        click.echo(f"writing a synthetic multimodal dataset to {meta.parent} (energon prepare) ...")
        with _user_errors():
            make_synthetic_dataset(meta.parent, specs, shard_size=100)
    click.echo(f"recipe {recipe}: {ranks} ranks x {steps} micro-batches of {batch_size}\n")
    from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder

    epochs = None
    total = cfg.total_steps or (cfg.mixture_schedule.total_steps if cfg.mixture_schedule else None) or steps
    if cfg.mixture_schedule is not None:
        _check_dataset(str(meta), "the demo dataset")
        with _user_errors():
            sizes = source_sizes_from_metadataset(meta)
        epochs = _epochs_rows(cfg, total, ranks * batch_size * cfg.micro_batches_per_step, sizes,
                              warn_above=4.0)
    results, extra = _inspect(str(meta), cfg, ranks=ranks, steps=steps, num_workers=0,
                              batch_size=batch_size, out=out_dir,
                              task_encoder_factory=SyntheticTaskEncoder)
    click.echo(_measure_table(results))
    click.echo("\n" + _definitions(extra))
    if extra["note"]:
        click.echo("\n" + extra["note"])
    if epochs is not None:
        rows, warns = epochs
        click.echo(f"\nImplied epochs over {total} steps\n")
        click.echo(_table(["source", "samples", "epochs", "> 4"], rows))
        for w in warns:
            click.echo(f"warning: {w}")
    ok, line = _resume_line(str(meta), cfg, cut=steps // 2, steps=steps, num_workers=0,
                            batch_size=batch_size, task_encoder_factory=SyntheticTaskEncoder)
    click.echo("\n" + line)
    from energon_ordering.inspect.plots import plot_plan

    plan_png = plot_plan(out_dir / "plan.png", total_steps=total, schedule=cfg.mixture_schedule,
                         warmup=cfg.seq_length_warmup, name=Path(recipe).name)
    results_json = out_dir / "results.json"
    results_json.write_text(json.dumps(
        {name: dataclasses.asdict(m) for name, m in results.items()}
        | {"resume_identical": ok, "micro_batches_per_step": cfg.micro_batches_per_step,
           "mix_window_steps": extra["window_steps"], "mix_note": extra["note"]},
        indent=2))
    data_mb = sum(f.stat().st_size for f in meta.parent.rglob("*") if f.is_file()) / 1e6
    click.echo(f"\nwrote to {out_dir}/:\n"
               f"  {extra['png'].name:<14} straggler idle, source mix and longest sample per step\n"
               f"  {plan_png.name:<14} the recipe's schedule and warmup\n"
               f"  {results_json.name:<14} the table above, per run\n"
               f"  {meta.parent.name + '/':<14} the synthetic dataset ({data_mb:.0f} MB, reused by "
               f"the next run)")
    if not ok:
        sys.exit(1)


# ---- advise ----------------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
               "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def _parse_bytes(text: str) -> float:
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise click.BadParameter(f"{text!r}: expected a size like 2GiB, 512MiB or 64MB",
                                 param_hint="--memory-per-worker")
    return float(m.group(1)) * _SIZE_UNITS[unit]


def _mib(n: float) -> str:
    return "n/a" if n != n else f"{n / 2**20:,.1f} MiB"


def _advice_tables(adv: Any) -> str:
    counts = adv.rank_counts
    rows = []
    for p in adv.predictions:
        name = "pool off" if p.pool_size == 0 else f"{p.mode} {p.pool_size:,}"
        rows.append([name, *(f"{100 * p.idle[r]:.1f}%" for r in counts),
                     f"{100 * p.padding:.1f}%", f"{p.dispersion_batch:.2f}",
                     f"{p.dispersion_step:.2f}"])
    headers = ["order", *(f"idle {r}" + ("*" if r == adv.ranks else "") for r in counts),
               "padding", "disp/mb", "disp/step"]
    text = [_table(headers, rows)]
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
        text += ["", "memory per loader worker, time to first batch (measured per pooled sample "
                 f"on a real loader, pool {adv.costs[0].measured_pool}, scaled):",
                 _table(["placement", *(f"{n:,}" for n in sizes)], rows)]
        text += [f"  {c.placement}/{c.holds}: {c.note}" for c in adv.costs if c.note]
    return "\n".join(text)


@main.command(context_settings=CONTEXT)
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
              help="Measure time to first batch and memory on real loaders.")
@click.option("--out", type=click.Path(file_okay=False), default=".", help="Folder for advise.png.")
@_with_task_encoder
def advise(dataset: str, ranks: int, micro_batch: int, num_workers: int, memory_per_worker: str,
           micro_batches_per_step: int, steps: int, seed: int, measure: bool, out: str,
           task_encoder: str | None, tokens_per_media: int) -> None:
    """Predicted idle, padding and source mix for pool sizes 1k..1M at 8..1,024 ranks; recommends one setting."""
    from energon_ordering.inspect.advise import advise as run_advise
    from energon_ordering.inspect.advise import plot_advice, source_mix_note

    budget = _parse_bytes(memory_per_worker)
    factory = _task_encoder_factory(task_encoder, tokens_per_media)
    with _user_errors():
        adv = run_advise(dataset, ranks=ranks, batch_size=micro_batch, num_workers=num_workers,
                         memory_per_worker=budget, micro_batches_per_step=micro_batches_per_step,
                         steps=steps, seed=seed, task_encoder_factory=factory, measure=measure,
                         progress=lambda line: click.echo(f"... {line}", err=True))
    pop = adv.population
    click.echo(f"lengths: {pop.origin}, {len(pop.lengths):,} samples, mean {pop.lengths.mean():,.0f} "
               f"tokens, sources {', '.join(pop.source_names)}")
    click.echo(_advice_tables(adv))
    if adv.recommended is None:
        click.echo(f"\nrecommended: none ({adv.reason})")
    else:
        placement, holds, mode, size = adv.recommended
        click.echo(f"\nrecommended: length_sort_pool_size: {size}, length_sort_mode: {mode}, "
                   f"length_sort_placement: {placement}"
                   + (f", length_sort_pool_holds: {holds}" if placement == "pre-encode" else "")
                   + f"\n  ({adv.reason})")
    note = source_mix_note(adv)
    if note:
        click.echo(f"  {note}")
    click.echo(f"wrote {plot_advice(Path(out) / 'advise.png', adv)}")


if __name__ == "__main__":
    main()
