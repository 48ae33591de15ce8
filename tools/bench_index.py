#!/usr/bin/env python
"""Benchmark of length index builds: encoder path against header-only, one process against
many under torchrun, two "nodes", a killed and resumed build, an incremental build, and the time
10^8 samples take on 64 nodes x 32 processes. Every figure is measured in this run.

Data (written with tools/make_synthetic_dataset.py, prepared with ``energon prepare``):

- LLaVA-like: photo-like 448 x 448 JPEGs with captions of 8-120 words;
- Qwen-VL-like: photo-like JPEGs whose sides are drawn from 64..1600 px;
- a dataset of small JPEGs in 100 shards, for the incremental build (+1 shard = +1%).

Figures:

1. samples/s per process: the task encoder path (decode with PIL + the real CLIP image
   processor at 336 px, LLaVA-1.5: 576 tokens; decode + the real ``Qwen2VLImageProcessor``) and
   the header-only raw length function (``llava_caption_length``, ``qwen2_vl_caption_length``),
   each a whole one-process index build; ``--verify`` of the header-only functions against the
   encoders (0 mismatches is a check);
2. 1 vs 2 processes under ``torchrun`` (the encoder path, LLaVA-like data): the build's
   seconds and CPU per sample (load-dependent on a shared machine: reported, never failed),
   beside two independent one-process builds at once (what the machine gives two processes);
3. two torchrun agents (``--nnodes 2``, c10d rendezvous, one machine): the index equals the
   one-process index byte for byte (a check);
4. a process SIGKILLed mid-build, then the rerun: it reuses the finished part and measures
   only the lost process's share (a check), and the index equals the one-process index;
5. +1% shards after ``energon prepare``: the share of samples measured (<= 2%: a check), and
   the index equals a full rebuild's;
6. the projection for 10^8 samples on 64 nodes x 32 processes: the per-process header-only
   rate measured in 1, plus rank 0's merge at the index write rate measured here.

Usage:
    python tools/bench_index.py --quick    # about 2-4 min of CPU
    python tools/bench_index.py            # larger datasets
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from _bench_common import begin, check, finish, load_dependent, ratio, timed
from make_synthetic_dataset import mixed_sizes, prepare, write_photo_shards

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(REPO / "tests"))  # torchvision_cpu_shim (CPU torch + PyPI torchvision)

from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder, LengthSample  # noqa: E402
from energon_ordering.length_index import header_length as hl  # noqa: E402
from energon_ordering.length_index.build import build_length_index  # noqa: E402

#: Samples per shard of the benchmark datasets.
SHARD = 16


def _processor(name: str) -> Any:
    import torchvision_cpu_shim

    torchvision_cpu_shim.install()
    if name == "clip":
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor(size={"shortest_edge": 336},
                                  crop_size={"height": 336, "width": 336})
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor()


def _length_sample(sample: Any, media: int) -> LengthSample:
    return LengthSample(__key__=sample.__key__, __restore_key__=sample.__restore_key__,
                        __subflavors__=None, __sources__=None,
                        total_len=media + len(sample.caption.split()), media_tokens=media,
                        source="-")


class LlavaEncoder(LengthEstimateTaskEncoder):
    """The encoder path of LLaVA-1.5: decode (PIL), the real CLIP image processor at 336 px
    (576 image tokens), the caption's whitespace tokens."""

    def __init__(self) -> None:
        from megatron.energon import SampleDecoder

        super().__init__(tokens_per_media=0)
        self.decoder = SampleDecoder(image_decode="pil")
        self.processor = _processor("clip")

    def encode_sample(self, sample: Any) -> LengthSample:
        self.processor(images=sample.image.convert("RGB"), return_tensors="np")
        return _length_sample(sample, 576)


