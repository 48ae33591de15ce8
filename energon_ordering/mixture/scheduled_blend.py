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

from energon_ordering.errors import OrderingConfigError, OrderingTypeError, StateMismatchError
from energon_ordering.mixture.policy import BLEND_POLICIES, deterministic_choice
from energon_ordering.mixture.schedule import MixtureSchedule, unknown_source_message
from energon_ordering.mixture.step_counts import StepLayout, step_source_counts
from energon_ordering.source_tag import tag_source
from energon_ordering.state_stamp import stamp_differences
from energon_ordering.errors import show

__all__ = ["ScheduledBlendDataset"]

T_sample = TypeVar("T_sample")

#: Version of the blend's saved-state layout and draw logic. 3: the deterministic policy lays
#: each step out in a quota-keeping order (the ideal-position merge where it keeps every source
#: within one sample at every draw, else earliest deadline first: every window of global draws
#: within 2 samples for any number of sources); 2 always merged the step's items by ideal
#: position; 1 drew a per-rank sequence.
#: The random policy draws the same in all three.
STATE_VERSION = 3

#: Why a deterministic state of an older blend version cannot be continued, by version.
_OLDER_DETERMINISTIC = {
    1: "drew a per-rank sequence (the same on every rank, so a step's error was R times a "
       "rank's)",
    2: "laid each step's draws out merged by ideal position (the same counts per step, in "
       "another order within some steps)",
}


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
    ``WorkerRng`` (saved, different per rank and worker, which is right here).
    ``deterministic`` is a pure function of the GLOBAL draw index, so the ranks together hit
    the target per optimizer step, not each rank on its own:

    - This worker's k-th draw (worker w of W, micro-batch size B) belongs to rank-level
      micro-batch ``b = w + W (k // B)`` (Energon's loader takes micro-batch b from worker
      ``b % W``) at position ``j = k % B``; on rank r of R that is global draw
      ``(b R + r) B + j``, i.e. position ``((b mod M) R + r) B + j`` of a step's
      ``G = R M B`` draws.
    - The step's source counts are the schedule's weights times G rounded with a carry, and
      the step's draws are laid out in a quota-keeping order against each source's running
      integral (:mod:`energon_ordering.mixture.step_counts`). A worker lays out a step once
      and serves its micro-batches of that step from it; the layout is a pure function of the
      weights, the carry at the step start (saved) and G, so nothing about other ranks is
      simulated.
    - Without buffering between the blend and the batch (no pool, no packing), draw k is in
      micro-batch b exactly, so every optimizer step holds each source within one sample of
      ``weight * G`` and every window of consecutive global draws is within 2 samples (within
      1 with two sources; see the module for the rare steps with several near-zero-weight
      sources that exceed it). The weights are those of the step from
      Energon's batch index (with ``lag_batches``), as for ``random``.
    - With a pool (or packing, or samples skipped by an error handler) between blend and
      batch, the samples of a step come from other draws, so no per-step claim can hold, and
      draw k no longer belongs to micro-batch b. The blend notices (Energon's batch index at
      the draw differs from b) and from then on draws by the per-rank rule of
      :func:`~energon_ordering.mixture.policy.deterministic_choice` (each rank within 2
      samples of its target over any window of its own draws, the pre-version-2 behaviour),
      with targets starting at the counts drawn so far.
    - Finite sources: once a source is exhausted (``repeat=False``) the global layout cannot
      be followed either (ranks run out at different draws); the blend switches to the same
      per-rank rule over the sources left. The switch and that rule's counters are saved, so
      both cases stay exact on resume.

    Every yielded sample carries its source name in ``__subflavors__["source"]``.

    Finite if all sources are finite: an exhausted source is dropped and the weights of the
    others renormalised; iteration ends when every source with weight > 0 is exhausted.
    """

    source_names: tuple[str, ...]
    schedule: MixtureSchedule
    policy: str
    micro_batches_per_step: int
    batch_size: int | None
    lag_batches: float
    allow_schedule_change: bool

    _stamp: dict[str, Any]
    _emitted: list[int]
    _targets: list[float]
    _exhausted: list[bool]
    _worker_rng: WorkerRng
    _draws: int
    _carry_step: int
    _carry: list[float]
    _per_rank: bool

    _savable_fields = (
        "_stamp", "_emitted", "_targets", "_exhausted", "_worker_rng",
        "_draws", "_carry_step", "_carry", "_per_rank",
    )

    def __init__(
        self,
        datasets: Mapping[str, SavableDataset[T_sample]] | Sequence[tuple[str, SavableDataset[T_sample]]],
        *,
        schedule: MixtureSchedule,
        worker_config: WorkerConfig,
        micro_batches_per_step: int = 1,
        batch_size: int | None = None,
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
            batch_size: Micro-batch size B, in samples, as given to Energon's
                ``get_train_dataset``; None: unbatched (1). The deterministic policy places
                draws by it.
            policy: ``"random"`` or ``"deterministic"``.
            lag_batches: Rank-level batches added to the batch index before the schedule is
                evaluated (lag compensation; 0 = evaluate at the draw step).
            allow_schedule_change: Restore a state saved under a different schedule (its
                counters are kept) instead of raising.
        """
        pairs = list(datasets.items()) if isinstance(datasets, Mapping) else list(datasets)
        if not isinstance(schedule, MixtureSchedule):
            raise OrderingTypeError(
                f"ScheduledBlendDataset: schedule = {show(schedule)} must be a MixtureSchedule "
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
                f"ScheduledBlendDataset: policy = {show(policy)} is unknown; use one of "
                f"{sorted(BLEND_POLICIES)}."
            )
        if (
            isinstance(micro_batches_per_step, bool)
            or not isinstance(micro_batches_per_step, numbers.Integral)
            or micro_batches_per_step < 1
        ):
            raise OrderingConfigError(
                f"ScheduledBlendDataset: micro_batches_per_step = {show(micro_batches_per_step)} must "
                "be an int >= 1 (global batch / (micro batch * data-parallel size))."
            )
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
            or batch_size < 1
        ):
            raise OrderingConfigError(
                f"ScheduledBlendDataset: batch_size = {show(batch_size)} must be an int >= 1 (the "
                "micro-batch size passed to get_train_dataset) or None (unbatched)."
            )
        if not isinstance(lag_batches, numbers.Real) or not lag_batches >= 0:
            raise OrderingConfigError(
                f"ScheduledBlendDataset: lag_batches = {show(lag_batches)} must be a number >= 0."
            )
        # Keep the schedule's source order, so restore keys index the same dataset per name.
        by_name = dict(pairs)
        ordered = [by_name[s] for s in schedule.sources]
        super().__init__(ordered, worker_config=worker_config)
        self.source_names = tuple(schedule.sources)
        self.schedule = schedule
        self.policy = policy
        self.micro_batches_per_step = int(micro_batches_per_step)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.lag_batches = float(lag_batches)
        self.allow_schedule_change = bool(allow_schedule_change)
        self._cached_key: tuple[int, tuple[bool, ...]] | None = None
        self._cached_weights: np.ndarray | None = None
        self._cached_layout: tuple[int, StepLayout] | None = None
        self._cached_block: tuple[int, int, list[int]] | None = None
        self.reset_state_own()

    def _expected_stamp(self) -> dict[str, Any]:
        return {
            "state_version": STATE_VERSION,
            "schedule_fingerprint": self.schedule.fingerprint,
            "sources": list(self.source_names),
            "policy": self.policy,
            "batch_size": self.batch_size,
        }

    def reset_state_own(self) -> None:
        n = len(self.source_names)
        self._stamp = self._expected_stamp()
        self._emitted = [0] * n
        self._targets = [0.0] * n
        self._exhausted = [False] * n
        self._worker_rng = WorkerRng(self.worker_config)
        self._draws = 0
        self._carry_step = 0
        self._carry = [0.0] * n
        self._per_rank = False
        self._cached_layout = None
        self._cached_block = None

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

    @property
    def draws_per_step(self) -> int:
        """G = world size x micro-batches per step x micro-batch size: global draws per step."""
        return self.worker_config.world_size * self.micro_batches_per_step * (self.batch_size or 1)

    def _layout(self, step: int) -> StepLayout:
        """The layout of ``step``, advancing the saved carry from its step (O(S) per step)."""
        if self._cached_layout is not None and self._cached_layout[0] == step:
            return self._cached_layout[1]
        if step < self._carry_step:  # the batch index never goes back; be exact if it did
            self._carry_step, self._carry = 0, [0.0] * len(self.source_names)
        if step > self._carry_step:
            weights = self.schedule.weights_table(np.arange(self._carry_step, step))
            _, carry = step_source_counts(weights, self.draws_per_step, self._carry)
            self._carry_step, self._carry = step, [float(c) for c in carry]
        layout = StepLayout.of_step(
            self.schedule.weights_table([step])[0], self.draws_per_step, self._carry
        )
        self._cached_layout = (step, layout)
        return layout

    def _nominal_micro_batch(self) -> int:
        """Rank-level micro-batch of this worker's next draw if B draws make a micro-batch."""
        num_workers = max(1, self.worker_config.num_workers)
        per_batch = self.batch_size or 1
        return self.worker_config.rank_worker_id() + num_workers * (self._draws // per_batch)

    def _global_choice(self, step: int) -> int:
        """The source of this worker's next draw under the global layout (see the class)."""
        B = self.batch_size or 1
        micro_batch = self._nominal_micro_batch()
        # lag_batches shifts the schedule by whole micro-batches: floor((b + lag) / M) equals
        # floor((b + floor(lag)) / M) for integer b and M.
        in_step = (micro_batch + int(self.lag_batches)) % self.micro_batches_per_step
        start = (in_step * self.worker_config.world_size + self.worker_config.rank) * B
        block = self._cached_block
        if block is None or block[0] != step or block[1] != start:
            block = (step, start, self._layout(step).sources(start, B))
            self._cached_block = block
        return block[2][self._draws % B]

    def _choose(self, weights: np.ndarray, step: int) -> int:
        if self.policy == "deterministic":
            if (
                not self._per_rank
                and self._nominal_micro_batch() != self.worker_config.active_worker_batch_index
            ):
                # Something between the blend and the batch holds or drops samples (a pool,
                # packing, an error handler): draws no longer map to micro-batches.
                self._switch_to_per_rank()
            if self._per_rank:
                return deterministic_choice(self._targets, self._emitted, weights)
            return self._global_choice(step)
        return self._worker_rng.choice_idx(torch.tensor(weights, dtype=torch.float64))

    def _switch_to_per_rank(self) -> None:
        """From now on the deterministic policy uses the per-rank rule, starting level
        (targets = what was drawn so far). Saved, so a resume continues the same way."""
        if not self._per_rank:
            self._per_rank = True
            self._targets = [float(e) for e in self._emitted]

    def _mark_exhausted(self, idx: int) -> None:
        self._switch_to_per_rank()
        self._exhausted[idx] = True

    def __iter__(self) -> Iterator[T_sample]:
        iters: list[Iterator[T_sample] | None] = [
            None if self._exhausted[i] or not ds.worker_has_samples() else iter(ds)
            for i, ds in enumerate(self.datasets)
        ]
        for i, it in enumerate(iters):
            if it is None and not self._exhausted[i]:
                self._mark_exhausted(i)
        while True:
            step = self.current_step()
            weights = self._weights(step)
            if weights is None:
                break  # every source that may still be drawn is exhausted
            idx = self._choose(weights, step)
            try:
                sample = next(iters[idx])  # type: ignore[arg-type]
            except StopIteration:
                iters[idx] = None
                self._mark_exhausted(idx)
                continue
            if self.policy == "deterministic" and self._per_rank:
                for i, w in enumerate(weights):
                    self._targets[i] += float(w)
            self._emitted[idx] += 1
            self._draws += 1
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
        if isinstance(saved, dict) and saved.get("state_version") in _OLDER_DETERMINISTIC:
            state, saved = self._upgraded(state, saved, expected)
        if isinstance(saved, dict) and saved.get("sources") == expected["sources"]:
            # Same sources: only the mixture differs, which the override may let through.
            if self.allow_schedule_change:
                saved = {**saved, **{k: expected[k] for k in ("schedule_fingerprint", "policy")}}
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
        self._cached_layout = None
        self._cached_block = None

    def _upgraded(
        self, state: FlexState, saved: dict[str, Any], expected: dict[str, Any]
    ) -> tuple[FlexState, dict[str, Any]]:
        """A state of an older blend version: its ``deterministic`` sequence differs from this
        version's and cannot be continued, so it is refused; a ``random`` state continues
        exactly (that policy's draws did not change), and so does a version-2
        ``deterministic`` state that had already switched to the per-rank rule (a pool or
        packing behind the blend, or an exhausted source): version 3 changed only the global
        layout. A version-1 state gets the fields version 2 added (draw counter, carry,
        per-rank switch) at their start: the random policy never reads them."""
        version = saved.get("state_version")
        per_rank = version == 2 and state.get("_per_rank") is True
        if "deterministic" in (saved.get("policy"), self.policy) and not per_rank:
            raise StateMismatchError(
                f"ScheduledBlendDataset: the state was written by blend state version {version} "
                f"(policy {show(saved.get('policy'))}), whose deterministic policy "
                f"{_OLDER_DETERMINISTIC[version]}; version {STATE_VERSION} lays each step of "
                "global draws out in a quota-keeping order (earliest deadline first where the "
                "ideal-position merge is not) and cannot continue it. Resume with "
                "the energon_ordering release that wrote the state, or start the data stream "
                "afresh (restore the model without the data-loader state)."
            )
        upgraded = FlexState(state)
        if version == 1:
            upgraded.update(_draws=0, _carry_step=0, _carry=[0.0] * len(self.source_names),
                            _per_rank=False)
        saved = {**saved, "state_version": STATE_VERSION, "batch_size": expected["batch_size"]}
        upgraded["_stamp"] = saved
        return upgraded, saved

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "datasets": [(n, ds.config()) for n, ds in zip(self.source_names, self.datasets)],
            "schedule": self.schedule.to_dict(),
            "schedule_fingerprint": self.schedule.fingerprint,
            "policy": self.policy,
            "micro_batches_per_step": self.micro_batches_per_step,
            "batch_size": self.batch_size,
            "lag_batches": self.lag_batches,
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        return (
            f"ScheduledBlendDataset(sources={list(self.source_names)}, policy={show(self.policy)}, "
            f"schedule={self.schedule.fingerprint}, micro_batches_per_step="
            f"{self.micro_batches_per_step}, batch_size={self.batch_size}, "
            f"lag_batches={self.lag_batches})"
        )
