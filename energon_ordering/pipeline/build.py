"""Hands one training build's plan to the task encoder's hooks, without state on the encoder.

Energon's ``build_train_datasets`` calls the hooks ``_load_dataset``, ``build_encode_sample``
and ``build_batch`` itself, with its own arguments only. The plan those hooks follow
(:class:`~energon_ordering.pipeline.plan.PipelinePlan`) therefore travels in a
:class:`contextvars.ContextVar` holding an immutable :class:`TrainBuild`, set by
:meth:`TrainBuild.active` for exactly the duration of ``build_train_datasets``.

Why a context variable and not attributes on the encoder, nor a build of our own:

- Attributes set on ``self`` for a call are shared by every thread that builds with the same
  encoder, outlive a build that raised unless every path resets them, and make each hook's
  behaviour depend on hidden state. A context variable is private to the thread (and asyncio
  task) that sets it, is reset by a token even when the build raises, and is never pickled:
  loader workers receive the built datasets, not the encoder's build state.
- Rebuilding Energon's ``build_train_datasets`` top to bottom (as the scheduled blend does,
  because it has to put the shuffle before the blend) would copy Energon's blend modes, worker
  rotation and cooker checks, and silently stop following Energon when those change.

A hook of another encoder (or a validation build, which has no active build) sees no plan:
:func:`current_build` returns the build only to the encoder that started it.

What the build collects while Energon loads the sources (each source's split-off load functions
and length source, the identity of each length index) is per build too: it lives in the
build's :class:`SourceLoads`, never on the encoder.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from energon_ordering.pipeline.plan import PipelinePlan

__all__ = ["SourceLoads", "TrainBuild", "current_build"]


class SourceLoads:
    """What one build collects while Energon loads its sources (pre-encode pool only):
    per source, its split-off load functions and its length source, in load order, and the
    identity of each length index and a packed plan's window steps, for the state stamp.
    Append-only; one per build."""

    def __init__(self) -> None:
        self._sources: list[tuple[list[Any], Any]] = []
        self._length_indexes: list[dict[str, Any]] = []
        #: A packed planned order's window steps once its length index is read (its default
        #: depends on how many samples a pack holds), for the state stamp; None: the plan's.
        self.window_steps: int | None = None

    def add(self, load_fns: list[Any], length_source: Any) -> int:
        """Records one source; returns its index (the order Energon loaded it in)."""
        self._sources.append((load_fns, length_source))
        return len(self._sources) - 1

    def add_length_index(self, identity: dict[str, Any]) -> None:
        """Records the identity of a length index a source sorts by."""
        self._length_indexes.append(identity)

    @property
    def load_fns(self) -> list[list[Any]]:
        """Per source, its load functions."""
        return [fns for fns, _ in self._sources]

    @property
    def length_sources(self) -> list[Any]:
        """Per source, its length index or length function."""
        return [length for _, length in self._sources]

    @property
    def length_indexes(self) -> list[dict[str, Any]]:
        """The identity of each length index, in load order."""
        return list(self._length_indexes)

    def __len__(self) -> int:
        return len(self._sources)


@dataclasses.dataclass(frozen=True)
class TrainBuild:
    """One ``build_train_datasets`` call: the encoder building, its plan, and what the build
    collects from its sources.

    Args:
        encoder: The task encoder whose ``build_train_datasets`` is running.
        plan: The pipeline it builds.
        loads: Filled while Energon loads the sources.
    """

    encoder: Any
    plan: PipelinePlan
    loads: SourceLoads = dataclasses.field(default_factory=SourceLoads)

    @contextlib.contextmanager
    def active(self) -> Iterator[TrainBuild]:
        """Makes this the current build of this thread (and asyncio task) until the block ends."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


_CURRENT: contextvars.ContextVar[TrainBuild | None] = contextvars.ContextVar(
    "energon_ordering_train_build", default=None
)


def current_build(encoder: Any) -> TrainBuild | None:
    """The training build ``encoder`` is running in this thread, or None (e.g. a validation
    dataset, or a hook called outside ``build_train_datasets``)."""
    build = _CURRENT.get()
    return build if build is not None and build.encoder is encoder else None