class QwenEncoder(LengthEstimateTaskEncoder):
    """The encoder path of Qwen2-VL: decode (PIL), the real ``Qwen2VLImageProcessor``; its
    merged patches are the image's tokens."""

    def __init__(self) -> None:
        from megatron.energon import SampleDecoder

        super().__init__(tokens_per_media=0)
        self.decoder = SampleDecoder(image_decode="pil")
        self.processor = _processor("qwen")

    def encode_sample(self, sample: Any) -> LengthSample:
        grid = self.processor(images=sample.image.convert("RGB"), return_tensors="np",
                              input_data_format="channels_last")["image_grid_thw"][0]
        return _length_sample(sample, int(np.prod(grid)) // self.processor.merge_size ** 2)


def killing_llava_length(raw: dict) -> int:
    """``llava_caption_length``; under ``$BENCH_KILL`` (rank 0's part), rank 1 SIGKILLs itself
    half-way through its share, once rank 0's part is written."""
    kill = os.environ.get("BENCH_KILL")
    if kill and os.environ.get("RANK") == "1":
        killing_llava_length.seen = getattr(killing_llava_length, "seen", 0) + 1
        if killing_llava_length.seen > int(os.environ["BENCH_KILL_AFTER"]):
            deadline = time.monotonic() + 300
            while not Path(kill).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGKILL)
    return hl.llava_caption_length(raw)


# -- helpers -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TOOLS), str(REPO / "tests")]),
            "OMP_NUM_THREADS": "1"}


def _start(args: list[str], index: list[str], env: dict[str, str] | None = None,
           show: bool = True) -> subprocess.Popen:
    """Starts one torchrun agent of ``energon-ordering index`` (``show``: printing its command)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "energon_ordering.cli",
           "index", *index]
    if show:
        print("  $ " + " ".join(cmd[1:]).replace(str(REPO) + "/", ""), flush=True)
    return subprocess.Popen(cmd, env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _torchrun(args: list[str], index: list[str], env: dict[str, str] | None = None,
              agents: int = 1) -> tuple[list[subprocess.CompletedProcess], float, float]:
    """Runs ``agents`` torchrun agents of ``energon-ordering index``; their results, wall and
    CPU seconds (agents and workers, reaped)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    procs = [_start(args, index, env, show=i == 0) for i in range(agents)]  # one command
    done = []
    for p in procs:
        out, err = p.communicate(timeout=1200)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return done, wall, cpu


def _table_seconds(out: str) -> float:
    """The build's seconds from rank 0's table (the dataset's row: its last column)."""
    for line in out.splitlines():
        m = re.fullmatch(r"\S+\s+[\d,]+\s+[\d,.]+\s+([\d.]+)", line.strip())
        if m:
            return float(m.group(1))
    return float("nan")


def _wrote(err: str) -> dict[str, tuple[int, float, float]]:
    """Per part written: (samples measured, seconds, CPU seconds) from the ranks' log lines."""
    found = {}
    for m in re.finditer(r"\[rank (\d+)\] length index: wrote \S+: \d+ samples of \d+ shards, "
                         r"(\d+) measured, in ([\d.]+) s \(([\d.]+) s CPU", err):
        found[m.group(1)] = (int(m.group(2)), float(m.group(3)), float(m.group(4)))
    return found


def _one_process(path: Path, **kw: Any) -> tuple[Any, float, float]:
    with timed() as t:
        built = build_length_index(path, **kw)[0]
    return built, t.wall, t.cpu


def _row(what: str, samples: int, wall: float, cpu: float) -> tuple[str, float, float]:
    print(f"  {what:<46} {samples:>6} samples  {wall:7.2f} s wall  {cpu:7.2f} s CPU  "
          f"{ratio(samples, wall):9.1f}/s wall  {ratio(samples, cpu):9.1f}/s CPU", flush=True)
    return what, ratio(samples, wall), ratio(samples, cpu)


# -- the figures -------------------------------------------------------------------------------


