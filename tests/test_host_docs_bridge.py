"""docs/megatron-bridge.md runs as written against Megatron-Bridge 0.6.2 (issue 34).

The page's blocks go through the docs' own snippet runner (tests/doc_snippets.py) in this
process, on Python 3.12 with Bridge installed by the page's own install lines (``.ci/py312``
runs them to make its venv): the CPU stand-in for Transformer Engine, the dataset, the training
script up to its GPU-only ``pretrain`` (its ``ConfigContainer``, ``validate()`` and the provider's
``check_run`` against the packaged ``llava_pretrain`` recipe). The page's indexing call for a
Bridge built-in encoder runs with a local processor instead of the hub's. The install lines and
the ``[bridge]`` extra are checked on any Python.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_snippets import REPO, parse_blocks, run_page  # noqa: E402

PAGE = REPO / "docs" / "megatron-bridge.md"
needs_bridge = pytest.mark.skipif(sys.version_info < (3, 12),
                                  reason="Megatron-Bridge 0.6.2 needs Python 3.12 (.ci/py312)")


def test_every_block_is_run_or_marked():
    """Every block is run by the test below, or marked with why not (the runner refuses a
    marker without a reason); the page runs the stand-in, the data and train.py."""
    run = [b.language for b in parse_blocks(PAGE) if b.skip_reason is None and b.language != "text"]
    assert run == ["python", "bash", "python"]


def test_install_lines_are_what_ci_installs_and_the_extra_is_complete():
    """.ci/py312 makes its venv from the page's first bash block; the [bridge] extra holds
    torchvision (both built-in encoders) and diffusers (megatron.bridge.recipes)."""
    first = next(b for b in parse_blocks(PAGE) if b.language == "bash")
    assert "pip install --no-deps megatron-bridge==0.6.2 megatron-core==0.19.2" in first.code
    assert 'pip install -e ".[bridge]"' in first.code
    ci = (REPO / ".ci" / "py312").read_text()
    assert "docs/megatron-bridge.md" in ci and "torchvision" not in re.sub(r"#.*", "", ci)
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["bridge"]
    assert "torchvision==0.28.0" in extra
    assert any(d.startswith("diffusers") for d in extra)


@pytest.mark.py312
@needs_bridge
@pytest.mark.timeout(600)
def test_page_runs_as_written(tmp_path):
    ran = run_page(PAGE, tmp_path)
    assert len(ran) == 3
    assert (tmp_path / "data" / "metadataset.yaml").is_file()


@pytest.mark.py312
@needs_bridge
@pytest.mark.timeout(600)
def test_recipes_import_with_the_extra():
    """Importing megatron.bridge.recipes needs diffusers (in the [bridge] extra)."""
    import importlib

    from energon_ordering.integrations import bridge_cpu

    bridge_cpu.install()
    importlib.import_module("megatron.bridge.recipes")
    importlib.import_module("torchvision.transforms")


@pytest.mark.py312
@needs_bridge
@pytest.mark.timeout(600)
def test_builtin_encoder_is_indexed_as_the_page_says(tmp_path, monkeypatch):
    """The page's build_builtin_encoder + build_length_index call, with a local processor."""
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    from energon_ordering.integrations import bridge_cpu

    bridge_cpu.install()
    from bridge_chatml import MAX_PIXELS, MERGE, MIN_PIXELS, make_chatml_dataset, make_tiny_qwen_processor
    from megatron.bridge.data.builders.energon import QwenVLEnergonTaskEncoderConfig

    from energon_ordering import build_length_index
    from energon_ordering.integrations.bridge_encoders import BuiltinEncoderSettings, build_builtin_encoder
    from energon_ordering.length_index.index import LengthIndex

    data = make_chatml_dataset(tmp_path / "data", 24)
    proc = make_tiny_qwen_processor(tmp_path / "proc", 24)
    config = QwenVLEnergonTaskEncoderConfig(hf_processor_path=str(proc), patch_size=2,
                                            spatial_merge_size=MERGE, min_pixels=MIN_PIXELS,
                                            max_pixels=MAX_PIXELS, trust_remote_code=False)
    encoder = build_builtin_encoder(config, BuiltinEncoderSettings(seq_length=4096), path=str(data),
                                    micro_batch_size=1)
    build_length_index(str(data), task_encoder=encoder)
    index = LengthIndex.open(str(data))
    assert index.computed_by.endswith("OrderingQwenVLTaskEncoder")
    lengths = index.lengths()
    assert len(lengths) == 24 and min(lengths) > 0 and len(set(lengths)) > 1
