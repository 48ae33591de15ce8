"""The lockstep stop under Megatron-LM's real training loop: ``pretrain()`` -> ``train()``, on gloo.

Two processes run Megatron-LM's own ``megatron.training.pretrain`` (its ``initialize_megatron``,
``setup_model_and_optimizer``, ``build_train_valid_test_data_iterators``, ``train`` with
``train_step`` / ``forward_backward_func`` / the optimizer, ``training_log``,
``checkpoint_and_decide_exit`` and the final ``save_checkpoint``) with a tiny megatron-core
``GPTModel`` (one layer, hidden size 32), ``--distributed-backend gloo``, and our provider over
FINITE data (``repeat=False``) whose two data-parallel shares end after different numbers of
micro-batches. The model provider and ``forward_step`` are the user's code (as in
``pretrain_gpt.py``): the step draws one micro-batch through the iterator Megatron passes it
(its ``RerunDataIterator`` around ours), feeds the batch's tokens to the model and returns its
loss. Two legs, one body: core_v0.16.1 on the default Python (``pretrain`` parses the args), and
core_v0.19.0 with megatron-core 0.19.x on Python 3.12 (marked ``py312``; ``parse_and_validate_args``
then ``pretrain(pretrain_cfg_container_from_args(args), ...)``, 0.19's calling convention).

What it shows: when one rank's data ends, both ranks stop after the same iteration (the last
one every rank can fill), ``pretrain`` and thus ``train`` return normally (no ``StopIteration``,
no exception, no hang), and Megatron's own end-of-training path runs: the final
``save_checkpoint`` at that iteration, with each rank's dataloader state beside the model. A
second run loads Megatron's checkpoint of iteration 2 (``--load --ckpt-step 2``, the real
``load_checkpoint``) and draws exactly the remaining micro-batches to the same end; a run that
loads the final checkpoint draws nothing and ends at once. Both with ``--num-workers 0`` and with
Megatron's default ``--num-workers 2`` (Energon's loader worker processes; marked slow).

The planned order runs there too: resumed on one rank from the 2-rank run's checkpoint (elastic),
with and without packing, and under ``--rampup-batch-size`` / ``--step-batch-size-schedule``
(repeating data, ``--train-samples``):
exact from a checkpoint inside a plan step, elastic from one at a step boundary.

CPU only: ``megatron_cpu_device_shim`` maps Megatron's CUDA device plumbing to the CPU (see there
what and why); the loop, the optimizer, the checkpointing and the data path are Megatron's.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import megatron_lm_sources  # noqa: E402

from energon_ordering import OrderingConfig  # noqa: E402
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader  # noqa: E402

WORLD = 2
MBS = 4
MBPS = 2  # micro-batches per iteration: --global-batch-size 16 / (--micro-batch-size 4 x 2 ranks)
CUT = 2  # the iteration of the intermediate checkpoint (--save-interval 2)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="needs the [megatron] extra")]


TAGS = megatron_lm_sources.tag_params()


#: The planned order's flags (with a length index built by the provider's task encoder).
PLANNED_FLAGS = ("--length-sort-mode planned --length-sort-placement pre-encode "
                 "--length-sort-pool-holds keys --plan-window-steps 2")
POOL_FLAGS = "--length-sort-pool-size 32 --length-sort-mode batch"
#: --packing-seq-length of the packed planned run (packs of the plan, the default packer).
PACK = 1024
#: The batch-size ramp-up run (repeating data; Megatron-LM ramps up only by --train-samples):
#: the global batch grows 8 -> 16 over the first 64 samples, so iterations 1-8 draw one
#: micro-batch per rank and the next six two; --save-interval 3 cuts inside a plan step.
#: core_v0.19.0 ignores --rampup-batch-size; its --step-batch-size-schedule does the same ramp
#: (thresholds in tokens: 64 samples of --seq-length 64; it refuses --global-batch-size beside it).
RAMP_LENGTH = {"core_v0.16.1": f"--global-batch-size {MBS * WORLD * MBPS} --train-samples 160 "
                               "--rampup-batch-size 8 8 64",
               "core_v0.19.0": "--train-samples 160 --step-batch-size-schedule 0:8,4096:16"}
RAMP_CUT = 3


def _argv(out: Path, data: Path, phase: str, num_workers: int, load_step: int | None,
          world: int = WORLD, ordering: str = POOL_FLAGS,
          length: str = f"--global-batch-size {MBS * WORLD * MBPS} --train-iters 100",
          save_interval: int = CUT) -> list[str]:
    # --clip-grad 0: megatron-core's clip_grad_by_total_norm_fp32 asserts CUDA gradients
    # (``param.grad.type() == 'torch.cuda.FloatTensor'``); the fusion flags off: CUDA kernels.
    argv = (
        "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 64 --max-position-embeddings 64 "
        f"--micro-batch-size {MBS} {length} "
        "--lr 1e-3 --lr-decay-style constant --clip-grad 0.0 "
        "--tokenizer-type NullTokenizer --vocab-size 128 --distributed-backend gloo "
        "--transformer-impl local --position-embedding-type learned_absolute --use-cpu-initialization "
        "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion "
        "--no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm "
        f"--save {out / phase} --save-interval {save_interval} --ckpt-format torch --eval-iters 0 --eval-interval 1000 "
        f"--log-interval 1 --seed 1234 --data-path {data} --dataloader-type external --num-workers {num_workers} "
        f"--dataloader-save {out / 'first'} {ordering}"
    ).split()
    if load_step is not None:
        argv += ["--load", str(out / "first"), "--ckpt-step", str(load_step)]
    return argv


def _worker(rank: int, tag: str, phase: str, data: str, out: str, num_workers: int,
            load_step: int | None, world: int = WORLD, planned: bool = False,
            packed: bool = False, ramp: bool = False, mix: str = "step") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    megatron_lm_sources.use_megatron_lm(tag)
    import megatron_cpu_device_shim

    megatron_cpu_device_shim.install()
    import torch
    import torch.distributed as dist

    result: dict = {"rank": rank, "drawn": []}
    try:
        from megatron.core.enums import ModelType
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.training import get_args, pretrain
        from megatron.training.arguments import core_transformer_config_from_args

        from energon_ordering.inspect.synthetic_task import (
            IndexedSyntheticTaskEncoder,
            SyntheticTaskEncoder,
        )
        from energon_ordering.integrations.megatron_lm import (
            add_energon_ordering_args,
            train_valid_test_dataloaders_provider,
        )

        def extra_args(parser):  # --dataloader-save as examples/multimodal/multimodal_args.py adds it
            parser.add_argument("--dataloader-save", type=str, default=None)
            if packed:  # and its packing flags
                parser.add_argument("--packing-buffer-size", type=int, default=None)
                parser.add_argument("--packing-seq-length", type=int, default=0)
            return add_energon_ordering_args(parser)

        def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
            args = get_args()
            return GPTModel(config=config or core_transformer_config_from_args(args),
                            transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                            max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                            post_process=post_process, position_embedding_type="learned_absolute")

        def forward_step(data_iterator, model):
            args = get_args()
            batch = next(data_iterator)
            result["drawn"].append(list(batch.keys))
            width = args.seq_length + 1
            tok = batch.tokens[:, :width] % args.padded_vocab_size
            tok = torch.nn.functional.pad(tok, (0, width - tok.shape[1]))
            tokens, labels = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
            position_ids = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
            causal = torch.ones(1, 1, args.seq_length, args.seq_length, dtype=torch.bool).tril().logical_not()
            output = model(tokens, position_ids, causal, labels=labels)

            def loss_func(per_token_loss):
                loss = per_token_loss.float().mean()
                return loss, {"lm loss": loss.detach()}

            return output, loss_func

        encoder = IndexedSyntheticTaskEncoder() if planned else SyntheticTaskEncoder()
        provider = functools.partial(train_valid_test_dataloaders_provider, task_encoder=encoder,
                                     repeat=ramp, image_decode=None)  # the ramp-up run repeats
        provider.is_distributed = True
        flags = f"{PLANNED_FLAGS} --planned-mix {mix}" if planned else POOL_FLAGS
        if packed:
            flags += f" --packing-buffer-size 16 --packing-seq-length {PACK}"
        run = dict(length=RAMP_LENGTH[tag], save_interval=RAMP_CUT) if ramp else {}
        sys.argv = ["pretrain_gpt.py", *_argv(Path(out), Path(data), phase, num_workers, load_step,
                                              world, flags, **run)]
        store = dist.FileStore(str(Path(out) / f"store_{phase}"), world)
        from megatron.training import arguments

        if hasattr(arguments, "parse_and_validate_args"):  # core_v0.19.0: args first, then a config
            from megatron.training.argument_utils import pretrain_cfg_container_from_args

            args = arguments.parse_and_validate_args(extra_args_provider=extra_args)
            pretrain(pretrain_cfg_container_from_args(args), provider, ModelType.encoder_or_decoder,
                     forward_step, model_provider, store=store)
        else:  # core_v0.16.1: pretrain() parses the args itself
            pretrain(provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                     extra_args_provider=extra_args, store=store)
        args = get_args()
        result.update(returned=True, train_iters=args.train_iters, loaded_iteration=args.iteration)
    except BaseException as e:  # noqa: BLE001 - SystemExit too: reported to the test
        import traceback

        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    Path(out, f"{phase}_rank{rank}.json").write_text(json.dumps(result))


def _spawn(out: Path, data: Path, tag: str, phase: str, num_workers: int,
           load_step: int | None = None, world: int = WORLD, planned: bool = False,
           packed: bool = False, ramp: bool = False, mix: str = "step") -> list[dict]:
    args = (tag, phase, str(data), str(out), num_workers, load_step, world, planned, packed, ramp,
            mix)
    return megatron_lm_sources.spawn_ranks(_worker, args, out, phase, world, "Megatron's training loop")


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("tag", TAGS)
def test_finite_data_ends_megatrons_real_training_loop_on_every_rank_at_once(tmp_path, tag, num_workers):
    """``--num-workers 2`` is Megatron's default: Energon's loader then runs worker processes,
    and a state asked for between ``iter(loader)`` and the first batch would hang."""
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

    # 81 samples: the two ranks' shares end after different numbers of micro-batches of 4
    make_synthetic_dataset(tmp_path / "data", [SourceSpec("web", 81, "short")], shard_size=10)
    data = tmp_path / "data" / "web"
    alone = []
    for rank in range(WORLD):
        loader = build_train_loader(data, ordering=OrderingConfig(length_sort_pool_size=32, length_sort_mode="batch"),
                                    rank=rank, world_size=WORLD, batch_size=MBS, repeat=False)
        alone.append(sum(1 for _ in loader))
        close_loader(loader)
    full_steps = min(alone) // MBPS  # the last iteration every rank can fill
    # the shares differ (one rank holds a micro-batch more) and end long before --train-iters 100:
    # without the lockstep a rank's forward_step raises StopIteration inside train()
    assert alone[0] != alone[1] and full_steps > CUT, alone

    first = _spawn(tmp_path, data, tag, "first", num_workers)
    for r in first:
        assert r["returned"] and r["train_iters"] == full_steps  # pretrain() and train() returned
        assert len(r["drawn"]) == MBPS * full_steps  # both ranks stopped after the same iteration
    # Megatron's end of training: the final save_checkpoint at that iteration, dataloader states beside
    ckpt = tmp_path / "first"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(full_steps)
    import torch

    for it in (CUT, full_steps):  # the regular save (--save-interval) and the final one
        folder = ckpt / f"iter_{it:07d}" / "mp_rank_00"
        assert torch.load(folder / "model_optim_rng.pt", weights_only=False)["iteration"] == it
        for dp in range(WORLD):
            assert (folder / f"train_dataloader_dprank{dp:03d}.pt").is_file()

    # Megatron's load_checkpoint of its final checkpoint: the data has ended, nothing is drawn
    # and training ends at once (the state saved at the end of a finite run, issue 22)
    ended = _spawn(tmp_path, data, tag, "resume_end", num_workers, load_step=full_steps)
    for r in ended:
        assert r["returned"] and r["loaded_iteration"] == full_steps == r["train_iters"]
        assert r["drawn"] == []

    # Megatron's load_checkpoint at iteration CUT: the rest of the epoch, to the same end
    resumed = _spawn(tmp_path, data, tag, "resume", num_workers, load_step=CUT)
    for a, b in zip(first, resumed):
        assert b["returned"] and b["loaded_iteration"] == CUT and b["train_iters"] == full_steps
        assert b["drawn"] == a["drawn"][MBPS * CUT:], f"rank {a['rank']} resumed differently"
    keys = [{k for batch in r["drawn"] for k in batch} for r in first]
    assert not keys[0] & keys[1]  # the two data-parallel ranks read disjoint samples


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mix", ["step", "window"])
@pytest.mark.parametrize("tag", TAGS)
def test_a_planned_run_on_two_ranks_resumes_on_one_from_megatrons_checkpoint(tmp_path, tag, mix):
    """Issue 23: the planned order under Megatron-LM's real loop on 2 gloo ranks (finite data,
    --num-workers 2), Megatron's own save_checkpoint at iteration 2; then ``pretrain`` on ONE
    rank with the same --global-batch-size (so 4 micro-batches per iteration), Megatron's own
    load_checkpoint of iteration 2. The one rank has dprank 0's file (Megatron names it for its
    DP rank), continues the global order, and with the first run's first two iterations it draws
    every sample of the epoch once, ending at the same iteration as the 2-rank run. Both mix
    granularities (``--planned-mix``; the window mix's finite epoch ends with a window)."""
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
    from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
    from energon_ordering.length_index.build import build_length_index

    make_synthetic_dataset(tmp_path / "data", [SourceSpec("web", 96, "short")], shard_size=12)
    data = tmp_path / "data" / "web"
    build_length_index(data, task_encoder=IndexedSyntheticTaskEncoder())
    first = _spawn(tmp_path, data, tag, "first", 2, planned=True, mix=mix)
    steps = first[0]["train_iters"]
    assert steps > CUT and all(r["train_iters"] == steps for r in first)
    assert all(len(r["drawn"]) == MBPS * steps for r in first)
    epoch = sorted(k for r in first for batch in r["drawn"] for k in batch)
    assert len(epoch) == len(set(epoch)) == MBS * WORLD * MBPS * steps

    resumed = _spawn(tmp_path, data, tag, "resume_one", 2, load_step=CUT, world=1, planned=True,
                     mix=mix)
    [one] = resumed
    assert one["returned"] and one["loaded_iteration"] == CUT and one["train_iters"] == steps
    assert len(one["drawn"]) == WORLD * MBPS * (steps - CUT)  # 4 micro-batches per iteration
    before = [k for r in first for batch in r["drawn"][: MBPS * CUT] for k in batch]
    after = [k for batch in one["drawn"] for k in batch]
    assert sorted(before + after) == epoch, "the resume at one rank lost or repeated samples"
    # every plan window after the cut holds the samples of the uninterrupted 2-rank run
    for window in range(CUT // 2, steps // 2):
        two = sorted(k for r in first
                     for batch in r["drawn"][MBPS * 2 * window: MBPS * 2 * (window + 1)]
                     for k in batch)
        lo = 2 * WORLD * MBPS * (window - CUT // 2)
        mine = sorted(k for batch in one["drawn"][lo: lo + 2 * WORLD * MBPS] for k in batch)
        assert mine == two, f"plan window {window}"


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("tag", TAGS)
def test_a_packed_planned_run_on_two_ranks_resumes_on_one_from_megatrons_checkpoint(tmp_path, tag):
    """The planned order with packing (``--packing-buffer-size``, ``--packing-seq-length``) under
    Megatron-LM's real loop on 2 gloo ranks with ``--num-workers 2`` on finite data, then one
    rank resumed from Megatron's own checkpoint at iteration 2 (the same global batch of packs):
    the two runs draw every sample of the epoch once, and stop at the same iteration."""
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
    from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
    from energon_ordering.length_index.build import build_length_index

    make_synthetic_dataset(tmp_path / "data", [SourceSpec("web", 160, "short")], shard_size=16)
    data = tmp_path / "data" / "web"
    build_length_index(data, task_encoder=IndexedSyntheticTaskEncoder())
    first = _spawn(tmp_path, data, tag, "first", 2, planned=True, packed=True)
    steps = first[0]["train_iters"]
    assert steps > CUT and all(r["train_iters"] == steps for r in first)
    assert all(len(r["drawn"]) == MBPS * steps for r in first)
    epoch = [k for r in first for batch in r["drawn"] for k in batch]
    assert len(epoch) == len(set(epoch)) > MBS * WORLD * MBPS * steps  # packs of several

    resumed = _spawn(tmp_path, data, tag, "resume_one", 2, load_step=CUT, world=1, planned=True,
                     packed=True)
    [one] = resumed
    assert one["returned"] and one["loaded_iteration"] == CUT and one["train_iters"] == steps
    assert len(one["drawn"]) == WORLD * MBPS * (steps - CUT)
    before = [k for r in first for batch in r["drawn"][: MBPS * CUT] for k in batch]
    after = [k for batch in one["drawn"] for k in batch]
    assert sorted(before + after) == sorted(epoch), "the resume lost or repeated samples"


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("tag", TAGS)
def test_a_planned_run_under_rampup_resumes_from_megatrons_checkpoints(tmp_path, tag):
    """The planned order under ``--rampup-batch-size`` (core_v0.16.1; core_v0.19.0: the same ramp
    as ``--step-batch-size-schedule``) in Megatron-LM's real loop on 2 gloo ranks with
    ``--num-workers 2`` (repeating data, ``--train-samples``). Megatron's checkpoint
    at iteration 3 lies inside a plan step (3 micro-batches per rank, 2 per step): both ranks
    resume from it exactly. Its checkpoint at iteration 6 ends a plan step: ONE rank resumes
    from it (elastic) and draws the samples the two ranks drew after it, to the same end."""
    from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset
    from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder
    from energon_ordering.length_index.build import build_length_index

    make_synthetic_dataset(tmp_path / "data", [SourceSpec("web", 96, "short")], shard_size=12)
    data = tmp_path / "data" / "web"
    build_length_index(data, task_encoder=IndexedSyntheticTaskEncoder())
    first = _spawn(tmp_path, data, tag, "first", 2, planned=True, ramp=True)
    per_iteration = [1] * 8 + [2] * 6  # Megatron's calculator: 160 samples in 14 iterations
    for r in first:
        assert r["returned"] and len(r["drawn"]) == sum(per_iteration), r.get("error")

    resumed = _spawn(tmp_path, data, tag, "resume", 2, load_step=RAMP_CUT, planned=True, ramp=True)
    for a, b in zip(first, resumed):
        assert b["returned"] and b["loaded_iteration"] == RAMP_CUT, b.get("error")
        assert b["drawn"] == a["drawn"][RAMP_CUT:], f"rank {a['rank']} resumed differently"

    one = _spawn(tmp_path, data, tag, "resume_one", 2, load_step=6, world=1, planned=True, ramp=True)[0]
    assert one["returned"] and one["loaded_iteration"] == 6, one.get("error")
    after_two = sorted(k for r in first for batch in r["drawn"][6:] for k in batch)
    after_one = sorted(k for batch in one["drawn"] for k in batch)
    assert after_one == after_two, "the elastic resume under the ramp-up lost or repeated samples"
