"""``energon-ordering index`` under real torchrun (gloo): two processes, a process killed mid-build
and the rerun (``build_length_index`` in a training script's process group) that reuses the
finished part, and two torchrun agents with a c10d rendezvous
building incrementally after ``energon prepare`` ran again; each index byte for byte the one a
one-process build writes. Slow tier: each run starts torch and Energon in 2-3 processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from energon_ordering.inspect.synthetic import SourceSpec, _energon_prepare, _image, make_synthetic_dataset
from energon_ordering.length_index.build import build_length_index

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
FN = "test_index_distributed_run:counted_words"


def counted_words(raw: dict) -> float:
    """Raw length function of the runs: the caption's words. Appends each key it measures to
    ``$EO_COUNT/<rank>`` (torchrun's RANK, srun's SLURM_PROCID); rank 1 kills itself with SIGKILL at its first sample when
    ``$EO_KILL`` names rank 0's part, once that part exists (rank 0 finished its share); the rank
    ``$EO_FAIL`` names raises at its first sample."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    if os.environ.get("EO_FAIL") == rank:
        raise RuntimeError(f"rank {rank} cannot measure")
    kill = os.environ.get("EO_KILL")
    if kill and rank == "1":
        deadline = time.monotonic() + 120
        while not Path(kill).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("EO_COUNT"):
        with open(Path(os.environ["EO_COUNT"]) / rank, "a") as f:
            f.write(raw["__key__"] + "\n")
    return float(len(raw["txt"].split()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "-m", "energon_ordering.cli",
            "index"]


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    count = tmp / f"count-{time.monotonic_ns()}"
    count.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
           "EO_COUNT": str(count), "OMP_NUM_THREADS": "1", **extra}
    return env


def _counts(env: dict[str, str]) -> dict[str, int]:
    folder = Path(env["EO_COUNT"])
    return {p.name: len(p.read_text().split()) for p in sorted(folder.iterdir())}


def _reference(path: Path) -> bytes:
    """The one-process index's bytes (built in this process, under another name)."""
    import test_index_distributed_run as me

    return build_length_index(path, raw_length_fn=me.counted_words, name="reference",
                              reuse=False)[0].summary.path.read_bytes()


def _index(path: Path) -> Path:
    return path / ".nv-meta" / "energon_ordering_lengths.test_index_distributed_run.counted_words.sqlite"


def test_a_killed_build_resumed_from_a_training_script_writes_the_one_process_index(tmp_path):
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 96, "short")], shard_size=16)
    web = tmp_path / "web"
    index = _index(web)
    port = str(_free_port())
    run = [*_torchrun("--nproc-per-node", "2", "--master-port", port), str(web),
           "--raw-length-fn", FN]
    killed = _env(tmp_path, EO_KILL=f"{index}.part-0-of-2")
    first = subprocess.run(run, env=killed, capture_output=True, text=True, timeout=240)
    assert first.returncode != 0, first.stderr[-2000:]
    assert not index.exists() and (web / ".nv-meta" / f"{index.name}.part-0-of-2").exists()
    assert _counts(killed) == {"0": 48}
    # the rerun from a training script: build_length_index under its initialised process group
    again = _env(tmp_path)
    script = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              "--master-port", str(_free_port()), "-m", "test_index_distributed_run", str(web)]
    second = subprocess.run(script, env=again, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"length index: reusing {index.name}.part-0-of-2 (48 samples of 3 shards" \
        in second.stdout
    assert "rank 1: 96 samples, 96 measured" in second.stdout  # every rank returns the summary
    assert _counts(again) == {"1": 48}  # only the lost process's shards, measured again
    assert index.read_bytes() == _reference(web)
    assert not list(web.glob(".nv-meta/*.part-*"))


def test_two_agents_with_a_c10d_rendezvous_build_incrementally(tmp_path):
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 96, "short")], shard_size=16)
    web = tmp_path / "web"
    import test_index_distributed_run as me

    build_length_index(web, raw_length_fn=me.counted_words)  # the index before the new shard
    import webdataset as wds

    with wds.ShardWriter(str(web / "added-%06d.tar"), maxcount=16, verbose=0) as sink:
        for i in range(10):
            sink.write({"__key__": f"added-{i}", "png": _image(i, 16, "png"),
                        "txt": "one two three " * (i + 1),
                        "json": json.dumps({"source": "web", "text_tokens": 3 * (i + 1)})})
    _energon_prepare(web, "png")
    env = _env(tmp_path)
    port = str(_free_port())
    agent = [*_torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "eo"),
             str(web), "--raw-length-fn", FN]
    agents = [subprocess.Popen(agent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    outs = [a.communicate(timeout=240) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [o[1][-2000:] for o in outs]
    assert sum(_counts(env).values()) == 10  # the new shard only: 10 of 106 samples
    assert any("measured 10 of 106 samples" in o[0] for o in outs), outs
    assert _index(web).read_bytes() == _reference(web)


def test_srun_style_tasks_with_a_named_rendezvous_write_the_one_process_index(tmp_path):
    """What srun starts (:func:`_srun`), no torchrun agent: rank 0 serves the store and stays
    until rank 1 read the merge's result (it exited first, failing rank 1, before)."""
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 40, "short")], shard_size=8)
    web = tmp_path / "web"
    env = _env(tmp_path)
    outs = _srun(web, env)
    assert [rc for rc, _, _ in outs] == [0, 0], [err[-2000:] for _, _, err in outs]
    assert _counts(env) == {"0": 16, "1": 24}  # shards of 8: 2 and 3
    assert "web" in outs[0][1] and outs[1][1] == ""  # rank 0 prints the table
    # a progress bar per process on its own stderr, and the combined one on rank 0's
    assert "[rank 0/2]: 100%" in outs[0][2] and "[all 2 processes]: 100%" in outs[0][2]
    assert "[rank 1/2]: 100%" in outs[1][2] and "[all 2 processes]" not in outs[1][2]
    assert _index(web).read_bytes() == _reference(web)


