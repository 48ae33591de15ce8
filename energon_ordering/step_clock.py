"""Which optimizer step a step-dependent stage is at: the plan's, where a planned source feeds it.

A stage whose output depends on the optimizer step (the sequence-length warmup's cap, a pack's
target) reads the step of the micro-batch being built. In the pool modes that is Energon's
rank-level batch index over the micro-batches per step
(``worker_config.active_worker_batch_index // M``), which an exact restore brings back with the
loader's state. In the planned order an elastic resume (another data-parallel size, other
micro-batches per step) starts a loader whose Energon counters begin at 0 in the middle of the
plan: the step there is the plan's own, which the planned source knows for every sample it yields
(contract 13). :func:`find_step_clock` finds that source below a stage; :func:`current_step` reads
the step from it, or from Energon's index where there is none.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from megatron.energon.worker import WorkerConfig

__all__ = ["StepClock", "current_step", "find_step_clock"]


@runtime_checkable
class StepClock(Protocol):
    """A stage that knows the global optimizer step of the sample it yielded last."""

    def emission_step(self) -> int:
        """The global optimizer step of the micro-batch the last yielded sample belongs to."""
        ...


def find_step_clock(dataset: Any) -> StepClock | None:
    """The first stage at or below ``dataset`` (down its chain of single inner datasets) that is
    a :class:`StepClock`; None: the step is Energon's batch index. The walk stops at a stage
    over several datasets (a blend: the planned source is never below one)."""
    while dataset is not None:
        if isinstance(dataset, StepClock):
            return dataset
        inner = getattr(dataset, "datasets", None)  # Energon's wrappers keep a tuple
        if inner is not None:
            dataset = inner[0] if len(inner) == 1 else None
        else:
            dataset = getattr(dataset, "dataset", None)
    return None


def current_step(clock: StepClock | None, worker_config: WorkerConfig,
                 micro_batches_per_step: int) -> int:
    """The optimizer step of the micro-batch being built (in a loader worker): the clock's, else
    ``worker_config.active_worker_batch_index // micro_batches_per_step``."""
    if clock is not None:
        return clock.emission_step()
    return worker_config.active_worker_batch_index // micro_batches_per_step
