"""``inspect`` and ``check-resume`` on packing recipes, the shipped ``slm_350m_20b`` included,
through the CLI's estimating encoder (``LengthEstimateTaskEncoder``), on a small metadataset with
the recipe's four sources."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from energon_ordering.cli import main
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

RECIPES = Path(__file__).parent.parent / "recipes"


@pytest.fixture(scope="module")
def slm_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """web, code, books and curated, as in ``slm_350m_20b`` (700 samples)."""
    root = tmp_path_factory.mktemp("slm")
    return make_synthetic_dataset(
        root,
        [SourceSpec("web", 300, "short"), SourceSpec("code", 200, "medium"),
         SourceSpec("books", 100, "long"), SourceSpec("curated", 100, "short")],
        shard_size=32,
    )


@pytest.fixture
def slm_scaled(tmp_path: Path) -> Path:
    """``slm_350m_20b`` scaled down to 200 steps, its warmup to 1 step: packs of several
    documents within a few micro-batches."""
    d = yaml.safe_load((RECIPES / "slm_350m_20b.yaml").read_text())
    d["total_steps"] = 200
    d["mixture_schedule"]["phases"][0]["until"] = 180
    d["mixture_schedule"]["phases"][1]["until"] = 200
    d["seq_length_warmup"]["warmup_steps"] = 1
    path = tmp_path / "slm_scaled.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def test_inspect_runs_the_shipped_packing_recipe(slm_sources, tmp_path):
    res = CliRunner().invoke(main, ["inspect", str(slm_sources), "--recipe", "slm_350m_20b",
                                    "--ranks", "2", "--steps", "12", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "documents per pack" in res.output
    assert (tmp_path / "inspect.png").is_file()


def test_inspect_reports_packs_of_several_documents(slm_sources, slm_scaled, tmp_path):
    from energon_ordering.cli.inspect import run_inspection
    from energon_ordering.cli.recipe import load_recipe

    results, extra = run_inspection(str(slm_sources), load_recipe(str(slm_scaled)), ranks=2,
                                    steps=24, num_workers=0, batch_size=4, out=tmp_path)
    assert extra["packed"]
    for name, m in results.items():
        # Past the 1-step warmup the 2,048-token packs hold several ~400-2,000-token documents.
        assert m.docs_per_pack > 1.2, (name, m)
        assert set(m.sources) <= {"web", "code", "books", "curated"} and len(m.sources) >= 3
        assert m.overlapping_keys == 0
        assert 0 <= m.padding_waste < 0.5


@pytest.mark.parametrize("cut,workers", [(5, 0), (13, 2)])
def test_check_resume_runs_the_shipped_packing_recipe(slm_sources, cut, workers):
    # The warmup cap rises at almost every step (multiple_of 1) and a document that waits in
    # the packer's buffer is cut again at the next cap: its restore key names both cuts.
    res = CliRunner().invoke(main, ["check-resume", str(slm_sources), "--recipe", "slm_350m_20b",
                                    "--cut", str(cut), "--steps", "24",
                                    "--num-workers", str(workers)])
    assert res.exit_code == 0, res.output
    assert "are identical" in res.output


def test_check_resume_scaled_packing_recipe_past_warmup(slm_sources, slm_scaled):
    res = CliRunner().invoke(main, ["check-resume", str(slm_sources), "--recipe", str(slm_scaled),
                                    "--cut", "17", "--steps", "30"])
    assert res.exit_code == 0, res.output
    assert "are identical" in res.output
