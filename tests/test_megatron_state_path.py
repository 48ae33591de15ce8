"""The dataloader-state path equals what Megatron-LM's own saver writes, per tag.

Eight gloo processes (CPU) run Megatron-LM's real ``maybe_save_dataloader_state`` (from the
tag's own megatron/training, see ``megatron_lm_sources.py``) under real
``initialize_model_parallel`` for every TP x PP x EP layout up to 2 x 2 x 2; every rank that
builds a loader then finds its state where :func:`dataloader_state_path` says, with the rule
detected from the installed megatron-core. core_v0.16.1 runs on the default Python with
megatron-core 0.16.1; core_v0.19.0 (Python >= 3.12, megatron-core 0.19.x) is marked ``py312``
and runs in the ``.ci/py312`` leg.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import megatron_lm_sources  # noqa: E402

LAYOUTS = [(tp, pp, ep) for tp in (1, 2) for pp in (1, 2) for ep in (1, 2)]
WORLD = 8


class _Iterable:
    """Stands in for the training iterator's ``.iterable``: the saver only calls save_state()."""

    def __init__(self, state):
        self.state = state

    def save_state(self):
        return self.state


def _worker(rank: int, tag: str, init_file: str, out: str) -> None:
    megatron_lm_sources.use_megatron_lm(tag)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training.checkpointing import ensure_directory_exists, get_checkpoint_name, maybe_save_dataloader_state

    from energon_ordering.integrations.megatron_lm import (
        _find_state_file,
        dataloader_path_rule,
        dataloader_state_path,
    )

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results = []
    try:
        for i, (tp, pp, ep) in enumerate(LAYOUTS):
            ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
            save = Path(out) / f"layout{i}"
            dp = ps.get_data_parallel_rank()
            it = RerunDataIterator(_Iterable({"dp": dp, "layout": i}))  # what pretrain() passes
            if tag == "core_v0.16.1":
                # core_v0.16.1's saver creates only data-parallel rank 0's folder, so with EP > 1
                # the ranks of expert rank 1 fail ("Parent directory ... does not exist") unless
                # the folders exist, as they do when --dataloader-save shares a legacy-format
                # checkpoint folder: Megatron's model save creates each rank's folder like this.
                ensure_directory_exists(get_checkpoint_name(str(save), 5))
            maybe_save_dataloader_state(it, 5, str(save))
            dist.barrier()
            loads = ps.get_tensor_model_parallel_rank() == 0 and (
                ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage())
            if loads:
                path = dataloader_state_path(save, 5, dp)
                found = path.is_file() and torch.load(path, weights_only=False) == {
                    "dataloader_state_dict": {"dp": dp, "layout": i}}
                results.append({"layout": [tp, pp, ep], "dp": dp, "path": str(path.relative_to(save)),
                                "found": found, "probe": str(_find_state_file(save, 5, dp).relative_to(save)),
                                "files": sorted(str(p.relative_to(save)) for p in save.rglob("*.pt"))})
            dist.barrier()
            ps.destroy_model_parallel()
        result = {"rule": dataloader_path_rule(), "results": results}
    except Exception as e:  # reported to the test
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _run(tmp_path: Path, tag: str) -> list[dict]:
    import torch.multiprocessing as mp

    # spawn, not fork: a fork after importing megatron.training (triton, LLVM threads) crashed a
    # child with SIGSEGV on a loaded machine. Eight imports take 0.5-5 min on 2 cores.
    ctx = mp.start_processes(_worker, nprocs=WORLD, join=False, start_method="spawn",
                             args=(tag, str(tmp_path / "init"), str(tmp_path)))
    deadline = time.monotonic() + 660
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail("the 8-process run did not finish (hang)")
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in out:
        assert "error" not in r, r["error"]
    return out


def _check(out: list[dict], rule: str) -> None:
    assert {r["rule"] for r in out} == {rule}
    seen = {}
    for r in out:
        for res in r["results"]:
            assert res["found"], f"layout TPxPPxEP={res['layout']}: no state at {res['path']}; saver wrote {res['files']}"
            assert res["probe"] == res["path"]
            seen.setdefault(tuple(res["layout"]), set()).add(res["dp"])
    assert set(seen) == set(LAYOUTS)
    for (tp, pp, ep), dps in seen.items():
        assert dps == set(range(WORLD // (tp * pp)))  # every data-parallel rank found its own
    # the two rules really differ under expert parallelism: one folder per expert rank or one
    ep2 = [res for r in out for res in r["results"] if res["layout"] == [2, 2, 2]]
    folders = {Path(res["path"]).parent.name for res in ep2}
    assert folders == ({"mp_rank_00_000_000", "mp_rank_00_000_001"} if rule == "expert-suffix" else {"mp_rank_00_000"})


@pytest.mark.skipif(not megatron_lm_sources.have_sources("core_v0.16.1"), reason="no ../shared/thirdparty")
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the core 0.16.1 leg runs on the default Python")
@pytest.mark.slow  # a real Megatron-LM client on 2 gloo ranks
@pytest.mark.timeout(720)
def test_state_path_equals_the_saver_of_core_v0_16_1(tmp_path):
    _check(_run(tmp_path, "core_v0.16.1"), "expert-suffix")


@pytest.mark.py312
@pytest.mark.skipif(sys.version_info < (3, 12) or not megatron_lm_sources.installed_core_019(), reason="needs Python 3.12 + megatron-core 0.19.x (.ci/py312)")
@pytest.mark.skipif(not megatron_lm_sources.have_sources("core_v0.19.0"), reason="no ../shared/thirdparty")
@pytest.mark.timeout(720)
def test_state_path_equals_the_saver_of_core_v0_19_0(tmp_path):
    _check(_run(tmp_path, "core_v0.19.0"), "canonical")
