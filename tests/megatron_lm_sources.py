"""Puts a Megatron-LM tag's own ``megatron/training`` and ``examples/multimodal`` on sys.path.

The ``megatron-core`` wheel holds ``megatron.core`` only (0.19.x also ships a ``megatron.training``
of its own); the tests that must run Megatron-LM's real code (its checkpoint saver, its
multimodal TaskEncoder) unpack the tag's sources from ``../shared/thirdparty`` (beside the
repository, as on the developer machines and in CI; override with ``MEGATRON_LM_THIRDPARTY``)
and put them FIRST on ``sys.path`` (hence on the namespace package's ``megatron.__path__``), so the tag's ``megatron.training`` wins over a
wheel's. Call :func:`use_megatron_lm` before importing ``megatron.training``, in a fresh process
(a spawned worker or a subprocess), since a module imported once stays imported.
"""

from __future__ import annotations

import json
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TAGS = {"core_v0.16.1": "megatron-lm-core_v0.16.1", "core_v0.19.0": "megatron-lm-core_v0.19.0"}


def thirdparty_dir() -> Path:
    env = os.environ.get("MEGATRON_LM_THIRDPARTY")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "thirdparty"


def archive(tag: str) -> Path:
    return thirdparty_dir() / f"{TAGS[tag]}.tar.gz"


def have_sources(tag: str) -> bool:
    return archive(tag).is_file()


def unpack(tag: str) -> Path:
    """The unpacked tag (cached per user under the temp dir; unpacked once, atomically)."""
    cache = Path(tempfile.gettempdir()) / f"energon-ordering-mlm-{os.getuid()}"
    root = cache / TAGS[tag]
    if not (root / "megatron" / "training" / "checkpointing.py").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache))
        with tarfile.open(archive(tag)) as tf:
            tf.extractall(tmp, filter="data")
        try:
            (tmp / TAGS[tag]).rename(root)
        except OSError:  # another process unpacked it first
            pass
    return root


def use_megatron_lm(tag: str, *, multimodal_example: bool = False) -> Path:
    """Puts the tag's megatron/ (and optionally examples/multimodal) first on the import paths."""
    root = unpack(tag)
    if str(root) not in sys.path:
        # `megatron` is a namespace package: its __path__ is recomputed from sys.path, so the
        # tag's megatron/ (first on sys.path) comes before the installed wheel's.
        sys.path.insert(0, str(root))
    import megatron

    if str(root / "megatron") not in list(megatron.__path__):
        megatron.__path__.append(str(root / "megatron"))
    if multimodal_example:
        ex = str(root / "examples" / "multimodal")
        if ex not in sys.path:
            sys.path.insert(0, ex)
    return root


def installed_core_019() -> bool:
    """True if the installed megatron-core is 0.19.x or later (the py312 leg)."""
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return False
    return tuple(int(x) for x in __version__.split(".")[:2]) >= (0, 19)


def tag_params() -> list[Any]:
    """``pytest.param`` per Megatron-LM tag: core_v0.16.1 on the default Python, core_v0.19.0 in
    the py312 leg (Python 3.12 and megatron-core 0.19.x), each skipped without its sources."""
    return [
        pytest.param("core_v0.16.1", id="core_v0.16.1", marks=[
            pytest.mark.skipif(sys.version_info >= (3, 12), reason="the core 0.16.1 leg runs on the default Python"),
            pytest.mark.skipif(not have_sources("core_v0.16.1"), reason="no ../shared/thirdparty"),
        ]),
        pytest.param("core_v0.19.0", id="core_v0.19.0", marks=[
            pytest.mark.py312,
            pytest.mark.skipif(sys.version_info < (3, 12) or not installed_core_019(),
                               reason="needs Python 3.12 + megatron-core 0.19.x (.ci/py312)"),
            pytest.mark.skipif(not have_sources("core_v0.19.0"), reason="no ../shared/thirdparty"),
        ]),
    ]


def spawn_ranks(worker: Callable[..., None], args: tuple, out: Path, phase: str, world: int,
                what: str, timeout: float = 400) -> list[dict]:
    """Runs ``worker(rank, *args)`` in ``world`` spawned processes; each writes
    ``{out}/{phase}_rank{r}.json`` (with ``"error"`` if it failed). Fails the test on a hang
    (``what`` names the run) or a rank's error; returns the ranks' results."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, nprocs=world, join=False, start_method="spawn", args=args)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"{phase}: {what} did not finish on all {world} ranks within "
                        f"{timeout:.0f} s (hang)")
    res = [json.loads((out / f"{phase}_rank{r}.json").read_text()) for r in range(world)]
    for r in res:
        assert "error" not in r, f"rank {r.get('rank')}: {r['error']}"
    return res
