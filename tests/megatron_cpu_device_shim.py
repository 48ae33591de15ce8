"""Runs Megatron-LM's real ``pretrain()`` / ``train()`` on CPU: device plumbing only.

Why: Megatron-LM's training entry points assume one CUDA device per rank. They assert
``torch.cuda.is_available()`` (``initialize_megatron``), build tensors with ``device='cuda'`` or
``torch.cuda.current_device()`` (the start-time all-reduce in ``pretrain``, the loss
bookkeeping in ``training_log``, DDP's gradient buffers), move the model with ``.cuda()``,
create side streams for DDP, query CUDA memory for the logs, keep CUDA RNG states, and compile
fused CUDA kernels with nvcc. The CI machines have no GPU. This shim maps every one of those to
the CPU and nothing else: the training loop, the optimizer, the checkpoint code and the data
path run unmodified. With ``--distributed-backend gloo`` the collectives run on CPU tensors.

It (1) installs a ``TorchFunctionMode`` that rewrites any CUDA ``device`` argument to ``cpu`` and
makes ``Tensor.cuda()`` / ``Module.cuda()`` a no-op; (2) replaces the ``torch.cuda`` functions
Megatron calls with CPU equivalents (RNG state -> the CPU generator, streams -> no-op contexts,
memory statistics -> zeros); (3) makes the nvcc build of ``megatron.legacy.fused_kernels`` a no-op
(run with ``--no-masked-softmax-fusion`` etc., so the kernels are never called), runs Megatron's
``torch.compile``'d fusions eagerly, and skips the
``make`` of megatron-core's C++ dataset helpers, which the wheel ships prebuilt without their
Makefile (and which Energon data does not use). Test-only: never
imported by the package. Install it in a fresh process (a spawned worker) before Megatron runs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_MODE: Any = None


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # torch.cuda.current_device() -> 0
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CpuForCuda(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU; ``.cuda()`` returns the tensor itself."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _Stream:
    """A no-op stand-in for ``torch.cuda.Stream`` (CPU work is synchronous)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *a: Any, **k: Any) -> Any:
        return _Event()


class _Event(_Stream):
    def record(self, *a: Any, **k: Any) -> None:
        pass

    def wait(self, *a: Any, **k: Any) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0

    def query(self) -> bool:
        return True


def install() -> None:
    """Installs the shim for the rest of the process (idempotent)."""
    global _MODE
    if _MODE is not None:
        return
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0
    cuda.memory_stats = lambda *a, **k: {}
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.get_device_capability = lambda *a, **k: (8, 0)
    cuda.get_device_name = lambda *a, **k: "cpu"
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    # torch's own device-generic code (torch.optim's graph-capture check) asks torch.accelerator,
    # which a CUDA build of torch (the default wheel on Python 3.12) answers "cuda": no accelerator.
    torch.accelerator.current_accelerator = lambda check_available=False: None
    # Megatron's fusions are torch.compile'd (jit_fuser); with the GPU claimed above the compiler
    # would target it, so they run eagerly (the same math).
    import torch._dynamo as dynamo

    dynamo.config.disable = True
    import megatron.core.datasets.utils as dataset_utils

    # `make` of megatron-core's C++ dataset helpers: the wheel ships them prebuilt
    # (helpers_cpp.*.so) but not their Makefile, so initialize_megatron's rebuild exits.
    dataset_utils.compile_helpers = lambda: None
    try:
        from megatron.legacy import fused_kernels

        fused_kernels.load = lambda args: None  # nvcc build of CUDA kernels (never called here)
    except ImportError:
        pass
    _MODE = _CpuForCuda()
    _MODE.__enter__()
