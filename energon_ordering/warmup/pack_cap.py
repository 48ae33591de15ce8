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
runs; an encoder attribute it packs to, such as Megatron-LM's ``packing_seq_length``, holds the
target for the call): caps never shrink, so every pack still fits the cap of its emission step.
Whatever the packer returns, a pack of several documents above the target of its emission
position is re-split first-fit decreasing, counted (``packs_over_cap``) and logged, or refused
under ``overflow="error"`` (:meth:`PackCapDataset.fit_packs`): never emitted over its cap.
Measured with ``tools/bench_packing.py`` during a steep warmup: building every pack of a pool of
packs at the cap of the step the pool fills in left packs at 41% of their emission step's cap.

:class:`PackCapPrePacker` wraps ``select_samples_to_pack``: it first cuts every sample longer
than the target (text only, from the end; media never, see
:mod:`energon_ordering.warmup.token_layout`), applies the overflow policy to samples whose media
alone exceed it, then hands the buffer to the packer. The cut and the overflow policy are
:class:`~energon_ordering.warmup.cap_cut.CapCutter`'s, as in the batch-time warmup. A cut
sample's restore key gets the cap it was cut to, through :class:`PackCapDataset`, the stage
directly below ``PackingDataset``, once per cut: when a checkpointed pack (or a buffered sample)
is restored, Energon restores each packed sample by its key, and this stage cuts it again at
every cap it names. So a restored pack is identical: keys, cut points and token contents.
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

from energon_ordering.errors import (
    OrderingConfigError,
    OrderingTypeError,
    SeqLenOverflowError,
    StateMismatchError,
    show,
)
from energon_ordering.saved_counters import check_saved_counts
from energon_ordering.state_stamp import check_stamp
from energon_ordering.warmup.cap_cut import LOG_FIRST, CapCutter, CapWording, new_counts, new_epoch_counts
from energon_ordering.warmup.schedule import SeqLenWarmup
from energon_ordering.warmup.token_layout import TokenLayout, truncate_sample

__all__ = ["PACK_WORDING", "PackCapDataset", "PackCapPrePacker", "pack_target", "packing_round",
           "round_target"]

logger = logging.getLogger(__name__)

T_sample = TypeVar("T_sample")

#: Version of the stage's saved-state layout and logic. 2: restore keys cut more than once
#: restore through every cut; per-epoch counters (``_epoch``); packs re-split over their cap
#: (``_counts["packs_over_cap"]``).
STATE_VERSION = 2

PACK_WORDING = CapWording(
    stage="Sequence packing",
    cap="pack target",
    kept="packed alone, uncut",
    unit="no pack can be built",
    fix="raise seq_length_warmup.start or pack_seq_length",
)


_ROUND_TARGET: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "energon_ordering_pack_round_target", default=None
)


def round_target() -> int | None:
    """While a user's ``select_samples_to_pack`` runs under :class:`PackCapPrePacker`: the target
    (tokens) its packs must fit; None outside."""
    return _ROUND_TARGET.get()


