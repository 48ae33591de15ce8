"""A loader iterated again after its iteration raised refuses, instead of running on silently.

Energon (7.4.1) ``SavableDataLoader`` with loader workers keeps one epoch generator
(``_epoch_iterator``) while it yields data, and drops it only when the epoch ends normally. An
error raised in a worker (e.g. a :class:`~energon_ordering.errors.LengthIndexError` from a
length lookup) ends that generator with the error; ``iter(loader)`` then returns the finished
generator, and every later epoch is empty, without a word. Without loader workers a new
generator continues from the pipeline's state as the error left it (a pool without the samples
it was filling): other samples, also without a word.

:func:`install` patches ``SavableDataLoader`` (once, in the main process, where the loader
lives): an iteration that ends with an exception marks the loader, and iterating it again raises
an error of the same type (a package error) naming the first one and the fix. Restoring a state
into the loader (``restore_state_rank``: only possible without loader workers, where it replaces
the pipeline's state) clears the mark.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from megatron.energon.savable_loader import SavableDataLoader

from energon_ordering.errors import OrderingError, show

__all__ = ["install"]

#: The loader attribute that holds the failed iteration's error (absent: none failed).
_FAILED = "_energon_ordering_failed"
#: Set on the patched methods, so that :func:`install` patches once.
_MARK = "_energon_ordering_failed_epoch"


def install() -> None:
    """Patches ``SavableDataLoader``'s ``_epoch_iter``, ``__iter__`` and
    ``restore_state_rank`` (idempotent; see the module docstring)."""
    if getattr(SavableDataLoader.__iter__, _MARK, False):
        return
    epoch_iter = SavableDataLoader._epoch_iter
    start = SavableDataLoader.__iter__
    restore = SavableDataLoader.restore_state_rank

    def _epoch_iter(self: SavableDataLoader) -> Iterator[Any]:
        try:
            yield from epoch_iter(self)
        except Exception as e:
            setattr(self, _FAILED, e)
            raise

    def __iter__(self: SavableDataLoader) -> Iterator[Any]:
        failed = getattr(self, _FAILED, None)
        if failed is not None:
            raise _again(failed)
        return start(self)

    def restore_state_rank(self: SavableDataLoader, state: Any) -> None:
        restore(self, state)
        self.__dict__.pop(_FAILED, None)

    for fn in (_epoch_iter, __iter__, restore_state_rank):
        setattr(fn, _MARK, True)
    SavableDataLoader._epoch_iter = _epoch_iter
    SavableDataLoader.__iter__ = __iter__
    SavableDataLoader.restore_state_rank = restore_state_rank


def _again(failed: BaseException) -> OrderingError:
    """The error of a second iteration after ``failed`` ended the first."""
    cls = type(failed) if isinstance(failed, OrderingError) else OrderingError
    return cls(
        f"this loader's iteration stopped with {type(failed).__name__}: "
        f"{show(_message(failed), 300)}; its data state "
        "went with it, so iterating it again would run an empty epoch (with loader workers) or "
        "continue from a broken state. Fix the cause, then build a new loader and restore the "
        "last checkpoint's state into it (restore_state_rank)."
    )


def _message(error: BaseException) -> str:
    """The error's own message: from a loader worker, torch wraps it as ``Caught X in DataLoader
    worker process N.`` and the worker's traceback, which ends with ``module.X: message``."""
    lines = [x for x in str(error).strip().splitlines() if x.strip()] or [""]
    if len(lines) > 1 and lines[0].startswith("Caught "):
        last = lines[-1]
        prefix = f"{type(error).__module__}.{type(error).__qualname__}: "
        return last[len(prefix):] if last.startswith(prefix) else last
    return lines[0]
