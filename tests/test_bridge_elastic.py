"""Megatron-Bridge elastic resume (issue 23): a planned run saved by Bridge's own saver
(``maybe_save_dataloader_state``) at 2 data-parallel ranks resumes at 1 rank through Bridge's
own loader (``maybe_load_dataloader_state``, which reads ``train_dataloader_dprank000.pt`` and
calls the provider's loader hook ``OrderingEnergonDataloader.restore_state``).

The 2-rank run is two spawned processes on a gloo group with ``initialize_model_parallel(1, 1)``
(Bridge's process groups from megatron-core); the resume is one rank in the pytest process
(``gloo_group.gloo_group_of_one``). Micro-batches per step are derived from Bridge's
``ConfigContainer`` at each size (global batch 16: 2 per step at 2 ranks, 4 at 1 rank).

Bridge 0.6.2 needs Python 3.12: marked ``py312`` and run by ``.ci/py312``; it imports
Transformer Engine at import time, so the CPU stand-in (``bridge_cpu.install()``) comes first.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.py312, pytest.mark.slow]  # two spawned Bridge processes (~20 s)

if sys.version_info < (3, 12):
    pytest.skip("Megatron-Bridge 0.6.2 needs Python 3.12 (run by .ci/py312)", allow_module_level=True)
try:
    _have_bridge = importlib.util.find_spec("megatron.bridge") is not None
except ModuleNotFoundError:  # no megatron package at all
    _have_bridge = False
if not _have_bridge:
    pytest.skip("Megatron-Bridge is not installed (see docs/megatron-bridge.md)",
                allow_module_level=True)

from energon_ordering.integrations import bridge_cpu  # noqa: E402

bridge_cpu.install()  # Transformer Engine's CPU stand-in, explicitly; a no-op with real TE

from megatron.bridge.training.callbacks import CallbackContext  # noqa: E402
from megatron.bridge.training.checkpointing import (  # noqa: E402
    maybe_load_dataloader_state,
    maybe_save_dataloader_state,
)
from megatron.bridge.training.state import GlobalState  # noqa: E402

import megatron_lm_sources  # noqa: E402
from energon_ordering import StateMismatchError  # noqa: E402
from energon_ordering.inspect.inspection import compare_elastic_steps  # noqa: E402
from energon_ordering.inspect.rank_simulation import close_loader, record_batch  # noqa: E402
from energon_ordering.inspect.synthetic import SourceSpec  # noqa: E402
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder, SyntheticTaskEncoder  # noqa: E402
from energon_ordering.integrations.bridge import OrderingDatasetProvider, OrderingResumeCheck  # noqa: E402
from gloo_group import gloo_group_of_one  # noqa: E402
from test_bridge import MICRO_BATCH, _build, _container  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

GLOBAL_BATCH = 16   # samples per optimizer step: 2 ranks x 2 micro-batches x 4, then 1 x 4 x 4
WINDOW = 2          # plan window (optimizer steps)
STEPS, CUT = 8, 3   # optimizer steps of the uninterrupted run; Bridge saves at step CUT
# micro_batches_per_step is not given: check_run derives it from Bridge's global batch at each size
ORDERINGS = {
    "planned": ({"length_sort_mode": "planned", "length_sort_placement": "pre-encode",
                 "length_sort_pool_holds": "keys", "seed": 5, "plan_window_steps": WINDOW},
                IndexedSyntheticTaskEncoder),
    "batch": ({"length_sort_mode": "batch", "length_sort_pool_size": 32, "seed": 5}, SyntheticTaskEncoder),
}


def _provider(data: str, mode: str, num_workers: int) -> OrderingDatasetProvider:
    ordering, encoder = ORDERINGS[mode]
    return OrderingDatasetProvider(path=data, task_encoder=encoder(), ordering=dict(ordering),
                                   micro_batch_size=MICRO_BATCH, num_workers=num_workers,
                                   pin_memory=False)


def _run_state(provider: OrderingDatasetProvider, step: int) -> tuple[OrderingResumeCheck, CallbackContext]:
    """Bridge's validated config around ``provider`` (data-parallel size from the process group)
    and the resume check at ``on_data_init_start``, as Bridge's setup() fires it."""
    cfg = _container(provider, global_batch_size=GLOBAL_BATCH, train_iters=100)
    cfg.validate()
    state = GlobalState()
    state.cfg = cfg
    state.train_state.step = step
    check, context = OrderingResumeCheck(provider), CallbackContext(state=state, model=[])
    check.on_data_init_start(context)
    return check, context


def _draw(it, micro_batches: int) -> list[list]:
    """(key, source) of each sample of ``micro_batches`` micro-batches."""
    out = []
    for _ in range(micro_batches):
        rec = record_batch(next(it))
        out.append([list(p) for p in zip(rec.keys, rec.sources)])
    return out


