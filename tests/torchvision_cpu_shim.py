"""Lets PyPI's torchvision import beside the CPU build of torch (for Megatron's multimodal example).

Why: the torchvision wheel that pairs with torch 2.13.0 (0.28.0) ships CUDA-built C operators
that do not load on the CPU build of torch; ``torchvision/_meta_registrations.py`` then fails at
import (``operator torchvision::nms does not exist``) because it registers fake (meta) kernels
for those CUDA-only operators. Megatron-LM's ``examples/multimodal`` uses only the pure-Python
transforms (``torchvision.transforms``: Compose, Resize, ToTensor, Normalize, ToPILImage), which
need none of them. Installing an empty ``torchvision._meta_registrations`` before the import
skips those registrations and nothing else. With a CUDA build of torch (the default torch wheel
on Python 3.12, which runs on CPU too) torchvision's operators load, so nothing is installed.
Test-only: never imported by the package.
"""

from __future__ import annotations

import sys
import types


def install() -> None:
    """Call before the first ``import torchvision``; a no-op with a CUDA build of torch."""
    import torch

    if torch.version.cuda is not None:  # torchvision's C operators load: nothing to skip
        return
    name = "torchvision._meta_registrations"
    if "torchvision" not in sys.modules and name not in sys.modules:
        sys.modules[name] = types.ModuleType(name)
