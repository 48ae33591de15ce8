"""Megatron-LM's own examples/multimodal TaskEncoder indexed outside ``pretrain`` (issue 33).

The example's encoder reads Megatron's args and tokenizer when constructed, so it cannot be built
from the command line without them. ``task_encoder_with_megatron_args`` parses the training flags
with Megatron-LM's own parser and validation (core_v0.16.1: ``parse_args`` + ``validate_args`` +
``set_global_variables``; core_v0.19.0: ``parse_and_validate_args``), then builds the encoder,
whose lengths ``energon-ordering index ... --megatron-args "<flags>"`` writes (the CLI calls the same function). Run in a subprocess per tag (a Megatron module
imported once stays imported), with the tag's sources first on PYTHONPATH as a user's checkout
would be.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import megatron_lm_sources  # noqa: E402

from energon_ordering.errors import OrderingConfigError  # noqa: E402

HERE = Path(__file__).parent
_MISSING = [m for m in ("transformers", "tokenizers", "torchvision", "megatron.core")
            if importlib.util.find_spec(m) is None]


def megatron_flags(root: Path, tok: Path) -> str:
    """The multimodal example's model and tokenizer flags (what a training run passes)."""
    return (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 2 --language-model-type mistral_7b "
        "--seq-length 576 --decoder-seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 2 --global-batch-size 2 --train-iters 100 --bf16 "
        f"--tokenizer-type MultimodalTokenizer --tokenizer-model {tok} --tokenizer-prompt-format chatml "
        f"--prompt-path {root / 'examples' / 'multimodal' / 'manual_prompts.json'} "
        "--special-tokens <image> --img-h 336 --img-w 336 --patch-dim 14 --vision-model-type clip "
        "--dataloader-type external --seed 1234"
    )


DRIVER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import torchvision_cpu_shim, megatron_tokenizer_path_shim
    torchvision_cpu_shim.install()
    megatron_tokenizer_path_shim.install({tok!r})  # core 0.19.2's tokenizer path (NVIDIA/Megatron-LM#3465)
    from energon_ordering.errors import OrderingConfigError
    from energon_ordering.integrations.megatron_encoder import task_encoder_with_megatron_args
    from energon_ordering.length_index.index import LengthIndex
    from click.testing import CliRunner
    from energon_ordering.cli import main as cli
    out = {{}}
    # without the flags: one Error line naming --megatron-args (was a raw AssertionError)
    res = CliRunner().invoke(cli, ["index", {data!r}, "--task-encoder", "megatron_example_te:TE"])
    out["no_args"] = [res.exit_code, res.output.strip().splitlines()]
    try:
        task_encoder_with_megatron_args("megatron_example_te:TE", {flags!r} + " --no-such-flag 3")
    except OrderingConfigError as e:
        out["refused"] = str(e)
    res = CliRunner().invoke(cli, ["index", {data!r}, "--task-encoder", "megatron_example_te:TE",
                                   "--megatron-args", {flags!r}])  # the documented command
    out["cli"] = [res.exit_code, res.output[-3000:]]
    try:  # Megatron parses once per process
        task_encoder_with_megatron_args("megatron_example_te:TE", {flags!r})
    except OrderingConfigError as e:
        out["again"] = str(e)
    index = LengthIndex.open({data!r}, None, prefer=None)
    out.update(computed_by=index.computed_by, lengths=index.lengths())
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is not None,
                    reason="megatron.training is importable here")
def test_missing_megatron_training_is_one_line_saying_how_to_get_it():
    from energon_ordering.integrations.megatron_encoder import parse_megatron_args

    with pytest.raises(OrderingConfigError, match=r"megatron\.training.*PYTHONPATH=/path/to/Megatron-LM"):
        parse_megatron_args("--micro-batch-size 1")


def test_unbalanced_quotes_name_the_option():
    from energon_ordering.integrations.megatron_encoder import parse_megatron_args

    with pytest.raises(OrderingConfigError, match=r"--megatron-args = .*quote it"):
        parse_megatron_args("--tokenizer-model 'a b")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(_MISSING), reason=f"needs the [megatron] extra: {_MISSING}")
@pytest.mark.parametrize("tag", megatron_lm_sources.tag_params())
def test_example_encoder_indexed_with_megatron_args(tmp_path, tag):
    from test_megatron_real_client import build_tokenizer

    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    root = megatron_lm_sources.unpack(tag)
    make_synthetic_dataset(tmp_path / "data", [SourceSpec("web", 24, "trimodal")], shard_size=12)
    build_tokenizer(tmp_path / "tok")
    data = tmp_path / "data" / "web"
    script = DRIVER.format(tests=str(HERE), tok=str(tmp_path / "tok"), data=str(data),
                           flags=megatron_flags(root, tmp_path / "tok"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), str(root / "examples" / "multimodal"), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=800, cwd=tmp_path)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert "unrecognized arguments: --no-such-flag 3" in out["refused"]
    code, said = out["no_args"]
    errors = [ln for ln in said if ln.startswith("Error:")]  # (Megatron's import warnings aside)
    assert code == 2 and len(errors) == 1 and said[-1] == errors[0]
    assert errors[0].startswith("Error: --task-encoder megatron_example_te:TE reads Megatron-LM's arguments")
    assert "--megatron-args" in errors[0] and "is not initialized" in errors[0]
    assert out["cli"][0] == 0, out["cli"][1]
    assert "\n" not in out["refused"]
    assert "already set in this process" in out["again"]
    assert out["computed_by"].endswith("megatron_example_te.TE")
    # 24 samples, each weighed in model tokens: its image is Megatron's 577 embeddings per tile
    assert len(out["lengths"]) == 24
    assert all(length >= 577 for length in out["lengths"])