def per_process_rates(llava: Path, qwen: Path, verify: int) -> dict[str, float]:
    """Figure 1; returns the CPU rates (samples/s) of both paths on LLaVA-like data."""
    from energon_ordering.length_index.verify import verify_raw_length

    print("\n1. samples/s per process (a whole one-process index build each)", flush=True)
    rates = {}
    for label, path, encoder, fn in [("LLaVA-like", llava, LlavaEncoder, hl.llava_caption_length),
                                     ("Qwen-VL-like", qwen, QwenEncoder,
                                      hl.qwen2_vl_caption_length)]:
        te = encoder()
        b, wall, cpu = _one_process(path, task_encoder=te, name="encoder")
        _, _, enc_cpu = _row(f"{label}: encoder path ({encoder.__name__})", b.summary.samples,
                             wall, cpu)
        b, wall, cpu = _one_process(path, raw_length_fn=fn)
        _, head_wall, head_cpu = _row(f"{label}: header-only ({fn.__name__})", b.summary.samples, wall,
                              cpu)
        rates[label] = (enc_cpu, head_cpu, head_wall)
        load_dependent(f"{label}: header-only vs encoder path, per process (CPU)",
                       head_cpu >= 20 * enc_cpu, f"{ratio(head_cpu, enc_cpu):.0f}x (target >= 20x)")
        report = verify_raw_length(path, raw_length_fn=fn, task_encoder=te, samples=verify)
        check(f"{label}: --verify {verify} of {fn.__name__} against {encoder.__name__}",
              not report.mismatches, f"{len(report.mismatches)} mismatches in {report.checked}")
    return {"encoder": rates["LLaVA-like"][0], "header": rates["LLaVA-like"][1],
            "header_wall": rates["LLaVA-like"][2]}


def one_vs_two(llava: Path, samples: int, encoder_rate_cpu: float) -> None:
    print("\n2. 1 vs 2 processes under torchrun (encoder path, LLaVA-like data)", flush=True)
    seconds = {}
    index = [str(llava), "--task-encoder", "bench_index:LlavaEncoder", "--name", "torchrun"]
    for n in (1, 2):
        (res,), wall, cpu = _torchrun(["--nproc-per-node", str(n), "--master-port",
                                       str(_free_port())], index)
        if not check(f"torchrun --nproc-per-node {n} exits 0", res.returncode == 0,
                     f"exit {res.returncode}" + ("" if res.returncode == 0 else
                                                 f": {res.stderr[-1500:]}")):
            return
        seconds[n] = _table_seconds(res.stdout)
        parts = _wrote(res.stderr)
        part_cpu = sum(c for _, _, c in parts.values())
        per = f", ranks' measuring CPU {1000 * part_cpu / samples:.2f} ms/sample" if parts else ""
        print(f"  {n} process(es): build {seconds[n]:.2f} s (rank 0's table), whole command "
              f"{wall:.1f} s wall, {cpu:.1f} s CPU (imports included){per}", flush=True)
        if parts:
            for rank, (measured, s, c) in sorted(parts.items()):
                print(f"    rank {rank}: {measured} samples in {s:.2f} s, {c:.2f} s CPU", flush=True)
    speedup = ratio(seconds[1], seconds[2])
    load_dependent("2 processes vs 1 (build seconds)", speedup >= 1.8,
                   f"{speedup:.2f}x (target >= 1.8x; this machine's 2 cores are shared)")
    # What this machine's second core gives any two processes: two independent one-process
    # builds (other index names) at once, against one alone (seconds[1]).
    runs = [_start(["--nproc-per-node", "1", "--master-port", str(_free_port())],
                   [str(llava), "--task-encoder", "bench_index:LlavaEncoder", "--name", f"apart{i}"])
            for i in range(2)]
    apart = [_table_seconds(p.communicate(timeout=1200)[0]) for p in runs]
    ceiling = ratio(2 * seconds[1], max(apart))
    print(f"  two independent one-process builds at once: {apart[0]:.2f} s and {apart[1]:.2f} s "
          f"(one alone {seconds[1]:.2f} s): this machine gives two processes {ceiling:.2f}x one; "
          f"the distributed build reaches {ratio(speedup, ceiling):.0%} of that", flush=True)
    print(f"  the encoder path in one process (1.): {1000 / encoder_rate_cpu:.2f} ms CPU/sample",
          flush=True)


def two_nodes(llava: Path, reference: bytes, index_file: Path) -> None:
    print("\n3. two torchrun agents (--nnodes 2, c10d rendezvous, one machine)", flush=True)
    index_file.unlink()
    port = _free_port()
    results, wall, cpu = _torchrun(
        ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"127.0.0.1:{port}", "--rdzv-id", "bench"],
        [str(llava), "--raw-length-fn",
         "energon_ordering.length_index.header_length:llava_caption_length"], agents=2)
    ok = all(r.returncode == 0 for r in results)
    check("two agents exit 0", ok, str([r.returncode for r in results]) +
          ("" if ok else f": {results[0].stderr[-1500:]}"))
    print(f"  {wall:.1f} s wall, {cpu:.1f} s CPU (2 agents + 2 workers, imports included)")
    check("two-node index equals the one-process index", index_file.exists()
          and index_file.read_bytes() == reference, f"{index_file.name}, byte for byte")


