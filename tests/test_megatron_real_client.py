"""The real client: Megatron-LM's own examples/multimodal TaskEncoder, unmodified, per tag.

Each of two gloo processes runs Megatron-LM's real argument parsing as the tag's
``examples/multimodal/train.py`` does (core_v0.16.1: ``parse_args`` + ``validate_args`` +
``set_global_variables``, as ``pretrain`` runs them; core_v0.19.0: ``parse_and_validate_args``),
with the example's ``add_multimodal_extra_args`` and our ``add_energon_ordering_args``. That builds
Megatron's multimodal tokenizer over a tiny tokenizer made here with ``tokenizers`` (no hub
download). Then our provider with ``class TE(OrderingTaskEncoder, TaskEncoder)`` over
``CaptioningSample`` shares written and ``energon prepare``d here. Megatron's real
``RerunDataIterator`` wraps the iterator and its real ``maybe_save_dataloader_state`` writes the
state, as in ``pretrain()``. The model side is emulated as the multimodal ``model_provider``
leaves the args: ``--seq-length 576`` (image embeddings), the language model's length in
``--decoder-seq-length``.

Two legs, one test body:

- core_v0.16.1 on the default Python with megatron-core 0.16.1, transformers 4.x (Megatron-LM's
  own ``megatron.training.tokenizer``), torchvision 0.28.0 with ``torchvision_cpu_shim`` (see there
  why);
- core_v0.19.0 on Python 3.12 with megatron-core 0.19.x (marked ``py312``, run by ``.ci/py312``),
  transformers 5 (megatron-core's ``megatron.core.tokenizers``), torchvision 0.28.0, and
  ``megatron_tokenizer_path_shim`` for megatron-core 0.19.2's missing tokenizer path (see there).

``--special-tokens <image>`` is passed explicitly: in core_v0.19.0 Megatron's own
``--tokenizer-special-tokens`` (dest ``special_tokens``, default None) is registered before the
example's ``--special-tokens`` (default ``[<image>]``), and argparse keeps the first default, so
without the flag 0.19 builds its tokenizer with no image token. It is the example's default value,
so the 0.16.1 leg is unchanged by it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import string
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import megatron_lm_sources  # noqa: E402

WORLD = 2
MBPS = 2  # micro-batches per step: --global-batch-size 8 / (--micro-batch-size 2 x 2 ranks)
CUT_STEPS = 3
MORE = 8
WARMUP = dict(start=600, full=1024, steps=20, multiple=8)

_MISSING = [m for m in ("transformers", "tokenizers", "triton", "torchvision", "megatron.core")
            if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_MISSING), reason=f"needs the [megatron] extra: {_MISSING}")]


TAGS = megatron_lm_sources.tag_params()

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_tokenizer(out: Path) -> None:
    """A word-level tokenizer with a chatml template, saved for transformers' AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<|im_start|>": 2, "<|im_end|>": 3}
    words = ("user assistant system \n . , ? ! : a the of and to in is image picture photo describe "
             "caption short brief this what shows").split(" ") + list(string.ascii_lowercase + string.digits)
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.WhitespaceSplit()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(out)


def _argv(root: Path, data: Path, out: Path, num_workers: int) -> list[str]:
    return (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 2 --language-model-type mistral_7b "
        "--seq-length 576 --decoder-seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 100 --bf16 --no-gradient-accumulation-fusion "
        f"--tokenizer-type MultimodalTokenizer --tokenizer-model {out / 'tok'} --tokenizer-prompt-format chatml "
        f"--prompt-path {root / 'examples' / 'multimodal' / 'manual_prompts.json'} "
        "--special-tokens <image> --img-h 336 --img-w 336 --patch-dim 14 --vision-model-type clip "
        f"--data-path {data} --dataloader-type external --dataloader-save {out / 'dl'} "
        f"--num-workers {num_workers} --eval-iters 2 --seed 1234 "
        "--length-sort-pool-size 16 --length-sort-mode batch "
        f"--seq-length-warmup-steps {WARMUP['steps']} --seq-length-warmup-start {WARMUP['start']} "
        f"--seq-length-warmup-multiple-of {WARMUP['multiple']}"
    ).split()


def _model_tokens(batch: dict, pad: int, emb: int) -> list[int]:
    """Per sample: what the language model sees (text + each image's tiles x embeddings)."""
    tiles = batch["num_tiles"].tolist()  # one image per captioning sample
    return [int((row != pad).sum()) - 1 + t * emb for row, t in zip(batch["tokens"], tiles)]