def _srun(web: Path, env: dict[str, str], tasks: int = 2) -> list[tuple[int, str, str]]:
    """``energon-ordering index`` as srun starts it: plain processes with SLURM_PROCID /
    SLURM_NTASKS / SLURM_STEP_ID, rank 0 hosting the store named by --rendezvous."""
    rendezvous = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "energon_ordering.cli", "index", str(web), "--raw-length-fn", FN,
         "--rendezvous", rendezvous],
        env={**env, "SLURM_PROCID": str(r), "SLURM_NTASKS": str(tasks), "SLURM_STEP_ID": "0"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(tasks)]
    outs = [p.communicate(timeout=240) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_srun_tasks_whose_store_host_fails_end_in_one_line_and_the_rerun_reuses_the_others(
        tmp_path):
    """Rank 0 serves the store under srun: when it fails, rank 1 still writes its part and ends
    in one line (not the store's network error), and the rerun measures rank 0's shards only."""
    make_synthetic_dataset(tmp_path, [SourceSpec("web", 40, "short")], shard_size=8)
    web = tmp_path / "web"
    failed = _env(tmp_path, EO_FAIL="0")
    (rc0, _, err0), (rc1, _, err1) = _srun(web, failed)
    assert (rc0, rc1) == (2, 2), (err0[-2000:], err1[-2000:])
    assert "rank 0 cannot measure" in err0 and "Traceback" not in err0 + err1, (err0, err1)
    assert "Error: length index:" in err1 and "DistNetworkError" not in err1.split("Error:")[0]
    assert _counts(failed) == {"1": 24}
    assert (web / ".nv-meta" / f"{_index(web).name}.part-1-of-2").exists()
    again = _env(tmp_path)
    assert [rc for rc, _, _ in _srun(web, again)] == [0, 0]
    assert _counts(again) == {"0": 16}  # rank 1's part reused
    assert _index(web).read_bytes() == _reference(web)


if __name__ == "__main__":  # a training script's build (the rerun above runs it under torchrun)
    import torch.distributed as dist

    import energon_ordering
    import test_index_distributed_run as me

    dist.init_process_group("gloo")
    built = energon_ordering.build_length_index(sys.argv[1], raw_length_fn=me.counted_words,
                                                log=print)[0]
    print(f"rank {dist.get_rank()}: {built.summary.samples} samples, {built.measured} measured")
    dist.destroy_process_group()
