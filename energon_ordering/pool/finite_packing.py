"""FinitePackingDataset: Energon's packing, resumable at the end of a finite stream.

Energon's :class:`~megatron.energon.wrappers.PackingDataset` does not save whether its inner
dataset has ended. When the inner stream of a finite epoch (``repeat=False``) ends, the
webdataset reader resets its own state to "start of a new epoch" while the packer still flushes
its last packs: the packs already selected, then the partial reading buffer. A state saved
during that flush (the last micro-batches of the epoch, or right after the last one) restores to
a packer over a fresh epoch: the resumed run refills its reading buffer from the next epoch,
packs documents of it together with the saved ones, and goes on into that epoch (Energon 7.4.1;
measured: a state saved after the last micro-batch resumed with 42 micro-batches instead of
none). This subclass saves that flag too (``_inner_done``): a restored flush does not read the
inner dataset again and ends where the uninterrupted run ends. Its packs are otherwise identical
to Energon's (the same buffers, the same calls of the packers).

It also calls ``epoch_end`` (if given) once the last pack of a finite epoch has gone out, where
the pack-time cut reports an epoch that dropped every sample
(:meth:`energon_ordering.warmup.pack_cap.PackCapDataset.end_epoch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from megatron.energon.wrappers import PackingDataset

__all__ = ["FinitePackingDataset"]

T_sample = TypeVar("T_sample")
T_encoded_sample = TypeVar("T_encoded_sample")
T_batch_sample = TypeVar("T_batch_sample")


class FinitePackingDataset(
    PackingDataset[T_sample, T_encoded_sample, T_batch_sample],
    Generic[T_sample, T_encoded_sample, T_batch_sample],
):
    """Energon's packing plus a saved "inner stream ended" flag (see the module docstring).

    Finite if the inner dataset is; after the last pack of an epoch the flag is cleared, so
    iterating again starts the next epoch exactly as Energon's packer does.
    """

    _inner_done: bool

    _savable_fields = (*PackingDataset._savable_fields, "_inner_done")

    def __init__(self, *args: Any, epoch_end: Callable[[], None] | None = None, **kwargs: Any):
        """Construct a FinitePackingDataset: Energon's ``PackingDataset`` arguments, plus

        Args:
            epoch_end: Called (in the loader worker) after the last pack of a finite epoch.
        """
        self.epoch_end = epoch_end
        super().__init__(*args, **kwargs)

    @classmethod
    def replacing(
        cls, packing: PackingDataset, *, epoch_end: Callable[[], None] | None = None
    ) -> FinitePackingDataset:
        """The same packer as Energon's ``packing`` (built by ``TaskEncoder.build_batch``)."""
        return cls(
            packing.dataset,
            buffer_size=packing.buffer_size,
            pre_packer=packing.pre_packer,
            final_packer=packing.final_packer,
            final_packer_stateless=packing.final_packer_stateless,
            sample_encoder=packing.sample_encoder,
            sample_encoder_stateless=packing.sample_encoder_stateless,
            packer_config=packing.packer_config,
            pre_packer_failure_tolerance=packing.pre_packer_failure_tolerance,
            final_packer_failure_tolerance=packing.final_packer_failure_tolerance,
            sample_encoder_failure_tolerance=packing.sample_encoder_failure_tolerance,
            worker_config=packing.worker_config,
            epoch_end=epoch_end,
        )

    def reset_state_own(self) -> None:
        super().reset_state_own()
        self._inner_done = False

    def _fill_reading_buffer(self, source_iter: Iterator, log_progress: bool = False) -> bool:
        # Energon's loop creates the source iterator but reads it only here: after the end of
        # the inner stream (saved) it is never advanced, so the inner dataset is not restarted.
        if self._inner_done:
            return False
        if super()._fill_reading_buffer(source_iter, log_progress):
            return True
        self._inner_done = True
        return False

    def __iter__(self) -> Iterator[T_batch_sample]:
        yield from super().__iter__()
        self._inner_done = False
        if self.epoch_end is not None:
            self.epoch_end()

    def config(self) -> dict[str, Any]:
        epoch_end = None if self.epoch_end is None else self._function_config(self.epoch_end)
        return {**super().config(), "epoch_end": epoch_end}

    def __str__(self) -> str:
        return f"Finite{super().__str__()}"