def _worker(rank: int, tag: str, phase: str, num_workers: int, data: str, out: str) -> None:
    import megatron_tokenizer_path_shim
    import torchvision_cpu_shim

    torchvision_cpu_shim.install()
    root = megatron_lm_sources.use_megatron_lm(tag, multimodal_example=True)
    megatron_tokenizer_path_shim.install(str(Path(out) / "tok"))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    result: dict = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.rerun_state_machine import RerunDataIterator
        from megatron.training import arguments
        from megatron.training.checkpointing import maybe_save_dataloader_state
        from megatron.training.global_vars import set_global_variables
        from multimodal_args import add_multimodal_extra_args

        from energon_ordering.integrations.megatron_lm import add_energon_ordering_args, train_valid_test_dataloaders_provider
        from energon_ordering.warmup.schedule import SeqLenWarmup

        sys.argv = ["train.py", *_argv(root, Path(data), Path(out), num_workers)]
        extra = lambda p: add_energon_ordering_args(add_multimodal_extra_args(p))  # noqa: E731
        if hasattr(arguments, "parse_and_validate_args"):  # core_v0.19.0's train.py
            args = arguments.parse_and_validate_args(extra_args_provider=extra,
                                                     args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        else:  # core_v0.16.1: pretrain() -> initialize_megatron() runs these
            args = arguments.parse_args(extra_args_provider=extra)
            arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            set_global_variables(args, build_tokenizer=True)
        if phase == "resume":  # what load_checkpoint leaves in the args
            args.load, args.iteration = str(Path(out) / "ckpt"), CUT_STEPS
        dist.init_process_group("gloo", init_method=f"file://{out}/init_{phase}", rank=rank, world_size=WORLD)
        parallel_state.initialize_model_parallel(1, 1)

        from megatron_example_te import TE

        te = TE()
        train, valid, _ = train_valid_test_dataloaders_provider(None, te)
        it = RerunDataIterator(train)  # as pretrain() wraps an external loader
        pad, emb = te.tokenizer.pad, te.num_image_embeddings_per_tile
        warm = SeqLenWarmup(start=WARMUP["start"], full=WARMUP["full"], warmup_steps=WARMUP["steps"],
                            multiple_of=WARMUP["multiple"])

        def draw(n: int, first_step: int) -> list:
            rows = []
            for i in range(n):
                b = next(it)
                step = first_step + i // MBPS
                rows.append({"keys": list(b["__key__"]), "model": _model_tokens(b, pad, emb),
                             "cap": warm.max_seq_len(step)})
            return rows

        if phase == "first":
            result["before"] = draw(CUT_STEPS * MBPS, 0)
            maybe_save_dataloader_state(it, CUT_STEPS, args.dataloader_save)  # Megatron's own saver
        result["after"] = draw(MORE, CUT_STEPS)
        evals = [[list(next(valid)["__key__"]) for _ in range(args.eval_iters * MBPS)] for _ in range(2)]
        result["evals"] = evals
        result["layout"] = [te.ordering_token_layout.media_token_id, te.ordering_token_layout.media_embeddings]
        result["img_token_id"], result["emb"] = te.img_token_id, emb
        if phase == "first" and rank == 0:  # check-resume on Megatron's encoder (dict batches)
            from click.testing import CliRunner

            from energon_ordering.cli import main

            recipe = Path(out) / "recipe.yaml"
            recipe.write_text("length_sort_pool_size: 16\nlength_sort_mode: batch\nseed: 3\n")
            res = CliRunner().invoke(main, ["check-resume", data, "--recipe", str(recipe), "--cut", "5",
                                            "--steps", "10", "--batch-size", "2", "--num-workers", str(num_workers),
                                            "--task-encoder", "megatron_example_te:TEForCheckResume"])
            result["check_resume"] = [res.exit_code, res.output[-2000:]]
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # reported to the test
        import traceback

        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    Path(out, f"{phase}_rank{rank}.json").write_text(json.dumps(result))


def _spawn(out: Path, data: Path, tag: str, phase: str, num_workers: int) -> list[dict]:
    args = (tag, phase, num_workers, str(data), str(out))
    return megatron_lm_sources.spawn_ranks(_worker, args, out, phase, WORLD, "the 2-process run")


@pytest.fixture(scope="module")
def captioning_data(tmp_path_factory) -> Path:
    """CaptioningSample shards (image + caption) with train and val splits, and the tokenizer."""
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    root = tmp_path_factory.mktemp("rc")
    make_synthetic_dataset(root / "data", [SourceSpec("web", 240, "trimodal")], shard_size=24)
    meta = root / "meta.yaml"
    web = root / "data" / "web"
    meta.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n"
                    f"  train:\n    path: {web}\n  val:\n    path: {web}\n    split_part: train\n")
    build_tokenizer(root / "tok")
    return meta


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("tag", TAGS)
def test_megatron_multimodal_encoder_builds_cuts_and_resumes(captioning_data, tmp_path, tag, num_workers):
    out = tmp_path
    (out / "tok").symlink_to(captioning_data.parent / "tok")
    first = _spawn(out, captioning_data, tag, "first", num_workers)
    resumed = _spawn(out, captioning_data, tag, "resume", num_workers)
    for a, b in zip(first, resumed):
        # the warmup counted model tokens with Megatron's layout (<image> x 577 embeddings)
        assert a["layout"] == [a["img_token_id"], a["emb"]] and a["emb"] == 577
        # resume continues with exactly the same micro-batches
        assert [r["keys"] for r in b["after"]] == [r["keys"] for r in a["after"]], f"rank {a['rank']}"
        assert [r["model"] for r in b["after"]] == [r["model"] for r in a["after"]]
        # every sample is within the warmup cap of its step, in MODEL tokens
        rows = a["before"] + a["after"]
        assert all(m <= r["cap"] for r in rows for m in r["model"])
        assert any(m > r["cap"] - 40 for r in rows for m in r["model"])  # the caps bind
        # the same validation batches at every evaluation, before and after the resume
        assert a["evals"][0] == a["evals"][1] == b["evals"][0]
    assert first[0]["check_resume"][0] == 0, first[0]["check_resume"][1]
    keys = [{k for r in res["before"] + res["after"] for k in r["keys"]} for res in first]
    assert not keys[0] & keys[1]  # the two data-parallel ranks read disjoint samples
