"""A pass-through stage that holds Energon's end-of-iteration checkpoint of a loader worker:
the forced interleaving of the finite-epoch tests (a state asked for after a worker yielded its
last micro-batch of an epoch, but before Energon stored that worker's end checkpoint)."""

from __future__ import annotations

from typing import Any

from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset


class EpochEndGate(BaseWrapperDataset):
    """Passes samples through; after its stream's ``hold``-th end in a loader worker, its next
    ``save_state()`` (Energon's end-of-iteration checkpoint of that worker) waits for
    ``release``. Not saved: it has no state of its own."""

    _savable_fields = ()

    def __init__(self, dataset: Any, *, release: Any, worker_config: WorkerConfig, hold: int = 1):
        super().__init__(dataset, worker_config=worker_config)
        self.release = release
        self.hold = hold
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self._ends = 0
        self._at_end = False

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def __iter__(self):
        self._at_end = False
        yield from self.dataset
        self._ends += 1
        self._at_end = self._ends == self.hold

    def save_state(self):
        if self._at_end:
            self._at_end = False
            assert self.release.wait(60), "EpochEndGate was never released"
        return super().save_state()

    def config(self) -> dict[str, Any]:
        return {"type": type(self).__qualname__, "hold": self.hold,
                "dataset": self.dataset.config(), "worker_config": self.worker_config.config()}

    def __str__(self) -> str:
        return f"EpochEndGate(hold={self.hold}, dataset={self.dataset})"
