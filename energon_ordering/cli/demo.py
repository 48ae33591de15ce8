"""``energon-ordering demo``: end to end on a synthetic multimodal dataset it writes itself:
blend, pool, warmup, diagnostics, the resume check, ``plan.png`` and ``results.json``; three runs
side by side: no pool, the recipe's pool, and the planned global order (from the length indexes
the demo builds with its own task encoder) at the mix granularity (``planned_mix``) that loses
the least compute at the demo's shape (:func:`winning_mix`). The table leads with lost compute:
idle per optimizer step + padding by tokens."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from energon_ordering.cli.check_resume import resume_line
from energon_ordering.cli.inspect import as_planned, run_inspection
from energon_ordering.cli.options import CONTEXT
from energon_ordering.cli.preflight import check_dataset, check_out_dir, check_pool
from energon_ordering.cli.recipe import RECIPE, load_recipe
from energon_ordering.cli.tables import definitions, epochs_rows, measure_table, table
from energon_ordering.cli.user_error import UserError, user_errors

if TYPE_CHECKING:
    from energon_ordering.config import OrderingConfig

#: The synthetic dataset's sources: name, samples at ``--scale 1``, length profile.
DEMO_SOURCES = (("caption", 1600, "trimodal"), ("vqa", 1600, "short"), ("ocr", 1200, "medium"),
                ("curated", 800, "trimodal"))


def _check_sources(cfg: OrderingConfig, recipe: str) -> None:
    """The recipe's mixture schedule draws only from the demo dataset's sources, checked before
    the dataset is written."""
    if cfg.mixture_schedule is None:
        return
    have = [name for name, _, _ in DEMO_SOURCES]
    missing = [s for s in cfg.mixture_schedule.sources if s not in have]
    if missing:
        raise UserError(
            f"--recipe {recipe}: its mixture schedule draws from {missing}, which the demo's "
            f"synthetic dataset does not have (its sources: {', '.join(have)}); pass a recipe "
            "whose schedule uses only those sources (e.g. --recipe demo), or run `energon-ordering "
            f"inspect METADATASET --recipe {recipe}` on a dataset that has its sources.")


def _index(root: Path, sources: list[str], task_encoder: type) -> None:
    """The length index of each source folder under ``root`` that has none (the planned run
    plans from it), built with the demo's task encoder; reused by the next run."""
    from energon_ordering.length_index.build import build_length_index
    from energon_ordering.length_index.index import length_index_files

    missing = [root / name for name in sources if not length_index_files(root / name)]
    if not missing:
        return
    click.echo(f"building the length index of {len(missing)} source(s) for the planned run "
               "(energon-ordering index) ...")
    with user_errors():
        for folder in missing:
            build_length_index(folder, task_encoder=task_encoder())


def winning_mix(meta: Path, cfg: OrderingConfig, *, ranks: int, batch_size: int,
                steps: int) -> tuple[str, dict[str, float]]:
    """The ``planned_mix`` that loses the least compute (idle per optimizer step + padding by
    tokens) at the demo's shape, as ``advise`` predicts it from the length indexes, and each
    mix's predicted lost compute (``{mix: share}``)."""
    from energon_ordering.config import PLANNED_MIXES
    from energon_ordering.inspect.advise import (best_planned, data_sizes, load_population,
                                                 predict_planned, source_samples)

    with user_errors():
        plan_cfg = as_planned(cfg)
        pop = load_population(meta)
        sizes = source_samples(data_sizes(meta))
        mixes = [predict_planned(pop, batch_size=batch_size, ranks=(ranks,), step_ranks=ranks,
                                 micro_batches_per_step=cfg.micro_batches_per_step, steps=steps,
                                 window_steps=plan_cfg.plan_window_steps, seed=cfg.seed, mix=mix,
                                 source_sizes=sizes)
                 for mix in PLANNED_MIXES]
    best = best_planned(mixes, ranks)
    assert best is not None  # PLANNED_MIXES is not empty
    return best.mix, {p.mix: p.lost(ranks) for p in mixes}