def killed_and_resumed(llava: Path, samples: int) -> None:
    import bench_index

    print("\n4. a process SIGKILLed mid-build, then the rerun", flush=True)
    from energon_ordering.length_index.index import index_path
    from energon_ordering.length_index.shard_split import split_shards

    index = index_path(llava, "bench_index.killing_llava_length")
    index.unlink(missing_ok=True)
    counts = [SHARD] * (samples // SHARD) + ([samples % SHARD] if samples % SHARD else [])
    share1 = sum(counts[p] for p in split_shards(counts, 2)[1])
    env = {**_env(), "BENCH_KILL": f"{index}.part-0-of-2", "BENCH_KILL_AFTER": str(share1 // 2)}
    args = [str(llava), "--raw-length-fn", "bench_index:killing_llava_length"]
    (first,), wall, _ = _torchrun(["--nproc-per-node", "2", "--master-port", str(_free_port())],
                                  args, env=env)
    check("the killed build fails and leaves rank 0's part", first.returncode != 0 and Path(
        env["BENCH_KILL"]).exists(), f"exit {first.returncode}, {Path(env['BENCH_KILL']).name}")
    (second,), wall, cpu = _torchrun(["--nproc-per-node", "2", "--master-port",
                                      str(_free_port())], args)
    parts = _wrote(second.stderr)
    reused = "[rank 0] length index: reusing" in second.stderr
    print(f"  rerun: {wall:.1f} s wall, {cpu:.1f} s CPU; parts written: "
          f"{ {r: m for r, (m, _, _) in parts.items()} }; rank 0 reused its part: {reused}")
    check("the rerun recomputes only the lost process's part",
          second.returncode == 0 and reused and list(parts) == ["1"] and parts["1"][0] == share1,
          f"rank 1 measured {parts.get('1', (0,))[0]} = its share {share1}; rank 0 measured 0")
    ref = build_length_index(llava, raw_length_fn=bench_index.killing_llava_length, name="ref",
                             reuse=False)[0].summary.path
    check("the resumed index equals the one-process index", index.read_bytes() == ref.read_bytes(),
          "byte for byte")


def incremental(root: Path, shards: int, per_shard: int) -> None:
    print(f"\n5. incremental: +1 shard to {shards} after `energon prepare`", flush=True)
    inc = root / "incremental"
    write_photo_shards(inc, samples=shards * per_shard, shard_size=per_shard,
                       size=lambda rng: (64, 48), seed=5)
    prepare(inc)
    _one_process(inc, raw_length_fn=hl.llava_caption_length)
    write_photo_shards(inc, samples=per_shard, shard_size=per_shard, size=lambda rng: (64, 48),
                       seed=6, prefix="added")
    prepare(inc)
    built, wall, cpu = _one_process(inc, raw_length_fn=hl.llava_caption_length)
    total = built.summary.samples
    _row("rebuild after +1 shard", total, wall, cpu)
    check("+1% shards measures <= 2% of the samples", built.measured <= 0.02 * total,
          f"{built.measured} of {total} ({100 * built.measured / total:.2f}%)")
    full = build_length_index(inc, raw_length_fn=hl.llava_caption_length, name="full",
                              reuse=False)[0]
    check("the incremental index equals a full rebuild", built.summary.path.read_bytes()
          == full.summary.path.read_bytes(), f"{full.measured} samples measured by the rebuild")


def _merge_rate(root: Path, samples: int) -> tuple[float, float]:
    """Rank 0's merge, measured: a build by 2 ranks (threads of this process over one shared
    store) of a dataset of ``samples`` tiny samples; (samples/s wall, samples/s CPU) of the
    merge (parts read, coverage checked, index and lengths file written), from its log line."""
    import threading

    import torch.distributed as dist

    from energon_ordering.length_index.distributed import Coordinator

    tiny = root / "merge"
    write_photo_shards(tiny, samples=samples, shard_size=1000, size=lambda rng: (8, 8),
                       caption_words=(1, 4), seed=7)
    prepare(tiny)
    store, logs = dist.HashStore(), []

    def rank(r: int) -> None:
        coord = Coordinator(r, 2, dist.PrefixStore("bench/", store), stall_timeout=600)
        build_length_index(tiny, raw_length_fn=hl.llava_caption_length, coordinator=coord,
                           log=logs.append)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for line in logs:
        m = re.search(r"merged 2 parts, (\d+) samples, .* in ([\d.]+) s \(([\d.]+) s CPU\)", line)
        if m:
            n, wall, cpu = int(m.group(1)), float(m.group(2)), float(m.group(3))
            print(f"  rank 0's merge of {n:,} samples: {wall:.2f} s wall, {cpu:.2f} s CPU")
            return n / wall, n / cpu
    raise RuntimeError(f"no merge line in {logs}")


def projection(rate_cpu: float, rate_wall: float, root: Path, samples: int) -> None:
    print("\n6. projected 10^8 samples on 64 nodes x 32 processes", flush=True)
    # the merge's per-sample rate: the difference of a merge of `samples` and one of 4x as many
    # (a small merge is dominated by its fixed costs: 52,600 samples/s at 20,000 against
    # 198,000 at 200,000, 3 December)
    small_wall, small_cpu = _merge_rate(root / "small", samples)
    big_wall, big_cpu = _merge_rate(root / "big", 4 * samples)
    extra = 3 * samples
    merge_wall = extra / max(4 * samples / big_wall - samples / small_wall, 1e-9)
    merge_cpu = extra / max(4 * samples / big_cpu - samples / small_cpu, 1e-9)
    n, procs = 10 ** 8, 64 * 32
    measure = n / procs / rate_cpu
    merge = n / merge_cpu
    print(f"  per-process header-only rate (1., CPU): {rate_cpu:.0f} samples/s -> "
          f"{n // procs:,} samples per process in {measure:.0f} s")
    print(f"  rank 0's merge, per sample (4x - 1x): {merge_cpu:,.0f} samples/s CPU "
          f"({merge_wall:,.0f}/s wall here) -> "
          f"{merge:.0f} s for 10^8")
    total = measure + merge
    loaded = n / procs / rate_wall + n / merge_wall
    print(f"  at this shared machine's wall-clock rates instead: {loaded / 60:.1f} min")
    load_dependent("projected 10^8 samples on 64 x 32 processes", total <= 15 * 60,
                   f"{total / 60:.1f} min = {measure:.0f} s measuring + {merge:.0f} s merging, "
                   "at the CPU rates measured here (target <= 15 min; shards read at the file "
                   "system's speed assumed)")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--quick", is_flag=True, help="Small datasets (about 2-4 min of CPU).")
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="Write the datasets here and keep them (default: a temporary folder).")
def main(quick: bool, keep: str | None) -> None:
    """Length index builds: encoder path vs header-only, 1 vs 2 processes under torchrun, two
    nodes, a killed and resumed build, incremental, and the 10^8-sample projection."""
    start = begin()
    n_llava, n_qwen, inc_shards, verify = (320, 128, 100, 32) if quick else (2000, 600, 200, 200)
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="bench_index-"))
    try:
        with timed() as t:
            write_photo_shards(root / "llava", samples=n_llava, shard_size=SHARD,
                               size=lambda rng: (448, 448), seed=1)
            prepare(root / "llava")
            write_photo_shards(root / "qwen", samples=n_qwen, shard_size=SHARD,
                               size=mixed_sizes(64, 1600), seed=2)
            prepare(root / "qwen")
        print(f"data: {n_llava} LLaVA-like (448 px JPEG), {n_qwen} Qwen-VL-like (64-1600 px "
              f"JPEG) samples, {SHARD} per shard, in {root} ({t.text()})", flush=True)
        rates = per_process_rates(root / "llava", root / "qwen", verify)
        from energon_ordering.length_index.index import index_path

        header_index = index_path(root / "llava", "energon_ordering.length_index.header_length."
                                                  "llava_caption_length")
        reference = header_index.read_bytes()
        one_vs_two(root / "llava", n_llava, rates["encoder"])
        two_nodes(root / "llava", reference, header_index)
        killed_and_resumed(root / "llava", n_llava)
        incremental(root, inc_shards, 4 if quick else 8)
        projection(rates["header"], rates["header_wall"], root, 20_000 if quick else 100_000)
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    finish(start)


if __name__ == "__main__":
    main()
