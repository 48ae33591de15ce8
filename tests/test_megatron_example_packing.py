"""Megatron-LM's own examples/multimodal TaskEncoder, unmodified, packing under the warmup.

Its ``select_samples_to_pack`` packs with ``greedy_knapsack(..., self.packing_seq_length)``, a
constant: before the mixin held packers to the caps, its packs exceeded the warmup cap of their
step in most steps. The mixin now sets the encoder's ``packing_seq_length`` to the round's target
for the duration of each call (:class:`~energon_ordering.warmup.pack_cap.PackCapPrePacker`), so
its own packer builds packs that fit. One spawned process (core_v0.16.1's sources, as
tests/test_megatron_real_client.py): Megatron's real argument parsing and tokenizer, the
example's encoder with ``class TE(OrderingTaskEncoder, TaskEncoder)``, a loader with
``--packing-buffer-size`` and ``--packing-seq-length`` and the warmup, then the same loader
restored at two cuts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import megatron_lm_sources  # noqa: E402
from test_megatron_real_client import build_tokenizer  # noqa: E402

TAG = "core_v0.16.1"
WARMUP = dict(start=640, full=1536, steps=12, multiple=64)
PACK = 1536
MBPS = 2  # --global-batch-size 4 / --micro-batch-size 2 on one rank
TOTAL, CUTS = 16, (3, 9)

_MISSING = [m for m in ("transformers", "tokenizers", "triton", "torchvision", "megatron.core")
            if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(_MISSING), reason=f"needs the [megatron] extra: {_MISSING}"),
    pytest.mark.skipif(not megatron_lm_sources.have_sources(TAG), reason=f"no Megatron-LM {TAG} sources"),
]


#: Issue 23: the planned order plans the packs itself (the example's select_samples_to_pack is
#: not called; its pack_selected_samples packs each planned pack).
PLANNED_FLAGS = ("--length-sort-mode planned --length-sort-placement pre-encode "
                 "--length-sort-pool-holds keys --plan-window-steps 4")


def _argv(root: Path, data: Path, out: Path, num_workers: int, planned: bool = False) -> list[str]:
    return (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 2 --language-model-type mistral_7b "
        f"--seq-length 576 --decoder-seq-length {PACK} --max-position-embeddings {PACK} "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 100 --bf16 --no-gradient-accumulation-fusion "
        f"--tokenizer-type MultimodalTokenizer --tokenizer-model {out / 'tok'} --tokenizer-prompt-format chatml "
        f"--prompt-path {root / 'examples' / 'multimodal' / 'manual_prompts.json'} "
        "--special-tokens <image> --img-h 336 --img-w 336 --patch-dim 14 --vision-model-type clip "
        f"--data-path {data} --dataloader-type external --num-workers {num_workers} --seed 1234 "
        f"--packing-buffer-size 16 --packing-seq-length {PACK} "
        f"--seq-length-warmup-steps {WARMUP['steps']} --seq-length-warmup-start {WARMUP['start']} "
        f"--seq-length-warmup-multiple-of {WARMUP['multiple']}"
        + (f" {PLANNED_FLAGS}" if planned else "")
    ).split()


def _worker(rank: int, num_workers: int, data: str, out: str, planned: bool = False) -> None:
    import torchvision_cpu_shim

    torchvision_cpu_shim.install()
    root = megatron_lm_sources.use_megatron_lm(TAG, multimodal_example=True)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    result: dict = {"rank": rank}
    try:
        from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
        from megatron.training import arguments
        from megatron.training.global_vars import set_global_variables
        from multimodal_args import add_multimodal_extra_args

        from energon_ordering.inspect.diagnostics import warmup_counts
        from energon_ordering.inspect.rank_simulation import close_loader, resume, run_with_cuts
        from energon_ordering.integrations.megatron_args import ordering_config_from_args
        from energon_ordering.integrations.megatron_lm import add_energon_ordering_args, megatron_token_layout
        from energon_ordering.warmup.pack_cap import pack_target

        sys.argv = ["train.py", *_argv(root, Path(data), Path(out), num_workers, planned)]
        args = arguments.parse_args(extra_args_provider=lambda p: add_energon_ordering_args(add_multimodal_extra_args(p)))
        arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        set_global_variables(args, build_tokenizer=True)

        from megatron_example_te import TE

        cfg = ordering_config_from_args(args)
        states: dict = {}
        if planned:  # the length index, measured by the example's own encoder
            from energon_ordering.length_index.build import build_length_index

            from megatron.energon import SampleDecoder

            te = TE()
            te.ordering_token_layout = megatron_token_layout(te)
            te.decoder = SampleDecoder(image_decode="pil")  # as the loader below decodes
            build_length_index(data, task_encoder=te)

        def make(exact_checkpoints=False):
            te = TE()
            te.ordering = cfg
            te.ordering_token_layout = megatron_token_layout(te)
            ds = get_train_dataset(str(data), batch_size=2, task_encoder=te,
                                   worker_config=WorkerConfig(rank=0, world_size=1, num_workers=num_workers),
                                   max_samples_per_sequence=16, shuffle_buffer_size=None, image_decode="pil",
                                   packing_buffer_size=args.packing_buffer_size)
            # a worker checkpoint after every micro-batch: the saved counters are current
            # (diagnostics.EXACT_LOADER)
            exact = dict(checkpoint_every_sec=0, checkpoint_every_min_n_samples=1)
            return get_savable_loader(ds, **(exact if exact_checkpoints else {}))

        def record(batch):
            return [list(batch["__key__"]), [int(cu[-1]) for cu in batch["cu_lengths"]]]

        full, states = run_with_cuts(make, TOTAL, CUTS, record=record)
        result["full"] = full
        result["caps"] = [pack_target(b // MBPS, cfg.pack_seq_length, cfg.seq_length_warmup) for b in range(TOTAL)]
        result["resumed"] = {str(c): resume(make, s, TOTAL - c, record=record) for c, s in states.items()}
        loader = make(exact_checkpoints=True)
        it = iter(loader)
        for _ in range(TOTAL):
            next(it)
        result["counts"] = {} if planned else warmup_counts(loader.save_state_rank())
        del it
        close_loader(loader)
    except Exception as e:  # reported to the test
        import traceback

        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    Path(out, f"run_rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def captioning_data(tmp_path_factory) -> Path:
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    root = tmp_path_factory.mktemp("mlm-pack")
    make_synthetic_dataset(root / "data", [SourceSpec("web", 160, "trimodal")], shard_size=32)
    build_tokenizer(root / "tok")
    return root / "data" / "web"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("num_workers,planned", [(0, False), (2, False), (2, True)])
def test_megatron_example_packer_respects_the_warmup_caps_and_resumes(captioning_data, tmp_path,
                                                                      num_workers, planned):
    (tmp_path / "tok").symlink_to(captioning_data.parent.parent / "tok")
    (res,) = megatron_lm_sources.spawn_ranks(
        _worker, (num_workers, str(captioning_data), str(tmp_path), planned),
        tmp_path, "run", 1, "the example packer run", timeout=900)
    over = [(b, t, cap) for b, ((_, totals), cap) in enumerate(zip(res["full"], res["caps"]))
            for t in totals if t > cap]
    assert not over, f"packs over the cap of their step (micro-batch, tokens, cap): {over}"
    assert res["caps"][0] < PACK  # the warmup binds: before the fix its packs held up to PACK tokens
    if num_workers == 0:  # (with 2 workers each one's first round of packs lasts the 16 micro-batches)
        assert any(t > res["caps"][0] for _, totals in res["full"] for t in totals)  # packs follow the cap up
    if planned:  # the plan's packs follow the cap up from the first step
        assert any(t > res["caps"][0] for _, totals in res["full"] for t in totals)
    else:
        assert res["counts"]["packs_over_cap"] == 0  # its own packs fit: nothing re-split
    for cut, resumed in res["resumed"].items():
        assert resumed == res["full"][int(cut):], f"cut {cut}: the resumed packs differ"
