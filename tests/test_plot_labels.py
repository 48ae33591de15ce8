"""What the figures say (issue 34): inspect.png names its idle as per optimizer step beside the
table's per micro-batch, its longest-sample panel mentions the warmup only when there is one,
and advise.png's accepted pools are a visible band. Read from matplotlib's figure objects."""

from __future__ import annotations

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
    fig = run_figure(runs=RUNS, micro_batches_per_step=m)
    idle = next(ax for t, ax in _axes_by_title(fig).items() if t.startswith("straggler idle"))
    title = idle.get_title()
    assert title.startswith("straggler idle per optimizer step")
    assert ("the table's idle is per micro-batch" in title) == (m > 1)
    assert idle.get_ylabel() == "idle per optimizer step (%)"
    labels = [t.get_text() for t in idle.get_legend().get_texts()]
    assert all(label.endswith("% per optimizer step)") for label in labels), labels
    plt.close(fig)


def test_inspect_png_mentions_the_warmup_only_when_there_is_one():
    titles = []
    for warmup in (None, SeqLenWarmup(start=128, full=1024, warmup_steps=4)):
        fig = run_figure(runs=RUNS, micro_batches_per_step=1, warmup=warmup)
        titles.append(next(t for t in _axes_by_title(fig) if t.startswith("longest sample")))
        plt.close(fig)
    assert titles == ["longest sample of each step (no sequence-length warmup in this recipe)",
                      "longest sample of each step, against the sequence-length warmup cap"]


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


def test_advise_png_shows_the_accepted_pools_as_a_visible_band(monkeypatch, tmp_path):
    """The share is often the smallest pool predicted: the band still spans a visible width
    (here it used to be zero wide) and its edge is drawn at the share."""
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to read it
    plot_advice(tmp_path / "advise.png", _advice(260))
    fig = figs[0]
    ax = fig.get_axes()[0]
    fig.canvas.draw()
    band = next(p for p in ax.patches if p.get_label().startswith("accepted pools: up to 260"))
    box = band.get_window_extent(fig.canvas.get_renderer())
    assert box.width >= 0.05 * ax.get_window_extent().width, box
    assert band.get_alpha() >= 0.15
    edges = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [260, 260]]
    assert edges, "no line at the share"
    texts = [t.get_text() for t in fig.get_axes()[1].texts]
    assert "not measured (--no-measure)" in texts
    matplotlib.pyplot.close(fig)
