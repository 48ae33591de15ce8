"""What the figures say (issues 34, 32): inspect.png names its idle as per optimizer step and
gives each run's idle per micro-batch and padding by tokens beside it, its longest-sample panel
mentions the warmup only when there is one; advise.png plots idle per optimizer step and lost
compute, the accepted pools a band a quarter of the axis wide at least. Read from matplotlib's
figure objects."""

from __future__ import annotations

import functools

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from energon_ordering.inspect.advise import (  # noqa: E402
    Advice,
    LengthPopulation,
    plot_advice,
    predict_order,
)
from energon_ordering.inspect.plots import run_figure  # noqa: E402
from energon_ordering.inspect.rank_simulation import BatchRecord  # noqa: E402
from energon_ordering.warmup.schedule import SeqLenWarmup  # noqa: E402


def _records(seed: int) -> list[list[BatchRecord]]:
    """Two ranks x 12 micro-batches of 4 samples of two sources."""
    rng = np.random.default_rng(seed)
    return [[BatchRecord(tuple(f"{r}-{k}-{i}" for i in range(4)),
                         tuple(int(x) for x in rng.integers(50, 3000, 4)),
                         tuple("web" if x else "code" for x in rng.integers(0, 2, 4)))
             for k in range(12)] for r in range(2)]


RUNS = {"pool off": _records(0), "pool 16 (batch)": _records(1)}


def _axes_by_title(fig) -> dict[str, object]:
    return {ax.get_title(): ax for ax in fig.get_axes()}


@pytest.mark.parametrize("m", [1, 2])
def test_inspect_png_says_which_idle_it_plots(m):
    from energon_ordering.inspect.inspection import measure

    measured = {name: measure(records, 4, m) for name, records in RUNS.items()}
    fig = run_figure(runs=RUNS, micro_batches_per_step=m, measurements=measured)
    idle = next(ax for t, ax in _axes_by_title(fig).items() if t.startswith("straggler idle"))
    title = idle.get_title()
    assert title.startswith("straggler idle per optimizer step")
    assert ("idle per micro-batch in the legend" in title) == (m > 1)
    assert idle.get_ylabel() == "idle per optimizer step (%)"
    labels = [t.get_text() for t in idle.get_legend().get_texts()]
    for label, (name, got) in zip(labels, measured.items()):
        # the curve's mean is the table's idle per optimizer step
        assert label == (f"{name}: mean {100 * got.idle_per_step:.1f}% per optimizer step "
                         f"({100 * got.straggler_idle:.1f}% per micro-batch); padding "
                         f"{100 * got.padding_by_tokens:.1f}% by tokens")
    plt.close(fig)


def test_inspect_png_mentions_the_warmup_only_when_there_is_one():
    titles = []
    for warmup in (None, SeqLenWarmup(start=128, full=1024, warmup_steps=4)):
        fig = run_figure(runs=RUNS, micro_batches_per_step=1, warmup=warmup)
        titles.append(next(t for t in _axes_by_title(fig) if t.startswith("longest sample")))
        plt.close(fig)
    assert titles == ["longest sample of each step (no sequence-length warmup in this recipe)",
                      "longest sample of each step, against the sequence-length warmup cap"]


@functools.cache
def _advice(share: int) -> Advice:
    rng = np.random.default_rng(0)
    lengths = np.sort(rng.lognormal(6, 0.6, 4000))
    pop = LengthPopulation(lengths, (lengths > 500).astype(np.int64), ("code", "web"), "test")
    kw = dict(batch_size=4, ranks=(8,), step_ranks=8, steps=64)
    preds = [predict_order(pop, mode="off", pool_size=0, **kw)]
    preds += [predict_order(pop, mode="batch", pool_size=n, **kw)
              for n in (share, 1000, 10_000, 100_000, 1_000_000)]
    return Advice(pop, 8, 4, preds, [], 2**30, ("post-encode", "raw", "batch", share), "test",
                  (8,), 1, 8 * share, share)


def _green(patch) -> bool:
    return matplotlib.colors.same_color(patch.get_facecolor()[:3], "tab:green")


def test_advise_png_shows_the_accepted_pools_as_a_clear_band(monkeypatch, tmp_path):
    """The share is often the smallest pool predicted: on the idle and the lost-compute panels
    the accepted pools still take a quarter of the axis (a 7% sliver before), named inside the
    panel, edged by a line at the share, and the refused pools are hatched."""
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to read it
    plot_advice(tmp_path / "advise.png", _advice(260))
    fig = figs[0]
    idle_ax, lost_ax, cost_ax = fig.get_axes()[:3]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert idle_ax.get_ylabel() == "predicted straggler idle per optimizer step (%), log"
    assert lost_ax.get_title().startswith("lost compute at 8 ranks = idle per optimizer step + "
                                          "padding by tokens")
    for ax in (idle_ax, lost_ax):
        band = next(p for p in ax.patches if _green(p))
        box = band.get_window_extent(renderer)
        assert box.width >= 0.24 * ax.get_window_extent().width, box
        assert band.get_alpha() >= 0.2
        assert any(list(ln.get_xdata()) == [260, 260] for ln in ax.get_lines()), "no share line"
        texts = [t.get_text() for t in ax.texts]
        assert "accepted" in texts and "refused: needs more data" in texts
        assert any(p.get_hatch() == "//" for p in ax.patches)
    assert next(p for p in idle_ax.patches if _green(p)).get_label().startswith(
        "accepted pools: up to 260")
    assert "not measured (--no-measure)" in [t.get_text() for t in cost_ax.texts]
    matplotlib.pyplot.close(fig)


def test_advise_png_plots_lost_compute_and_the_recommended_setting(monkeypatch, tmp_path):
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    adv = _advice(260)
    plot_advice(tmp_path / "advise.png", adv)
    lost_ax = figs[0].get_axes()[1]
    star = next(ln for ln in lost_ax.get_lines() if ln.get_label() == "recommended: batch 260")
    rec = next(p for p in adv.predictions if p.pool_size == 260)
    assert star.get_ydata()[0] == pytest.approx(100 * (rec.idle_step[8] + rec.padding_tokens))
    matplotlib.pyplot.close(figs[0])
