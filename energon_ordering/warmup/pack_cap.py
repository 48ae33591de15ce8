"""The pack target under the sequence-length warmup, and cuts that survive a restore.

With Energon's sequence packing the warmup cap applies to a whole pack: a pack emitted at
optimizer step s holds at most ``target(s) = min(pack_seq_length, warmup.max_seq_len(s))``
tokens. Energon's ``PackingDataset`` calls the task encoder's ``select_samples_to_pack`` on a
full buffer while the loader builds a micro-batch; the round's packs go out from there on, so
each pack is built to the target of the micro-batch it will be emitted in
(:meth:`PackCapDataset.pack_targets`):

- packs straight to the batcher (no pool of packs): the k-th pack of a round goes out in
  micro-batch ``k // micro_batch_size`` after the current one (this worker's micro-batches are
  ``num_workers`` apart in the rank's batch index);
- a pool of packs (:class:`~energon_ordering.pool.pack_pool_sort.PackPoolSortDataset`): the pool
  tells where the next packs will be emitted (:meth:`PackCapDataset.plan_emission`), and sorts
  only within runs of positions that share one cap, so each pack is emitted under the cap it was
  built to.

The default packer packs first-fit decreasing with these per-pack capacities (non-decreasing,
since caps never shrink). A user's packer gets the round's first target (``cut_for_packing``
and :func:`round_target`, which ``OrderingTaskEncoder.ordering_pack_target`` returns while it
runs): caps never shrink, so every pack still fits the cap of its emission step. Measured with
``tools/bench_packing.py`` during a steep warmup: building every pack of a pool of packs at the
cap of the step the pool fills in left packs at 41% of their emission step's cap.

:class:`PackCapPrePacker` wraps ``select_samples_to_pack``: it first cuts every sample longer
than the target (text only, from the end; media never, see
:mod:`energon_ordering.warmup.token_layout`), applies the overflow policy to samples whose media
alone exceed it, then hands the buffer to the packer. A cut sample's restore key gets the cap
it was cut to, through :class:`PackCapDataset`, the stage directly below ``PackingDataset``: when
a checkpointed pack (or a buffered sample) is restored, Energon restores each packed sample by
its key, and this stage cuts it again at the same point. So a restored pack is identical: keys,
cut points and token contents.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from megatron.energon.flavors.base_dataset import SavableDataset, add_sample_restore_key
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset

from energon_ordering.errors import OrderingConfigError, OrderingTypeError, SeqLenOverflowError
from energon_ordering.sample_fields import sample_key
from energon_ordering.state_stamp import check_stamp
from energon_ordering.warmup.schedule import SeqLenWarmup
from energon_ordering.warmup.token_layout import OVERFLOW_POLICIES, TokenLayout, truncate_sample

__all__ = ["PackCapDataset", "PackCapPrePacker", "pack_target", "round_target"]

logger = logging.getLogger(__name__)

T_sample = TypeVar("T_sample")

#: Version of the stage's saved-state layout and logic.
STATE_VERSION = 1

_LOG_FIRST = 10

#: With ``overflow="drop"``, this many samples dropped in a row is an error, not an endless loop.
MAX_CONSECUTIVE_DROPS = 1000


_ROUND_TARGET: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "energon_ordering_pack_round_target", default=None
)


def round_target() -> int | None:
    """While a user's ``select_samples_to_pack`` runs under :class:`PackCapPrePacker`: the target
    (tokens) its packs must fit; None outside."""
    return _ROUND_TARGET.get()


@contextlib.contextmanager
def _round(target: int | None) -> Iterator[None]:
    token = _ROUND_TARGET.set(target)
    try:
        yield
    finally:
        _ROUND_TARGET.reset(token)


def pack_target(step: int, pack_seq_length: int | None, warmup: SeqLenWarmup | None) -> int | None:
    """Tokens a pack emitted in optimizer ``step`` may hold (None: no limit known).

    ``min(pack_seq_length, warmup.max_seq_len(step))`` during the warmup, ``pack_seq_length``
    after it (``warmup.full`` if ``pack_seq_length`` is None).
    """
    if warmup is None:
        return pack_seq_length
    cap = warmup.max_seq_len(step)
    if pack_seq_length is None:
        return cap
    return min(cap, pack_seq_length)


class PackCapDataset(BaseWrapperDataset[T_sample, T_sample], Generic[T_sample]):
    """Directly below Energon's ``PackingDataset``: re-applies pack-time cuts on restore.

    Iterating passes samples through unchanged; the cut happens when a buffer is packed
    (:class:`PackCapPrePacker` calls :meth:`cut_for_packing`). A cut sample's restore key is
    prefixed with ``("PackCapDataset", cap)``; :meth:`restore_sample` restores the inner sample
    and cuts it to that cap again. Counters of cut, kept and dropped samples are state
    (``_counts``, summed by :func:`energon_ordering.inspect.diagnostics.warmup_counts`).

    Deterministic: the target is a pure function of the batch index being built.
    """

    pack_seq_length: int | None
    warmup: SeqLenWarmup | None
    micro_batches_per_step: int
    overflow: str
    layout: TokenLayout

    _stamp: dict[str, Any]
    _counts: dict[str, int]

    _savable_fields = ("_stamp", "_counts")

    def __init__(
        self,
        dataset: SavableDataset[T_sample],
        *,
        worker_config: WorkerConfig,
        pack_seq_length: int | None,
        warmup: SeqLenWarmup | None = None,
        micro_batches_per_step: int = 1,
        overflow: str = "keep",
        layout: TokenLayout | None = None,
        batch_size: int | None = None,
        per_pack_targets: bool = False,
    ):
        """Construct a PackCapDataset.

        Args:
            dataset: Encoded samples, in the order they enter the packing buffer.
            worker_config: Energon's worker configuration.
            pack_seq_length: Tokens per pack after the warmup (Megatron's
                ``--packing-seq-length``); None: the warmup's ``full``, or no cut at all.
            warmup: The sequence-length warmup, or None.
            micro_batches_per_step: Micro-batches per optimizer step on one rank.
            overflow: ``"keep"``, ``"drop"`` or ``"error"`` for a sample whose media alone
                exceed the target.
            layout: How to cut the sample type; None = :class:`TokenLayout` defaults.
            batch_size: Packs per micro-batch (for per-pack targets).
            per_pack_targets: The k-th pack of a round is emitted ``k // batch_size``
                micro-batches after the current one (packs go straight to the batcher), so it
                gets that micro-batch's target; False: every pack gets the current target.
        """
        if per_pack_targets and (batch_size is None or batch_size < 1):
            raise OrderingConfigError(
                f"PackCapDataset: per_pack_targets needs batch_size >= 1 (packs per micro-batch), "
                f"got {batch_size!r}."
            )
        if warmup is not None and not isinstance(warmup, SeqLenWarmup):
            raise OrderingTypeError(f"PackCapDataset: warmup = {warmup!r} must be a SeqLenWarmup or None.")
        if pack_seq_length is not None and (
            isinstance(pack_seq_length, bool) or not isinstance(pack_seq_length, int) or pack_seq_length < 1
        ):
            raise OrderingConfigError(
                f"PackCapDataset: pack_seq_length = {pack_seq_length!r} must be an int >= 1 or None."
            )
        if overflow not in OVERFLOW_POLICIES:
            raise OrderingConfigError(
                f"PackCapDataset: overflow = {overflow!r} is unknown; use one of {list(OVERFLOW_POLICIES)}."
            )
        if isinstance(micro_batches_per_step, bool) or not isinstance(micro_batches_per_step, int) or micro_batches_per_step < 1:
            raise OrderingConfigError(
                f"PackCapDataset: micro_batches_per_step = {micro_batches_per_step!r} must be an int >= 1."
            )
        layout = TokenLayout() if layout is None else layout
        if not isinstance(layout, TokenLayout):
            raise OrderingTypeError(f"PackCapDataset: layout = {layout!r} must be a TokenLayout.")
        super().__init__(dataset, worker_config=worker_config)
        self.pack_seq_length = pack_seq_length
        self.warmup = warmup
        self.micro_batches_per_step = micro_batches_per_step
        self.overflow = overflow
        self.layout = layout
        self.batch_size = batch_size
        self.per_pack_targets = bool(per_pack_targets)
        self.emission_batches: Callable[[int], list[int]] | None = None
        self.reset_state_own()

    def plan_emission(self, emission_batches: Callable[[int], list[int]]) -> None:
        """Packs are emitted where ``emission_batches(n)`` says: the rank's micro-batch indices
        of the next ``n`` packs, in the order they are built (a pool of packs'
        ``upcoming_batch_indices``). :meth:`pack_targets` then gives each its micro-batch's target."""
        if not callable(emission_batches):
            raise OrderingTypeError(
                f"PackCapDataset.plan_emission: {emission_batches!r} must be callable (n -> the "
                "micro-batch indices of the next n packs)."
            )
        self.emission_batches = emission_batches

    def batch_target(self, batch_index: int) -> int | None:
        """The pack target of the rank's micro-batch ``batch_index``, in tokens (None: no limit)."""
        return pack_target(batch_index // self.micro_batches_per_step, self.pack_seq_length, self.warmup)

    def _expected_stamp(self) -> dict[str, Any]:
        return {
            "state_version": STATE_VERSION,
            "pack_seq_length": self.pack_seq_length,
            "warmup": None if self.warmup is None else self.warmup.to_dict(),
            "overflow": self.overflow,
            "micro_batches_per_step": self.micro_batches_per_step,
            "per_pack_targets": self.per_pack_targets,
            "batch_size": self.batch_size if self.per_pack_targets else None,
        }

    def reset_state_own(self) -> None:
        self._stamp = self._expected_stamp()
        self._counts = {"seen": 0, "truncated": 0, "truncated_tokens": 0, "kept_over_cap": 0, "dropped": 0}
        self._pending_error: SeqLenOverflowError | None = None
        self._dropped_in_a_row = 0

    def len_worker(self, worker_idx: int | None = None) -> int:
        return self.dataset.len_worker(worker_idx)

    def current_step(self) -> int:
        """The optimizer step of the micro-batch being built (in a loader worker only)."""
        return self.worker_config.active_worker_batch_index // self.micro_batches_per_step

    def current_target(self) -> int | None:
        """The pack target of the micro-batch being built, in tokens (None: no limit)."""
        return self.batch_target(self.worker_config.active_worker_batch_index)

    def pack_targets(self, n: int) -> list[int] | None:
        """Targets of the first ``n`` packs of a round built now, in emission order (tokens).

        With :meth:`plan_emission` (a pool of packs) pack k gets the target of the micro-batch
        the plan names; else with ``per_pack_targets`` the target of the micro-batch
        ``k // batch_size`` after the one being built (this worker's micro-batches are
        ``num_workers`` apart in the rank's batch index); else all get :meth:`current_target`.
        None: no target.
        """
        if self.emission_batches is not None:
            if self.pack_seq_length is None and self.warmup is None:
                return None
            return [self.batch_target(b) for b in self.emission_batches(n)]  # type: ignore[misc]
        if not self.per_pack_targets:
            target = self.current_target()
            return None if target is None else [target] * n
        index = self.worker_config.active_worker_batch_index
        stride = max(1, self.worker_config.num_workers)
        assert self.batch_size is not None
        out = []
        for k in range(n):
            target = self.batch_target(index + (k // self.batch_size) * stride)
            if target is None:
                return None
            out.append(target)
        return out

    def cut_one(self, sample: T_sample, cap: int) -> T_sample:
        """``sample`` cut to ``cap`` tokens (text only; unchanged if its media exceed it)."""
        result = truncate_sample(sample, cap, self.layout)
        if result.overflow or not result.cut_tokens:
            return sample
        self._counts["truncated"] += 1
        self._counts["truncated_tokens"] += result.cut_tokens
        return add_sample_restore_key(result.sample, cap, src=self)

    def cut_for_packing(
        self, samples: list[T_sample], target: int | None = None, media_limit: int | None = None
    ) -> list[T_sample]:
        """Cuts each sample to ``target`` (default: the current target); applies the overflow
        policy to samples whose media exceed ``media_limit`` (default: ``target``).

        Returns:
            The samples to pack, in their order: cut ones replaced by their cut version (whose
            restore key names the cap), dropped ones left out.

        Raises:
            SeqLenOverflowError: ``overflow="error"`` and a sample's media exceed the target.
        """
        target = self.current_target() if target is None else target
        if target is None:
            return samples
        media_limit = target if media_limit is None else media_limit
        out = []
        for sample in samples:
            self._counts["seen"] += 1
            result = truncate_sample(sample, target, self.layout)
            if not result.overflow and media_limit < target:
                n_media = truncate_sample(sample, media_limit, self.layout)
                if n_media.overflow:
                    result = n_media
            if not result.overflow:
                self._dropped_in_a_row = 0
                if result.cut_tokens:
                    self._counts["truncated"] += 1
                    self._counts["truncated_tokens"] += result.cut_tokens
                    out.append(add_sample_restore_key(result.sample, target, src=self))
                else:
                    out.append(sample)
                continue
            what = (
                f"sample {sample_key(sample)!r} has {result.media_tokens} media tokens, more than "
                f"the pack target of {media_limit} tokens at step {self.current_step()}"
            )
            if self.overflow == "error":
                self._pending_error = SeqLenOverflowError(
                    f"Sequence packing: {what}. Media tokens are never cut; raise "
                    "seq_length_warmup.start or pack_seq_length, or set the overflow policy to "
                    "'keep' (packed alone, uncut) or 'drop' (skip, counted)."
                )
                raise self._pending_error
            key = "kept_over_cap" if self.overflow == "keep" else "dropped"
            self._counts[key] += 1
            n = self._counts[key]
            if n <= _LOG_FIRST or n % 1000 == 0:
                logger.warning(
                    "Sequence packing: %s; %s (%d so far on this worker).",
                    what, "packed alone, uncut" if self.overflow == "keep" else "dropped", n,
                )
            if self.overflow == "keep":
                self._dropped_in_a_row = 0
                out.append(sample)
                continue
            self._dropped_in_a_row += 1
            if self._dropped_in_a_row >= MAX_CONSECUTIVE_DROPS:
                self._pending_error = SeqLenOverflowError(
                    f"Sequence packing: {self._dropped_in_a_row} samples in a row were dropped at "
                    f"step {self.current_step()} (pack target {target} tokens): their media tokens "
                    "alone exceed the target, so no pack can be built. Raise "
                    "seq_length_warmup.start above the media tokens per sample, or use overflow "
                    "'keep'."
                )
                raise self._pending_error
        return out

    def __iter__(self) -> Iterator[T_sample]:
        for sample in self.dataset:
            if self._pending_error is not None:
                # Energon's packer error handler logs errors of select_samples_to_pack and goes
                # on; the overflow policy "error" must stop the run, so it is raised here too.
                raise self._pending_error
            yield sample
        if self._pending_error is not None:
            raise self._pending_error

    def restore_sample(self, restore_key: tuple[str | int | tuple, ...]) -> T_sample:
        """Re-fetches the inner sample and repeats its cuts, innermost (first applied) first.

        A sample that waits in the packer's buffer across a change of cap is cut again, so its
        key may name several caps, ``(name, cap_k, ..., name, cap_1, *inner)``."""
        name, caps = type(self).__name__, []
        while restore_key and restore_key[0] == name:
            caps.append(int(restore_key[1]))
            restore_key = restore_key[2:]
        sample = self.dataset.restore_sample(restore_key)
        for cap in reversed(caps):
            sample = add_sample_restore_key(truncate_sample(sample, cap, self.layout).sample, cap, src=self)
        return sample

    def restore_state(self, state: FlexState) -> None:
        check_stamp(
            type(self).__name__,
            state,
            self._expected_stamp(),
            "Restore with the original pack_seq_length / seq_length_warmup settings.",
        )
        super().restore_state(state)
        self._pending_error = None

    def counts(self) -> dict[str, int]:
        """This worker's counters: seen, truncated, truncated_tokens, kept_over_cap, dropped."""
        return dict(self._counts)

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "dataset": self.dataset.config(),
            "pack_seq_length": self.pack_seq_length,
            "warmup": None if self.warmup is None else self.warmup.to_dict(),
            "overflow": self.overflow,
            "micro_batches_per_step": self.micro_batches_per_step,
            "worker_config": self.worker_config.config(),
        }

    def __str__(self) -> str:
        return (
            f"PackCapDataset(pack_seq_length={self.pack_seq_length}, warmup={self.warmup}, "
            f"overflow={self.overflow!r}, dataset={self.dataset})"
        )


class PackCapPrePacker:
    """``select_samples_to_pack`` wrapped: cut the buffer to the pack target, then pack it.

    Args:
        packer: The task encoder's ``select_samples_to_pack`` (the user's, or the default).
        stage: The :class:`PackCapDataset` below the ``PackingDataset``.
        length_fn: Set for the default packer: the length of a sample in tokens. The wrapper
            then packs itself with ``bin_packer`` and the per-pack targets of
            :meth:`PackCapDataset.pack_targets` (a document that fits no pack is cut to the
            target of the pack it opens), and ``packer`` is not called.
        bin_packer: ``(lengths, per-pack capacities) -> packs of indices`` (first-fit
            decreasing), with ``length_fn``.
    """

    def __init__(
        self,
        packer: Callable[[list[Any]], list[list[Any]]],
        stage: PackCapDataset,
        length_fn: Callable[[Any], float] | None = None,
        bin_packer: Callable[[list[float], list[int]], list[list[int]]] | None = None,
    ):
        if (length_fn is None) != (bin_packer is None):
            raise OrderingTypeError("PackCapPrePacker: give both length_fn and bin_packer, or neither.")
        self.packer = packer
        self.stage = stage
        self.length_fn = length_fn
        self.bin_packer = bin_packer
        self.__qualname__ = f"PackCapPrePacker({SavableDataset._function_config(packer)})"

    def __call__(self, samples: list[Any]) -> list[list[Any]]:
        if self.length_fn is None or self.bin_packer is None:
            # a user's packer: every pack of the round fits the first pack's target
            targets = self.stage.pack_targets(1)
            target = None if targets is None else targets[0]
            samples = self.stage.cut_for_packing(samples, target=target)
            if not samples:
                return []
            with _round(target):
                return self.packer(samples)
        targets = self.stage.pack_targets(len(samples))
        if targets is None:
            return self.packer(samples)  # no target: the default packer explains what to set
        samples = self.stage.cut_for_packing(samples, target=targets[-1], media_limit=targets[0])
        if not samples:
            return []
        bins = self.bin_packer([self.length_fn(s) for s in samples], targets)
        packs = []
        for k, members in enumerate(bins):
            pack = [samples[i] for i in members]
            if len(pack) == 1 and self.length_fn(pack[0]) > targets[k]:
                pack = [self.stage.cut_one(pack[0], targets[k])]
            packs.append(pack)
        return packs

    def __repr__(self) -> str:
        return self.__qualname__