@contextlib.contextmanager
def packing_round(target: int | None) -> Iterator[None]:
    """While the block runs, :func:`round_target` (and so
    ``OrderingTaskEncoder.ordering_pack_target()``) answers ``target``: the packs being made
    must fit it."""
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
    (:class:`PackCapPrePacker` calls :meth:`cut_for_packing`, which cuts with the
    :class:`~energon_ordering.warmup.cap_cut.CapCutter` the batch-time warmup uses too). A cut
    sample's restore key is prefixed with ``("PackCapDataset", cap)``, once per cut (the default
    packer may cut a document to the round's largest target and then to its own pack's);
    :meth:`restore_sample` restores the inner sample and cuts it again at every cap, innermost
    first. Counters of cut, kept and dropped samples and of packs re-split over their cap are
    state (``_counts``, summed by :func:`energon_ordering.inspect.diagnostics.warmup_counts`).

    Deterministic: the target is a pure function of the batch index being built.
    """

    pack_seq_length: int | None
    warmup: SeqLenWarmup | None
    micro_batches_per_step: int
    overflow: str
    layout: TokenLayout

    _stamp: dict[str, Any]
    _counts: dict[str, int]
    _epoch: dict[str, int]

    _savable_fields = ("_stamp", "_counts", "_epoch")

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
                f"got {show(batch_size)}."
            )
        if warmup is not None and not isinstance(warmup, SeqLenWarmup):
            raise OrderingTypeError(f"PackCapDataset: warmup = {show(warmup)} must be a SeqLenWarmup or None.")
        if pack_seq_length is not None and (
            isinstance(pack_seq_length, bool) or not isinstance(pack_seq_length, int) or pack_seq_length < 1
        ):
            raise OrderingConfigError(
                f"PackCapDataset: pack_seq_length = {show(pack_seq_length)} must be an int >= 1 or None."
            )
        layout = TokenLayout() if layout is None else layout
        cutter = CapCutter(overflow=overflow, layout=layout, wording=PACK_WORDING, owner="PackCapDataset")
        if isinstance(micro_batches_per_step, bool) or not isinstance(micro_batches_per_step, int) or micro_batches_per_step < 1:
            raise OrderingConfigError(
                f"PackCapDataset: micro_batches_per_step = {show(micro_batches_per_step)} must be an int >= 1."
            )
        super().__init__(dataset, worker_config=worker_config)
        self.pack_seq_length = pack_seq_length
        self.warmup = warmup
        self.micro_batches_per_step = micro_batches_per_step
        self.overflow = overflow
        self.layout = layout
        self.cutter = cutter
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
                f"PackCapDataset.plan_emission: {show(emission_batches)} must be callable (n -> the "
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
        self._counts = {**new_counts(), "packs_over_cap": 0}
        self._epoch = new_epoch_counts()
        self._pending_error: SeqLenOverflowError | None = None
        self.cutter.reset_streak()

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
        out = []
        for sample in samples:
            try:
                kept = self.cutter.cut(sample, target, step=self.current_step(), counts=self._counts,
                                       epoch=self._epoch, media_limit=media_limit)
            except SeqLenOverflowError as error:
                self._pending_error = error
                raise
            if kept is not None:
                out.append(add_sample_restore_key(kept[0], target, src=self) if kept[1] else kept[0])
        return out

    def fit_packs(
        self,
        packs: list[list[T_sample]],
        targets: list[int],
        length_fn: Callable[[Any], float],
        bin_packer: Callable[[list[float], list[int]], list[list[int]]],
        packer: str,
    ) -> list[list[T_sample]]:
        """The packer's ``packs`` with every pack within the target of its emission position.

        Pack ``q`` of the result is emitted under ``targets[q]`` (non-decreasing). A pack of
        several documents above its target is re-split with ``bin_packer`` (first-fit
        decreasing) into packs with the targets of the positions they then take (later packs
        move back, to targets never smaller) and counted (``packs_over_cap``); under
        ``overflow="error"`` it is refused instead. A pack of one document above its target is
        one whose media alone exceed it (the documents were cut to ``targets[0]``): kept as
        the overflow policy ``keep`` says. Empty packs are left out, as Energon does.

        Raises:
            SeqLenOverflowError: ``overflow="error"`` and a pack exceeds its target.
        """
        out: list[list[T_sample]] = []
        last = len(targets) - 1

        def caps(start: int, n: int) -> list[int]:
            return [targets[min(q, last)] for q in range(start, start + n)]

        for pack in packs:
            if not pack:
                continue
            lengths = [length_fn(s) for s in pack]
            cap = caps(len(out), 1)[0]
            if len(pack) == 1 or sum(lengths) <= cap:
                out.append(pack)
                continue
            what = (
                f"{packer} returned a pack of {len(pack)} documents and {sum(lengths):g} tokens, "
                f"more than the pack target of {cap} tokens of the step it is emitted in "
                f"(step {self.current_step()} is being built)"
            )
            if self.overflow == "error":
                self._pending_error = SeqLenOverflowError(
                    f"Sequence packing: {what}. Pack to OrderingTaskEncoder.ordering_pack_target() "
                    "inside select_samples_to_pack, or set the overflow policy to 'keep' or 'drop' "
                    "to have such packs re-split first-fit (counted as packs_over_cap)."
                )
                raise self._pending_error
            self._counts["packs_over_cap"] += 1
            n = self._counts["packs_over_cap"]
            if n <= LOG_FIRST or n % 1000 == 0:
                logger.warning(
                    "Sequence packing: %s; re-split first-fit (%d so far on this worker). Pack to "
                    "OrderingTaskEncoder.ordering_pack_target() to keep your packer's packs.", what, n,
                )
            bins = bin_packer(lengths, caps(len(out), len(pack)))
            out.extend([pack[i] for i in members] for members in bins)
        return out

    def end_epoch(self) -> None:
        """After the last pack of a finite epoch: warns once if the epoch dropped every sample."""
        self.cutter.end_epoch(
            self._epoch, worker=f"rank {self.worker_config.rank} worker {self.worker_config.rank_worker_id()}"
        )

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
        caps = []
        while restore_key and restore_key[0] == type(self).__name__:
            caps.append(int(restore_key[1]))  # type: ignore[arg-type]
            restore_key = restore_key[2:]
        sample = self.dataset.restore_sample(restore_key)
        for cap in reversed(caps):  # the innermost prefix is the first cut
            cut = self.cutter.recut(sample, cap)
            if cut is None:
                raise StateMismatchError(
                    f"PackCapDataset: the saved restore key {show(restore_key)} names a sample "
                    f"that a cap of {cap} tokens drops (its media alone exceed it): the state was "
                    "written under another overflow policy or layout. Restore with the settings "
                    "that wrote it, or start the data stream fresh."
                )
            sample = add_sample_restore_key(cut, cap, src=self)
        return sample

    def restore_state(self, state: FlexState) -> None:
        check_stamp(
            type(self).__name__,
            state,
            self._expected_stamp(),
            "Restore with the original pack_seq_length / seq_length_warmup settings.",
        )
        check_saved_counts(type(self).__name__, "_counts", state.get("_counts"),
                           self.counts().keys())
        check_saved_counts(type(self).__name__, "_epoch", state.get("_epoch"),
                           new_epoch_counts().keys())
        super().restore_state(state)
        self._pending_error = None

    def counts(self) -> dict[str, int]:
        """This worker's counters: seen, truncated, truncated_tokens, kept_over_cap, dropped,
        packs_over_cap."""
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
            f"overflow={show(self.overflow)}, dataset={self.dataset})"
        )


class PackCapPrePacker:
    """``select_samples_to_pack`` wrapped: cut the buffer to the pack target, pack it, and hold
    every pack to the target of its emission step.

    Args:
        packer: The task encoder's ``select_samples_to_pack`` (the user's, or the default).
        stage: The :class:`PackCapDataset` below the ``PackingDataset``.
        length_fn: The length of a sample in tokens (the encoder's ``ordering_sample_length``).
        bin_packer: ``(lengths, per-pack capacities) -> packs of indices`` (first-fit
            decreasing): packs for the default packer, re-splits of packs over their target
            for any packer (:meth:`PackCapDataset.fit_packs`).
        packs_itself: The default packer: the wrapper packs with ``bin_packer`` and the
            per-pack targets of :meth:`PackCapDataset.pack_targets` (a document that fits no
            pack is cut to the target of the pack it opens), and ``packer`` is not called.
        target_attribute: ``(owner, name)``: an attribute the user's packer reads as its pack
            length (Megatron-LM's ``examples/multimodal`` encoder packs to its
            ``packing_seq_length``); set to the round's target while ``packer`` runs. A
            document above that target (its media alone exceed it, overflow ``keep``) is then
            packed alone instead of handed to the packer.
    """

    def __init__(
        self,
        packer: Callable[[list[Any]], list[list[Any]]],
        stage: PackCapDataset,
        *,
        length_fn: Callable[[Any], float],
        bin_packer: Callable[[list[float], list[int]], list[list[int]]],
        packs_itself: bool = False,
        target_attribute: tuple[Any, str] | None = None,
    ):
        if not callable(length_fn) or not callable(bin_packer):
            raise OrderingTypeError(
                f"PackCapPrePacker: length_fn = {show(length_fn)} and bin_packer = {show(bin_packer)} must "
                "be callable."
            )
        self.packer = packer
        self.stage = stage
        self.length_fn = length_fn
        self.bin_packer = bin_packer
        self.packs_itself = bool(packs_itself)
        self.target_attribute = target_attribute
        self.__qualname__ = f"PackCapPrePacker({SavableDataset._function_config(packer)})"

    @contextlib.contextmanager
    def _packer_reads(self, target: int | None) -> Iterator[None]:
        """The round's target where the user's packer reads it, for the duration of its call."""
        with packing_round(target):
            if self.target_attribute is None or target is None:
                yield
                return
            owner, name = self.target_attribute
            before = getattr(owner, name)
            setattr(owner, name, target if not isinstance(before, int) else min(before, target))
            try:
                yield
            finally:
                setattr(owner, name, before)

    def __call__(self, samples: list[Any]) -> list[list[Any]]:
        targets = self.stage.pack_targets(len(samples))
        if not self.packs_itself:
            # a user's packer: every pack of the round fits the first pack's target
            target = None if targets is None else targets[0]
            samples = self.stage.cut_for_packing(samples, target=target)
            alone: list[list[Any]] = []
            if self.target_attribute is not None and target is not None:
                # overflow "keep": a document whose media alone exceed the target is packed
                # alone, uncut; a packer told the target in an attribute would refuse it
                # (Megatron's greedy_knapsack raises, and Energon then skips the whole buffer)
                over = [self.length_fn(s) > target for s in samples]
                alone = [[s] for s, o in zip(samples, over) if o]
                samples = [s for s, o in zip(samples, over) if not o]
            if not samples:
                return alone
            with self._packer_reads(target):
                packs = self.packer(samples)
            packs = [*packs, *alone]
            if targets is None:
                return packs
            return self.stage.fit_packs(packs, targets, self.length_fn, self.bin_packer, self._packer_name())
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
        return self.stage.fit_packs(packs, targets, self.length_fn, self.bin_packer, self._packer_name())

    def _packer_name(self) -> str:
        return str(SavableDataset._function_config(self.packer))

    def __repr__(self) -> str:
        return self.__qualname__
