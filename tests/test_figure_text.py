"""No text overlaps any other text in the package's figures (advise.png, plan.png, inspect.png):
every drawn text artist's window extent, after ``fig.canvas.draw()``, against every other."""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from energon_ordering import OrderingConfig  # noqa: E402
from energon_ordering.inspect.advise import (  # noqa: E402
    Advice,
    CostPerSample,
    LengthPopulation,
    other_mode_note,
    plot_advice,
    predict_order,
)
from energon_ordering.inspect.plots import plot_plan, plot_run  # noqa: E402
from energon_ordering.inspect.rank_simulation import run_ranks  # noqa: E402
from energon_ordering.mixture.schedule import MixtureSchedule  # noqa: E402
from energon_ordering.warmup.schedule import SeqLenWarmup  # noqa: E402


def _drawn_texts(fig: Figure) -> list[Text]:
    """Visible, non-empty texts that are drawn: tick labels only for ticks inside the view."""
    fig.canvas.draw()
    tick_labels, texts = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            pad = 1e-9 * max(1.0, abs(lo), abs(hi))
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                for label in (tick.label1, tick.label2):
                    tick_labels.add(id(label))
                    if (label.get_visible() and label.get_text().strip()
                            and lo - pad <= tick.get_loc() <= hi + pad):
                        texts.append(label)
    texts += [t for t in fig.findobj(Text)
              if id(t) not in tick_labels and t.get_visible() and t.get_text().strip()]
    return texts


def overlapping_texts(fig: Figure) -> list[tuple[str, str]]:
    """Pairs of drawn texts whose window extents overlap by more than a pixel."""
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer).expanded(1.0, 1.0).padded(-1))
             for t in _drawn_texts(fig)]
    return [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]


@pytest.fixture
def saved_figures(monkeypatch):
    """Every figure the package saves, checked for overlaps at save time."""
    found: dict[str, list[tuple[str, str]]] = {}
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        found[str(fname)] = overlapping_texts(self)
        return original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return found


def test_the_overlap_check_can_fail():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_xlim(0, 100)
    ax.text(0.5, 0.4, "drawn over the y tick labels", ha="center")  # data coords: left edge
    assert overlapping_texts(fig)
    plt.close(fig)


@pytest.mark.parametrize("recipe", ["empty", "slm"])
def test_plan_png_has_no_overlapping_text(saved_figures, tmp_path, recipe):
    if recipe == "empty":
        kw = dict(total_steps=1000, schedule=None, warmup=None)
    else:
        sched = MixtureSchedule.from_dict({"phases": [
            {"until": 17165, "weights": {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}},
            {"until": 19073, "weights": {"web": 0.35, "code": 0.2, "books": 0.1, "curated": 0.35}}]})
        kw = dict(total_steps=19073, schedule=sched,
                  warmup=SeqLenWarmup(start=512, full=2048, warmup_steps=2000))
    plot_plan(tmp_path / "plan.png", name=recipe, **kw)
    assert saved_figures[str(tmp_path / "plan.png")] == []


def _advice(share: int) -> Advice:
    rng = np.random.default_rng(0)
    lengths = np.sort(np.concatenate([rng.lognormal(5.3, 0.4, 2000), rng.lognormal(7, 0.3, 2000)]))
    pop = LengthPopulation(lengths, (lengths > 700).astype(np.int64), ("code", "web"), "test")
    preds = [predict_order(pop, mode="off", pool_size=0, batch_size=4, ranks=(8, 64),
                           step_ranks=8, steps=64)]
    preds += [predict_order(pop, mode=m, pool_size=n, batch_size=4, ranks=(8, 64), step_ranks=8,
                            steps=64) for m in ("batch", "sample", "stratified")
              for n in (800, 1000, 10_000, 100_000)]
    costs = [CostPerSample("pre-encode", "keys", 0.4, 2e-5, 40.0, (100, 400), 800, 0.43),
             CostPerSample("post-encode", "encoded", 0.5, 3e-4, 900.0, (100, 400), 800, 0.8)]
    adv = Advice(pop, 8, 4, preds, costs, 2**30, ("pre-encode", "keys", "batch", 800), "test",
                 (8, 64), 2, 12_800, share)
    return adv


def test_advise_png_has_no_overlapping_text(saved_figures, tmp_path):
    adv = _advice(800)
    assert other_mode_note(adv) is not None  # batch 800 leaves more than 1% idle here
    plot_advice(tmp_path / "advise.png", adv)
    assert saved_figures[str(tmp_path / "advise.png")] == []


def test_inspect_png_has_no_overlapping_text(saved_figures, tmp_path, three_sources):
    cfg = OrderingConfig(length_sort_pool_size=16, length_sort_mode="batch")
    runs = {"pool off": run_ranks(three_sources, ordering=OrderingConfig(), world_size=2, steps=12,
                                  batch_size=4),
            "pool 16 (batch)": run_ranks(three_sources, ordering=cfg, world_size=2, steps=12,
                                         batch_size=4)}
    plot_run(tmp_path / "inspect.png", runs=runs, micro_batches_per_step=2, window_steps=3,
             note="Why the mix is noisy with the pool: " + "a long note that wraps " * 12)
    assert saved_figures[str(tmp_path / "inspect.png")] == []