def _mix_line(mix: str | None, lost: dict[str, float], ranks: int, batch_size: int,
              m: int) -> str:
    """Which mix granularity the planned run uses, and why."""
    if mix is None:
        return ("planned run: the recipe's planned_mix (with packing the plan builds the packs; "
                "the prediction that picks the mix models padded micro-batches)")
    figures = ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(lost.items(), key=lambda kv: kv[1]))
    return (f"planned run: planned_mix: {mix}, the granularity that loses the least compute at "
            f"this shape ({ranks} ranks x {m} micro-batch(es) of {batch_size} per step; "
            f"predicted from the length indexes as `energon-ordering advise` does: {figures} "
            "idle per optimizer step + padding by tokens)")


def _planned_note(results: dict, name: str, plan_cfg: OrderingConfig, ranks: int,
                  batch_size: int, window_steps: int) -> str:
    """What the planned run shows beside the pool: its mix, and the compute each loses."""
    pool = next((n for n in results if n not in ("pool off", name)), None)
    plan, m = results[name], plan_cfg.micro_batches_per_step
    unit = "packs" if plan_cfg.packing_buffer_size is not None else "samples"
    step_samples = ranks * batch_size
    held = ("every step holds each source's scheduled share of its samples within one sample"
            if plan_cfg.resolved_planned_mix == "step" else
            f"every plan window of {window_steps} steps holds each "
            "source's scheduled share within one sample, and each of its steps takes one band "
            "of lengths, as a pool's steps do")
    text = (f"The planned run: {held} (dispersion per step {plan.step_histogram_dispersion:.2f}"
            + (f", {results[pool].step_histogram_dispersion:.2f} with the pool" if pool else "")
            + f"); ranks are balanced over {m} micro-batch(es) per rank per step "
            f"({step_samples * m} {unit} per step here"
            + (", each pack built to its step's cap)." if unit == "packs" else ")."))
    if pool:
        other = results[pool]
        text += (f" It loses {100 * plan.lost_compute:.1f}% of compute (idle per optimizer step "
                 f"{100 * plan.idle_per_step:.1f}% + padding by tokens "
                 f"{100 * plan.padding_by_tokens:.1f}%), the pool "
                 f"{100 * other.lost_compute:.1f}% ({100 * other.idle_per_step:.1f}% + "
                 f"{100 * other.padding_by_tokens:.1f}%).")
        if plan.lost_compute > other.lost_compute:
            text += (" Here the pool loses less; with more micro-batches per step "
                     "(micro_batches_per_step) the plan has more to balance "
                     "(`energon-ordering advise --micro-batches-per-step M` predicts both).")
    return text


@click.command("demo", context_settings=CONTEXT)
@click.option("--out", type=click.Path(file_okay=False), default="energon_ordering_demo",
              help="Folder for the dataset, plots and results.json.")
@click.option("--recipe", type=RECIPE, default="demo",
              help="Recipe file, or a packaged recipe's name.")
@click.option("--ranks", type=click.IntRange(min=1), default=8, help="Simulated data-parallel ranks.")
@click.option("--steps", type=click.IntRange(min=2), default=300, help="Micro-batches per rank.")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, help="Micro-batch size.")
@click.option("--scale", type=click.FloatRange(min=0.01, max=100), default=1.0,
              help="Multiplies the synthetic dataset's size (5,200 samples at 1).")
