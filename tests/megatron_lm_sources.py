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

import os
import sys
import tarfile
import tempfile
from pathlib import Path

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
