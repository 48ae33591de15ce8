"""The figures of inspect and plan: every panel titled and labelled on both axes, legends off
the data, read from matplotlib's figure objects before saving; the saved PNGs open."""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.image  # noqa: E402
import pytest  # noqa: E402

from energon_ordering import OrderingConfig  # noqa: E402
from energon_ordering.inspect.plots import plan_figure, plot_plan, plot_run, run_figure  # noqa: E402
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, run_ranks  # noqa: E402

SCHEDULE = {"total_steps": 6, "phases": [
    {"until": 0.5, "weights": {"web": 0.6, "code": 0.3, "curated": 0.1}},
    {"until": 1.0, "ramp_steps": 2, "weights": {"web": 0.2, "code": 0.2, "curated": 0.6}}]}


@pytest.fixture(scope="module")
def runs(three_sources):
    base = {"total_steps": 6, "mixture_schedule": SCHEDULE, "blend_policy": "deterministic",
            "seq_length_warmup": {"start": 128, "full": 1024, "warmup_steps": 4}}
    off = OrderingConfig.from_dict(base)
    on = OrderingConfig.from_dict({**base, "length_sort_pool_size": 16, "length_sort_mode": "batch"})
    records = {name: run_ranks(three_sources, ordering=cfg, world_size=2, steps=12, batch_size=4)
               for name, cfg in (("pool off", off), ("pool 16 (batch)", on))}
    return records, on


def _check_panels(fig) -> int:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes = fig.get_axes()
    for ax in axes:
        assert ax.get_title(), ax
        assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
        legend = ax.get_legend()
        if legend is not None:  # off the data: outside every panel
            box = legend.get_window_extent(renderer)
            for other in axes:
                assert not box.overlaps(other.get_window_extent(renderer)), (ax.get_title(),
                                                                            other.get_title())
    return len(axes)


def test_run_figure_is_labelled_and_shows_both_runs_per_step(runs):
    records, cfg = runs
    fig = run_figure(runs=records, micro_batches_per_step=2, schedule=cfg.mixture_schedule,
                     warmup=cfg.seq_length_warmup, window_steps=3)
    assert _check_panels(fig) == 4  # idle, the mix without and with the pool, longest sample
    titles = [ax.get_title() for ax in fig.get_axes()]
    assert "pool off: source share per optimizer step" in titles
    assert "pool 16 (batch): source share per optimizer step" in titles
    share = next(ax for ax in fig.get_axes() if ax.get_title().startswith("pool 16"))
    labels = [t.get_text() for t in share.get_legend().get_texts()]
    assert "web (target 0.60 -> 0.20)" in labels and "scheduled target" in labels
    assert "realised, mean over 3 steps (centred)" in labels
    # per optimizer step: 12 micro-batches at 2 per step are 6 points
    assert {len(line.get_xdata()) for line in share.get_lines()} == {6}
    matplotlib.pyplot.close(fig)


def test_plan_figure_is_labelled_titled_by_the_recipe_and_aligned(runs):
    _, cfg = runs
    fig = plan_figure(total_steps=12, schedule=cfg.mixture_schedule, warmup=cfg.seq_length_warmup,
                      name="my_recipe.yaml")
    assert _check_panels(fig) == 2
    assert fig._suptitle.get_text() == "plan of my_recipe.yaml (12 steps)"
    mix, warm = fig.get_axes()
    assert mix.get_xlim() == warm.get_xlim() == (0, 11)
    # the legend lists the sources top to bottom as the bands are stacked
    legend = [t.get_text() for t in mix.get_legend().get_texts()]
    assert legend == ["web", "code", "curated"]
    tops = [c.get_paths()[0].vertices[:, 1].max() for c in mix.collections]  # bottom band first
    assert sorted(tops) == tops and len(tops) == 3
    matplotlib.pyplot.close(fig)


def test_saved_pngs_open(runs, tmp_path):
    records, cfg = runs
    for path in (plot_run(tmp_path / "inspect.png", runs=records, schedule=cfg.mixture_schedule,
                          warmup=cfg.seq_length_warmup, note="a note under the figure"),
                 plot_plan(tmp_path / "plan.png", total_steps=12, schedule=cfg.mixture_schedule,
                           warmup=None, name="r.yaml")):
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 600, image.shape


def test_loaders_do_not_pin_memory_without_an_accelerator(three_sources):
    import torch

    loader = build_train_loader(three_sources, ordering=OrderingConfig(), batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(iter(loader))
    close_loader(loader)
    assert loader.pin_memory == torch.accelerator.is_available()
    assert not [w for w in caught if "pin_memory" in str(w.message)]
