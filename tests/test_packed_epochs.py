"""Implied epochs under packing: ``packed_implied_epochs`` (pure) and ``plan`` with packing
recipes, whose global batch counts packs."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from energon_ordering.cli import main
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
from energon_ordering.mixture.packed_epochs import capped_mean_lengths, packed_implied_epochs
from energon_ordering.mixture.schedule import MixtureSchedule, implied_epochs
from energon_ordering.warmup.schedule import SeqLenWarmup

SIZES = {"a": 1000, "b": 100}


def _schedule() -> MixtureSchedule:
    return MixtureSchedule.from_dict({"phases": [{"until": 100, "weights": {"a": 0.75, "b": 0.25}}]})


def test_capped_mean_lengths_matches_brute_force():
    lengths = np.random.default_rng(0).integers(1, 5000, size=1000)
    caps = np.array([1, 100, 512, 2048, 4999, 10_000])
    expected = [np.minimum(lengths, c).mean() for c in caps]
    np.testing.assert_allclose(capped_mean_lengths(lengths, caps), expected)


def test_documents_per_pack_multiply_the_epochs():
    sched = _schedule()
    lengths = {"a": np.full(10, 512.0), "b": np.full(10, 512.0)}
    e = packed_implied_epochs(sched, 100, 8, SIZES, lengths, pack_seq_length=2048, fill=1.0)
    assert e.docs_per_pack == pytest.approx(4.0)
    plain = implied_epochs(sched, 100, 8, SIZES, warn_above=None)
    for s in SIZES:
        assert e[s] == pytest.approx(4 * plain[s])


def test_long_documents_fill_a_pack_alone_and_the_warmup_makes_fewer_documents_per_pack():
    sched = _schedule()
    long = {"a": np.full(4, 3000.0), "b": np.full(4, 9000.0)}
    assert packed_implied_epochs(sched, 100, 8, SIZES, long, pack_seq_length=2048).docs_per_pack == 1.0
    lengths = {"a": np.full(10, 256.0), "b": np.full(10, 256.0)}
    full = packed_implied_epochs(sched, 100, 8, SIZES, lengths, pack_seq_length=2048, fill=1.0)
    warm = packed_implied_epochs(sched, 100, 8, SIZES, lengths, pack_seq_length=2048, fill=1.0,
                                 max_seq_len=SeqLenWarmup(start=512, full=2048, warmup_steps=50).max_seq_len)
    assert full.docs_per_pack == pytest.approx(8.0)
    assert 2.0 < warm.docs_per_pack < 8.0
    assert warm["a"] < full["a"]


def test_bad_inputs_are_refused():
    sched = _schedule()
    with pytest.raises(ValueError, match=r"no size or lengths for sources \['b'\]"):
        packed_implied_epochs(sched, 10, 1, SIZES, {"a": np.ones(2)}, pack_seq_length=64)
    with pytest.raises(ValueError, match="fill = 0"):
        packed_implied_epochs(sched, 10, 1, SIZES, {"a": np.ones(2), "b": np.ones(2)},
                              pack_seq_length=64, fill=0)


SLM_SIZES = "web=40000000,code=5000000,books=2000000,curated=200000"


def _epochs(output: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(web|code|books|curated)\s+[\d,]+\s+([\d.]+)", output, re.M)}


def test_plan_counts_packs_and_says_where_documents_per_pack_come_from(tmp_path):
    runner = CliRunner()
    base = ["plan", "slm_350m_20b", "--global-batch-size", "512", "--source-sizes", SLM_SIZES,
            "--out", str(tmp_path)]
    lower = runner.invoke(main, base)
    assert lower.exit_code == 0, lower.output
    assert "19,073 steps x 512 packs" in lower.output and "LOWER BOUNDS" in lower.output
    est = runner.invoke(main, [*base, "--doc-tokens", "web=700,code=1200,books=4000,curated=600"])
    assert est.exit_code == 0, est.output
    assert "from an estimate from --doc-tokens" in est.output
    lo, hi = _epochs(lower.output), _epochs(est.output)
    # Documents of ~1,000 tokens: about two per 2,048-token pack, so about twice the epochs.
    assert 1.5 < hi["web"] / lo["web"] < 3.0
    m = re.search(r"documents per pack: ([\d.]+)", est.output)
    assert m and 1.5 < float(m.group(1)) < 3.0
    assert re.search(r"^curated .*!$", est.output, re.M)
    bad = runner.invoke(main, [*base, "--doc-tokens", "web=700"])
    assert bad.exit_code == 2 and "--doc-tokens" in bad.output and "missing" in bad.output


def test_plan_reads_documents_per_pack_from_the_length_indexes(tmp_path):
    meta = make_synthetic_dataset(
        tmp_path / "data", [SourceSpec("web", 40, "short"), SourceSpec("code", 40, "short"),
                            SourceSpec("books", 40, "short"), SourceSpec("curated", 40, "short")],
        shard_size=20)
    runner = CliRunner()
    args = ["plan", "slm_350m_20b", "--global-batch-size", "512", "--metadataset", str(meta),
            "--out", str(tmp_path)]
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "no length index for" in res.output and "LOWER BOUNDS" in res.output
    assert runner.invoke(main, ["index", str(meta)]).exit_code == 0
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "from the length indexes of --metadataset" in res.output
    # "short" documents: ~200 text tokens + 256 per image, about 4 per 2,048-token pack.
    m = re.search(r"documents per pack: ([\d.]+)", res.output)
    assert m and 3.0 < float(m.group(1)) < 5.0, res.output


def test_plan_refuses_doc_tokens_without_packing(tmp_path):
    res = CliRunner().invoke(main, ["plan", "demo", "--global-batch-size", "64", "--source-sizes",
                                    "caption=1000,vqa=1000,ocr=1000,curated=100", "--doc-tokens", "500",
                                    "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--doc-tokens is for packing recipes" in res.output
