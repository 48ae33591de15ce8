"""The synthetic dataset maker: real PNGs, length profiles, stable keys, energon prepare."""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from energon_ordering import OrderingConfig
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, record_batch
from energon_ordering.inspect.synthetic import (
    LENGTH_PROFILES,
    LengthProfile,
    SourceSpec,
    make_synthetic_dataset,
    sample_lengths,
)

TOOLS = Path(__file__).parent.parent / "tools"


def _members(folder: Path) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for shard in sorted(folder.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                out.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return out


def test_trimodal_profile_mix():
    lengths = sample_lengths(LENGTH_PROFILES["trimodal"], 20_000, seed=0)
    short = np.mean(lengths < 600)
    medium = np.mean((lengths >= 600) & (lengths < 2400))
    long = np.mean(lengths >= 2400)
    assert short == pytest.approx(0.50, abs=0.02)
    assert medium == pytest.approx(0.35, abs=0.02)
    assert long == pytest.approx(0.15, abs=0.02)
    assert np.median(lengths[lengths < 600]) == pytest.approx(300, rel=0.05)
    assert np.median(lengths[lengths >= 2400]) == pytest.approx(4000, rel=0.05)


def test_lengths_are_a_pure_function_of_the_seed():
    p = LENGTH_PROFILES["trimodal"]
    assert np.array_equal(sample_lengths(p, 100, 3), sample_lengths(p, 100, 3))
    assert not np.array_equal(sample_lengths(p, 100, 3), sample_lengths(p, 100, 4))


def test_dataset_content_and_stable_keys(tmp_path):
    specs = [SourceSpec("web", 40, "trimodal"), SourceSpec("code", 20, "long", weight=2.0)]
    meta = make_synthetic_dataset(tmp_path / "a", specs, shard_size=16)
    make_synthetic_dataset(tmp_path / "b", specs, shard_size=16)
    a = _members(tmp_path / "a" / "web")
    assert a == _members(tmp_path / "b" / "web")  # same seed -> byte-identical samples
    assert sorted(a) == [f"web-{i:08d}" for i in range(40)]
    for key, parts in a.items():
        assert set(parts) == {"png", "txt", "json"}
        img = Image.open(io.BytesIO(parts["png"]))
        assert img.format == "PNG" and img.size == (16, 16)
        info = json.loads(parts["json"])
        assert info["source"] == "web"
        assert info["text_tokens"] == len(parts["txt"].decode().split())
    code = _members(tmp_path / "a" / "code")
    assert np.median([json.loads(p["json"])["text_tokens"] for p in code.values()]) > 1500
    for src in ("web", "code"):
        assert (tmp_path / "a" / src / ".nv-meta" / "index.uuid").exists()
    assert "weight: 2.0" in meta.read_text()


def test_metadataset_blends_sources_with_subflavors(tmp_path):
    meta = make_synthetic_dataset(tmp_path, {"web": 64, "code": 64}, shard_size=16)
    loader = build_train_loader(meta, ordering=OrderingConfig(length_sort_pool_size=16))
    it = iter(loader)
    batches = [record_batch(next(it)) for _ in range(16)]
    del it
    close_loader(loader)
    sources = Counter(s for b in batches for s in b.sources)
    assert set(sources) == {"web", "code"}
    for b in batches:
        for key, src in zip(b.keys, b.sources):
            assert key.startswith(src + "-")


@pytest.mark.parametrize(
    "sources,match",
    [
        ([], r"`sources` is empty"),
        ([SourceSpec("web", 0)], r"num_samples = 0"),
        ([SourceSpec("a/b", 3)], r"name = 'a/b'"),
        ([SourceSpec("web", 3), SourceSpec("web", 3)], r"duplicate source names"),
        ([SourceSpec("web", 3, "nope")], r"profile = 'nope' is unknown"),
    ],
)
def test_bad_specs(tmp_path, sources, match):
    with pytest.raises(ValueError, match=match):
        make_synthetic_dataset(tmp_path, sources)


def test_bad_profile():
    with pytest.raises(ValueError, match=r"modes\[0\]"):
        LengthProfile(((1.0, -5, 0.1),))
    with pytest.raises(ValueError, match="sum to 0"):
        LengthProfile(((0.0, 5, 0.1),))


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_tool(tmp_path):
    tool = _tool("make_synthetic_dataset")
    runner = CliRunner()
    res = runner.invoke(tool.main, [str(tmp_path), "--source", "web=30:short", "--source",
                                    "code=10:long", "--shard-size", "8"])
    assert res.exit_code == 0, res.output
    assert "metadataset:" in res.output
    assert len(_members(tmp_path / "web")) == 30
    res = runner.invoke(tool.main, [str(tmp_path), "--source", "web=lots"])
    assert res.exit_code == 2 and "NAME=COUNT[:PROFILE]" in res.output
    res = runner.invoke(tool.main, [str(tmp_path), "--source", "web=3:nope"])
    assert res.exit_code == 1 and "profile = 'nope' is unknown" in res.output