def command(out: str, recipe: str, ranks: int, steps: int, batch_size: int, scale: float) -> None:
    """End to end on a synthetic multimodal dataset: blend, pool, planned order, warmup, diagnostics, resume."""
    cfg = load_recipe(recipe)  # before torch and Energon are imported
    check_pool(cfg, batch_size)
    _check_sources(cfg, recipe)  # before the dataset is written
    out_dir = check_out_dir(out, "the demo's dataset, plots and results.json")
    from energon_ordering.inspect.inspection import source_sizes_from_metadataset
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    specs = [SourceSpec(n, max(1, round(c * scale)), p) for n, c, p in DEMO_SOURCES]
    meta = out_dir / f"data_{sum(s.num_samples for s in specs)}" / "metadataset.yaml"
    if not meta.is_file():
        click.echo(f"writing a synthetic multimodal dataset to {meta.parent} (energon prepare) ...")
        with user_errors():
            make_synthetic_dataset(meta.parent, specs, shard_size=100)
    from energon_ordering.inspect.synthetic_task import SyntheticTaskEncoder

    _index(meta.parent, [s.name for s in specs], SyntheticTaskEncoder)
    click.echo(f"recipe {recipe}: {ranks} ranks x {steps} micro-batches of {batch_size}")
    mix, lost = None, {}
    if cfg.packing_buffer_size is None:
        mix, lost = winning_mix(meta, cfg, ranks=ranks, batch_size=batch_size, steps=steps)
    click.echo(_mix_line(mix, lost, ranks, batch_size, cfg.micro_batches_per_step) + "\n")

    epochs = None
    total = cfg.total_steps or (cfg.mixture_schedule.total_steps if cfg.mixture_schedule else None) or steps
    if cfg.mixture_schedule is not None:
        check_dataset(str(meta), "the demo dataset")
        with user_errors():
            sizes = source_sizes_from_metadataset(meta)
        epochs = epochs_rows(cfg, total, ranks * batch_size * cfg.micro_batches_per_step, sizes,
                             warn_above=4.0)
    results, extra = run_inspection(str(meta), cfg, ranks=ranks, steps=steps, num_workers=0,
                                    batch_size=batch_size, out=out_dir,
                                    task_encoder_factory=SyntheticTaskEncoder, planned=True,
                                    planned_mix=mix)
    click.echo(measure_table(results, extra["planned"]))
    click.echo("\n" + definitions(extra))
    name = extra["planned"][0]
    click.echo("\n" + _planned_note(results, name, as_planned(cfg, mix), ranks, batch_size,
                                    extra["plan_window_steps"][name]))
    if extra["note"]:
        click.echo("\n" + extra["note"])
    if epochs is not None:
        rows, warns = epochs
        click.echo(f"\nImplied epochs over {total} steps\n")
        click.echo(table(["source", "samples", "epochs", "> 4"], rows))
        for w in warns:
            click.echo(f"warning: {w}")
    ok, line = resume_line(str(meta), cfg, cut=steps // 2, steps=steps, num_workers=0,
                           batch_size=batch_size, task_encoder_factory=SyntheticTaskEncoder)
    click.echo("\n" + line)
    from energon_ordering.inspect.plots import plot_plan

    plan_png = plot_plan(out_dir / "plan.png", total_steps=total, schedule=cfg.mixture_schedule,
                         warmup=cfg.seq_length_warmup, name=Path(recipe).name)
    results_json = out_dir / "results.json"
    results_json.write_text(json.dumps(
        {name: dataclasses.asdict(m) for name, m in results.items()}
        | {"resume_identical": ok, "micro_batches_per_step": cfg.micro_batches_per_step,
           "planned_mix": extra["planned_mix"], "predicted_lost_compute": lost,
           "mix_window_steps": extra["window_steps"], "mix_note": extra["note"]},
        indent=2))
    data_mb = sum(f.stat().st_size for f in meta.parent.rglob("*") if f.is_file()) / 1e6
    click.echo(f"\nwrote to {out_dir}/:\n"
               f"  {extra['png'].name:<14} straggler idle, source mix and longest sample per step "
               f"({', '.join(results)})\n"
               f"  {plan_png.name:<14} the recipe's schedule and warmup\n"
               f"  {results_json.name:<14} the table above, per run\n"
               f"  {meta.parent.name + '/':<14} the synthetic dataset ({data_mb:.0f} MB, reused by "
               f"the next run)")
    if not ok:
        sys.exit(1)
