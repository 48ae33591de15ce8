"""docs/megatron-lm.md runs as written against Megatron-LM's real code (issue 34).

The page's blocks go through the docs' own snippet runner (tests/doc_snippets.py: markers, file
blocks, python blocks) in a subprocess per tag whose PYTHONPATH holds the tag's Megatron-LM and
its examples/multimodal, as the page's install step sets it. Its ``train_ordered.py`` is then run
as written, ``main()`` with the training flags in ``sys.argv``, with a stand-in for ``pretrain``
that does what ``pretrain`` does before the model (a GPU's work): core 0.16's form parses the
flags with the ``extra_args_provider`` and ``args_defaults`` it was given; core 0.19's form
receives the config container of the args the script parsed. The stand-in then sets up the
process groups (gloo, one rank), calls the script's ``provider`` as Megatron calls it, and draws
micro-batches from the training iterator.

Two legs: core_v0.16.1 on the default Python (slow tier), core_v0.19.0 on Python 3.12 (``py312``).
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
from doc_snippets import REPO, parse_blocks  # noqa: E402

HERE = Path(__file__).parent
PAGE = REPO / "docs" / "megatron-lm.md"
_MISSING = [m for m in ("transformers", "tokenizers", "torchvision", "megatron.core")
            if importlib.util.find_spec(m) is None]

DRIVER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import torchvision_cpu_shim, megatron_tokenizer_path_shim
    torchvision_cpu_shim.install()
    megatron_tokenizer_path_shim.install({tok!r})  # the page's tokenizer-path fix (core 0.19.2)
    from doc_snippets import run_page
    folder = Path.cwd()
    ran = run_page(Path({page!r}), folder)
    sys.path.insert(0, str(folder))
    import train_ordered  # the page's file, as written

    out = {{"ran": [b.line for b in ran]}}

    def pretrain(*args, **kwargs):  # what pretrain does before the model
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.training import arguments

        if callable(args[0]):  # core 0.16: pretrain(provider, model_provider, type, step, ...)
            from megatron.training.global_vars import set_global_variables

            provider = args[0]
            margs = arguments.parse_args(extra_args_provider=kwargs["extra_args_provider"])
            arguments.validate_args(margs, kwargs["args_defaults"])
            set_global_variables(margs, build_tokenizer=True)
        else:  # core 0.19: pretrain(config container, provider, type, step, model_provider, ...)
            provider = args[1]
            out["container"] = type(args[0]).__name__
        out["hooks"] = sorted(kwargs)
        dist.init_process_group("gloo", init_method="file://" + str(folder / "init"), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        train, valid, _ = provider(None)
        out["keys"] = [list(next(train)["__key__"]) for _ in range(4)]
        out["valid"] = list(next(valid)["__key__"])

    train_ordered.pretrain = pretrain
    sys.argv = ["train_ordered.py", *{argv!r}]
    train_ordered.main()
    print("RESULT " + json.dumps(out))
""")


def test_every_block_is_run_or_marked():
    """A block of the page is written as a file the tests run, or says why it is not run."""
    blocks = parse_blocks(PAGE)
    assert [b.file_name for b in blocks if b.file_name] == ["train_ordered.py"]
    for b in blocks:
        assert b.file_name or b.skip_reason, f"{b.where}: neither run by the tests nor marked"


def test_flag_table_lists_every_flag():
    from energon_ordering.integrations.megatron_args import FLAGS

    rows = {line.split("`")[1] for line in PAGE.read_text().splitlines() if line.startswith("| `--")}
    assert rows == set(FLAGS)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(_MISSING), reason=f"needs the [megatron] extra: {_MISSING}")
@pytest.mark.parametrize("tag", megatron_lm_sources.tag_params())
def test_page_runs_against_megatron(tmp_path, tag):
    from test_megatron_real_client import _argv, build_tokenizer

    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    root = megatron_lm_sources.unpack(tag)
    make_synthetic_dataset(tmp_path / "data", [SourceSpec("web", 48, "trimodal")], shard_size=12)
    web = tmp_path / "data" / "web"
    meta = tmp_path / "meta.yaml"
    meta.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n"
                    f"  train:\n    path: {web}\n  val:\n    path: {web}\n    split_part: train\n")
    build_tokenizer(tmp_path / "tok")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    argv = _argv(root, meta, tmp_path, num_workers=0)
    argv[argv.index("--global-batch-size") + 1] = "4"  # one rank here: 2 micro-batches per step
    script = DRIVER.format(tests=str(HERE), tok=str(tmp_path / "tok"), page=str(PAGE), argv=argv)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531",
           "PYTHONPATH": os.pathsep.join([str(root), str(root / "examples" / "multimodal"),
                                          str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=800, cwd=run_dir)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert len(out["keys"]) == 4 and all(len(k) == 2 for k in out["keys"])  # --micro-batch-size 2
    assert out["valid"]
    assert {"get_embedding_ranks", "non_loss_data_func"} <= set(out["hooks"])  # the example's hooks
    if tag == "core_v0.19.0":
        assert out["container"] == "PretrainConfigContainer"


@pytest.mark.py312
@pytest.mark.skipif(importlib.util.find_spec("megatron.core.tokenizers") is None
                    or not megatron_lm_sources.installed_core_019(),
                    reason="needs megatron-core 0.19.x (.ci/py312)")
def test_tokenizer_path_fix_applies_to_megatron_core(tmp_path):
    """The page's fix for NVIDIA/Megatron-LM#3465, run on a copy of the installed
    build_tokenizer.py: the multimodal branch gains the tokenizer path, once, and compiles."""
    import types

    import megatron.core.tokenizers.utils.build_tokenizer as bt

    block = next(b for b in parse_blocks(PAGE) if "tokenizer_path = args.tokenizer_model" in b.code)
    fix = block.code.split("<<'EOF'\n", 1)[1].rsplit("EOF", 1)[0]
    fix = fix.replace("import pathlib, megatron.core.tokenizers.utils.build_tokenizer as bt", "import pathlib")
    copy = tmp_path / "build_tokenizer.py"
    copy.write_text(Path(bt.__file__).read_text())
    for _ in range(2):  # applying it again changes nothing
        exec(fix, {"bt": types.SimpleNamespace(__file__=str(copy))})  # noqa: S102
    text = copy.read_text()
    branch = text.split("elif args.tokenizer_type == 'MultimodalTokenizer':", 1)[1].split("elif", 1)[0]
    assert branch.count("tokenizer_path = args.tokenizer_model") == 1
    assert text.count("tokenizer_path = args.tokenizer_model") == \
        Path(bt.__file__).read_text().count("tokenizer_path = args.tokenizer_model") + 1
    compile(text, str(copy), "exec")
