"""FiniteShuffleBufferDataset: Energon's shuffle buffer, resumable at the end of a finite stream.

Energon's :class:`~megatron.energon.wrappers.ShuffleBufferDataset` does not save whether its
inner dataset has ended. When the inner stream of a finite epoch (``repeat=False``) ends, the
webdataset reader resets its own state to "start of a new epoch" while the buffer still drains.
A state saved during that drain therefore restores to a buffer over a fresh epoch: the resumed
run drains the buffer and then replays the whole epoch (Energon 7.4.1). This subclass saves that
flag too (``_inner_done``), so a restored drain ends where the uninterrupted run ends. Its order
is otherwise identical to Energon's (same RNG draws, same buffer).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from megatron.energon.wrappers import ShuffleBufferDataset

__all__ = ["FiniteShuffleBufferDataset"]

T_sample = TypeVar("T_sample")


class FiniteShuffleBufferDataset(ShuffleBufferDataset[T_sample], Generic[T_sample]):
    """Energon's shuffle buffer plus a saved "inner stream ended" flag (see the module docstring).

    Finite if the inner dataset is; after the last sample of an epoch the flag is cleared, so
    iterating again starts the next epoch exactly as Energon's buffer does.
    """

    _inner_done: bool

    _savable_fields = ("_active_buffer", "_worker_rng", "_inner_done")

    def reset_state_own(self) -> None:
        super().reset_state_own()
        self._inner_done = False

    def __iter__(self) -> Iterator[T_sample]:
        buffer = self._active_buffer
        buffer.worker_start()
        if not self._inner_done:
            it = iter(buffer.append_iter())
            while True:
                held = buffer.len_worker()
                if held >= self.size:
                    yield buffer.pop(self._worker_rng.randbelow(held))
                else:
                    try:
                        next(it)
                    except StopIteration:
                        break
            self._inner_done = True
        while buffer.len_worker() > 0:
            yield buffer.pop(self._worker_rng.randbelow(buffer.len_worker()))
        self._inner_done = False

    def __str__(self) -> str:
        return f"FiniteShuffleBufferDataset(size={self.size}, dataset={self.dataset})"