def _bridge_rank(rank: int, world: int, init_file: str, data: str, out: str) -> None:
    """One data-parallel rank of the uninterrupted run: Bridge's saver writes its state at step
    CUT; every mode's micro-batches of all STEPS go to ``{out}/save_rank{rank}.json``."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    result: dict = {"rank": rank}
    try:
        for mode in ORDERINGS:
            provider = _provider(data, mode, 0)
            check, context = _run_state(provider, 0)
            it = _build(provider, pg)
            check.on_train_start(context)
            per_step = provider.ordering_config.micro_batches_per_step
            drawn = []
            for step in range(STEPS):
                if step == CUT:  # what Bridge's save_checkpoint does after step CUT
                    maybe_save_dataloader_state(None, it, CUT, str(Path(out) / mode), pg_collection=pg)
                drawn.append(_draw(it, per_step))
            result[mode] = {"per_step": per_step, "steps": drawn}
    except Exception as e:  # reported to the test, which fails with the message
        result["error"] = f"{type(e).__name__}: {e}"
    Path(out, f"save_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two indexed sources (web: short, code: long; weights 0.7 / 0.3), their metadataset."""
    return indexed_synthetic(
        tmp_path_factory.mktemp("bridge_elastic"),
        [SourceSpec("web", 160, "short", weight=0.7), SourceSpec("code", 96, "long", weight=0.3)],
        shard_size=32)


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory) -> tuple[Path, list[dict]]:
    """The uninterrupted 2-rank runs (planned and batch), each saved by Bridge at step CUT."""
    out = tmp_path_factory.mktemp("bridge_elastic_run")
    init = out / f"init_{time.monotonic_ns()}"
    ranks = megatron_lm_sources.spawn_ranks(_bridge_rank, (2, str(init), str(data), str(out)), out,
                                            "save", 2, "the 2-rank Bridge run", timeout=300)
    for mode in ORDERINGS:
        assert ranks[0][mode]["per_step"] == 2  # 16 / (4 x 2 ranks)
        assert (out / mode / f"iter_{CUT:07d}" / "train_dataloader_dprank001.pt").is_file()
    return out, ranks


@pytest.fixture(scope="module")
def pg(tmp_path_factory):
    """One data-parallel rank in this process: gloo, megatron-core model parallel (1, 1)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    with gloo_group_of_one(tmp_path_factory.mktemp("dist") / "init"):
        parallel_state.initialize_model_parallel(1, 1)
        try:
            yield ProcessGroupCollection.use_mpu_process_groups()
        finally:
            parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_planned_resumes_at_one_rank_what_bridge_saved_at_two(saved, data, pg, caplog, num_workers):
    out, ranks = saved
    provider = _provider(str(data), "planned", num_workers)
    check, context = _run_state(provider, CUT)
    assert provider.ordering_config.micro_batches_per_step == 4  # 16 / (4 x 1 rank): the new count
    it = _build(provider, pg)
    with caplog.at_level(logging.WARNING, logger="energon_ordering.integrations.bridge"):
        maybe_load_dataloader_state(it, CUT, str(out / "planned"), pg_collection=pg)  # Bridge's loader
    lines = [r.getMessage() for r in caplog.records if r.name == "energon_ordering.integrations.bridge"]
    assert len(lines) == 1 and "data-parallel size 1 (rank 0, 4 micro-batches per step) from a " \
        "dataloader state saved at data-parallel size 2 (rank 0, 2 micro-batches per step)" in lines[0]
    assert "elastic resume" in lines[0]
    check.on_train_start(context)  # the state counts 3 steps x 2 micro-batches: accepted

    got = [[tuple(s) for mb in _draw(it, 4) for s in mb] for _ in range(STEPS - CUT)]
    # the uninterrupted run's optimizer steps: rank 0's micro-batches, then rank 1's
    expected = [[tuple(s) for r in ranks for mb in r["planned"]["steps"][step] for s in mb]
                for step in range(CUT, STEPS)]
    assert sum(len(step) for step in got) == (STEPS - CUT) * GLOBAL_BATCH
    assert compare_elastic_steps(expected, got, first_step=CUT, window_steps=WINDOW) is None
    before = {k for r in ranks for step in r["planned"]["steps"][:CUT] for mb in step for k, _ in mb}
    assert not before & {k for step in got for k, _ in step}  # nothing drawn twice
    it.iterable._iter = None  # Bridge's generator over the loader: drop it, then stop the workers now
    close_loader(it.iterable._dataloader)


def test_other_modes_still_refuse_another_data_parallel_size(saved, data, pg):
    out, _ = saved
    provider = _provider(str(data), "batch", 0)
    _run_state(provider, CUT)
    assert provider.ordering_config.micro_batches_per_step == 4
    it = _build(provider, pg)
    with pytest.raises(StateMismatchError, match=r"Bridge resumed at data-parallel size 1 from a "
                       r"dataloader state saved at data-parallel size 2 .*length_sort_mode = 'batch': "
                       r"only length_sort_mode: planned continues .* Resume at 2 data-parallel ranks"):
        maybe_load_dataloader_state(it, CUT, str(out / "batch"), pg_collection=pg)
    assert it.iterable.restored_state is None
