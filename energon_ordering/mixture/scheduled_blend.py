"""ScheduledBlendDataset: blend per-source datasets with weights that are a function of the step."""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from megatron.energon.flavors.base_dataset import SavableDataset, add_sample_restore_key
from megatron.energon.rng import WorkerRng
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset

from energon_ordering.mixture.policy import BLEND_POLICIES, deterministic_choice
from energon_ordering.errors import OrderingConfigError, OrderingTypeError, StateMismatchError
from energon_ordering.mixture.schedule import MixtureSchedule, unknown_source_message
from energon_ordering.source_tag import tag_source
from energon_ordering.state_stamp import stamp_differences

__all__ = ["ScheduledBlendDataset"]

T_sample = TypeVar("T_sample")

#: Version of the blend's saved-state layout and draw logic.
STATE_VERSION = 1


class ScheduledBlendDataset(BaseWrapperDataset[T_sample, T_sample], Generic[T_sample]):
    """Draws each sample from one of several sources with the weights ``schedule.weights(step)``.

    Place it after each source's own shuffle (``RepeatDataset -> ShuffleBufferDataset`` per
    source) and before ``encode_sample``; a shuffle buffer behind the blend would delay every
    phase switch by its size. ``OrderingTaskEncoder`` builds it from a metadataset.

    The step is derived inside the loader worker from Energon's rank-level batch index,
    ``step = (worker_config.active_worker_batch_index + lag_batches) // micro_batches_per_step``,
    so it is the same on every rank and replays identically on resume. Stages between the blend
    and the batch delay a sample's emission: a length pool of P samples per worker (micro-batch
    B, W workers) emits a sample drawn at batch b at a batch uniformly in
    ``[b, b + (P/B - 1) W]``, i.e. on average ``(P/B - 1) W / 2`` batches later.
    ``lag_batches`` shifts the schedule by that expected lag (lag compensation), so a phase
    switch reaches the batches at its step on average.

    Policies (:mod:`energon_ordering.mixture.policy`): ``random`` draws with Energon's
    ``WorkerRng`` (saved, different per rank and worker, which is right here); ``deterministic``
    always draws the source furthest behind its cumulative target (the running sum of its
    weights over all past draws), keeping the realised mixture within about one sample of the
    target over any window.

    Every yielded sample carries its source name in ``__subflavors__["source"]``.

    Finite if all sources are finite: an exhausted source is dropped and the weights of the
    others renormalised; iteration ends when every source with weight > 0 is exhausted.
    """

    source_names: tuple[str, ...]
    schedule: MixtureSchedule
    policy: str
    micro_batches_per_step: int
    lag_batches: float
    allow_schedule_change: bool

    _stamp: dict[str, Any]
    _emitted: list[int]
    _targets: list[float]
    _exhausted: list[bool]
    _worker_rng: WorkerRng

    _savable_fields = ("_stamp", "_emitted", "_targets", "_exhausted", "_worker_rng")

    def __init__(
        self,
        datasets: Mapping[str, SavableDataset[T_sample]] | Sequence[tuple[str, SavableDataset[T_sample]]],
        *,
        schedule: MixtureSchedule,
        worker_config: WorkerConfig,
        micro_batches_per_step: int = 1,
        policy: str = "random",
        lag_batches: float = 0.0,
        allow_schedule_change: bool = False,
    ):
        """Construct a ScheduledBlendDataset.

        Args:
            datasets: ``{source name: dataset}`` (or ``(name, dataset)`` pairs); the names must
                be exactly ``schedule.sources``.
            schedule: The mixture schedule.
            worker_config: Energon's worker configuration.
            micro_batches_per_step: Micro-batches per optimizer step on one rank (gradient
                accumulation): ``global_batch_size / (micro_batch_size * data_parallel_size)``.
            policy: ``"random"`` or ``"deterministic"``.
            lag_batches: Rank-level batches added to the batch index before the schedule is
                evaluated (lag compensation; 0 = evaluate at the draw step).
            allow_schedule_change: Restore a state saved under a different schedule (its
                counters are kept) instead of raising.
        """
        pairs = list(datasets.items()) if isinstance(datasets, Mapping) else list(datasets)
        if not isinstance(schedule, MixtureSchedule):
            raise OrderingTypeError(
                f"ScheduledBlendDataset: schedule = {schedule!r} must be a MixtureSchedule "
                "(MixtureSchedule.from_yaml(path) or .from_dict(d))."
            )
        names = [str(n) for n, _ in pairs]
        if len(set(names)) != len(names):
            raise OrderingConfigError(f"ScheduledBlendDataset: duplicate source names {names}.")
        missing = [s for s in schedule.sources if s not in names]
        unknown = [n for n in names if n not in schedule.sources]
        if missing or unknown:
            typos = "".join(f"; {unknown_source_message(s, names)}" for s in missing)
            raise OrderingConfigError(
                f"ScheduledBlendDataset: the datasets {names} do not match the schedule's sources "
                f"{list(schedule.sources)} (no dataset for {missing}; not in the schedule: "
                f"{unknown}{typos}). Name each dataset entry like its schedule source (metadataset "
                "`subflavors: {source: NAME}`), or add it to the schedule."
            )
        if policy not in BLEND_POLICIES:
            raise OrderingConfigError(
                f"ScheduledBlendDataset: policy = {policy!r} is unknown; use one of "
                f"{sorted(BLEND_POLICIES)}."
            )
        if (
            isinstance(micro_batches_per_step, bool)
            or not isinstance(micro_batches_per_step, numbers.Integral)
            or micro_batches_per_step < 1
        ):
            raise OrderingConfigError(
                f"ScheduledBlendDataset: micro_batches_per_step = {micro_batches_per_step!r} must "
                "be an int >= 1 (global batch / (micro batch * data-parallel size))."
            )
        if not isinstance(lag_batches, numbers.Real) or not lag_batches >= 0:
            raise OrderingConfigError(
                f"ScheduledBlendDataset: lag_batches = {lag_batches!r} must be a number >= 0."
            )
        # Keep the schedule's source order, so restore keys index the same dataset per name.
        by_name = dict(pairs)
        ordered = [by_name[s] for s in schedule.sources]
        super().__init__(ordered, worker_config=worker_config)
        self.source_names = tuple(schedule.sources)
        self.schedule = schedule
        self.policy = policy
        self.micro_batches_per_step = int(micro_batches_per_step)
        self.lag_batches = float(lag_batches)
        self.allow_schedule_change = bool(allow_schedule_change)
        self._cached_key: tuple[int, tuple[bool, ...]] | None = None
        self._cached_weights: np.ndarray | None = None
        self.reset_state_own()

    def _expected_stamp(self) -> dict[str, Any]:
        return {
            "state_version": STATE_VERSION,
            "schedule_fingerprint": self.schedule.fingerprint,
            "sources": list(self.source_names),
            "policy": self.policy,
        }

    def reset_state_own(self) -> None:
        n = len(self.source_names)
        self._stamp = self._expected_stamp()
        self._emitted = [0] * n
        self._targets = [0.0] * n
        self._exhausted = [False] * n
        self._worker_rng = WorkerRng(self.worker_config)

    def len_worker(self, worker_idx: int | None = None) -> int:
        return sum(ds.len_worker(worker_idx) for ds in self.datasets)

    def current_step(self) -> int:
        """The optimizer step the next draw is made for (in a loader worker only)."""
        batch_index = self.worker_config.active_worker_batch_index
        return int((batch_index + self.lag_batches) // self.micro_batches_per_step)

    def _weights(self, step: int) -> np.ndarray | None:
        """The draw weights at ``step``: the schedule's, 0 for exhausted sources, renormalised;
        None if no source with weight > 0 is left. Computed once per (step, exhausted set)."""
        key = (step, tuple(self._exhausted))
        if key != self._cached_key:
            weights = self.schedule.weights_table([step])[0]
            weights[list(self._exhausted)] = 0.0
            total = weights.sum()
            self._cached_weights = weights / total if total > 0 else None
            self._cached_key = key
        return self._cached_weights

    def _choose(self, weights: np.ndarray) -> int:
        if self.policy == "deterministic":
            return deterministic_choice(self._targets, self._emitted, weights)
        return self._worker_rng.choice_idx(torch.tensor(weights, dtype=torch.float64))

    def __iter__(self) -> Iterator[T_sample]:
        iters: list[Iterator[T_sample] | None] = [
            None if self._exhausted[i] or not ds.worker_has_samples() else iter(ds)
            for i, ds in enumerate(self.datasets)
        ]
        for i, it in enumerate(iters):
            if it is None:
                self._exhausted[i] = True
        while True:
            weights = self._weights(self.current_step())
            if weights is None:
                break  # every source that may still be drawn is exhausted
            idx = self._choose(weights)
            try:
                sample = next(iters[idx])  # type: ignore[arg-type]
            except StopIteration:
                iters[idx] = None
                self._exhausted[idx] = True
                continue
            if self.policy == "deterministic":
                for i, w in enumerate(weights):
                    self._targets[i] += float(w)
            self._emitted[idx] += 1
            yield add_sample_restore_key(
                tag_source(sample, self.source_names[idx]), idx, src=self
            )
        self._exhausted = [False] * len(self.source_names)

    def restore_sample(self, restore_key: tuple[str | int | tuple, ...]) -> T_sample:
        sample = super().restore_sample(restore_key)
        return tag_source(sample, self.source_names[restore_key[1]])

    def restore_state(self, state: FlexState) -> None:
        expected = self._expected_stamp()
        saved = state.get("_stamp") if state is not None else None
        if isinstance(saved, dict) and saved.get("sources") == expected["sources"]:
            # Same sources: only the mixture differs, which the override may let through.
            if self.allow_schedule_change:
                saved = expected
        diff = stamp_differences(saved, expected)
        if diff is not None:
            raise StateMismatchError(
                f"ScheduledBlendDataset: cannot restore a state written under a different "
                f"mixture ({diff}). Restore with the original schedule, or set "
                "allow_schedule_change=True (OrderingConfig.allow_schedule_change) to continue the "
                "counters under the new one (same sources only)."
            )
        super().restore_state(state)
        self._stamp = expected

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "datasets": [(n, ds.config()) for n, ds in zip(self.source_names, self.datasets)],
            "schedule": self.schedule.to_dict(),
            "schedule_fingerprint": self.schedule.fingerprint,
            "policy": self.policy,
            "micro_batches_per_step": self.micro_batches_per_step,
            "lag_batches": self.lag_batches,
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        return (
            f"ScheduledBlendDataset(sources={list(self.source_names)}, policy={self.policy!r}, "
            f"schedule={self.schedule.fingerprint}, micro_batches_per_step="
            f"{self.micro_batches_per_step}, lag_batches={self.lag_batches})"
        )
