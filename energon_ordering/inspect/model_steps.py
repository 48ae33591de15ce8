"""What the model sees at each optimizer step, and where two runs of it first differ.

An elastic resume of the planned order (``check-resume --resume-ranks``) re-deals each step's
samples onto the new data-parallel shape: a sample may land on another rank or micro-batch,
but the step must hold the same samples, cut to the same token lengths (the sequence-length
warmup's cap of the step), in the same packs (DESIGN.md, contract 13: test by what the model
sees, not keys). :func:`model_steps` reduces recorded micro-batches to that view, one
multiset of *units* per step (a pack, or a sample without packing: its ``(key, tokens)``
documents in order), each with the rank and micro-batch that held it; :func:`compare_model_steps`
names the first step that differs, where, and how (samples, a token length, or pack
boundaries). Pure functions of the records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from energon_ordering.inspect.rank_simulation import BatchRecord

__all__ = ["Placed", "StepMismatch", "Unit", "compare_model_steps", "model_steps"]

#: A pack as the model sees it (a sample without packing: one document): (key, tokens) each.
Unit = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Placed:
    """A unit and where it was: data-parallel ``rank``, ``micro_batch`` within the step."""

    unit: Unit
    rank: int
    micro_batch: int


@dataclass(frozen=True)
class StepMismatch:
    """The first difference: optimizer ``step``, the ``rank`` and ``micro_batch`` (within the
    step) of the resumed run where it shows (None: the step is missing), and ``reason``."""

    step: int
    rank: int | None
    micro_batch: int | None
    reason: str


def _units(record: BatchRecord) -> list[Unit]:
    """The packs of a micro-batch (each sample its own unit without packing); a record
    without lengths counts 0 tokens per sample (keys are still compared)."""
    lengths = record.lengths or (0,) * len(record.keys)
    docs = list(zip(record.keys, (int(x) for x in lengths)))
    if not record.pack_lengths:
        return [(d,) for d in docs]
    units, at = [], 0
    for pack in record.pack_lengths:
        units.append(tuple(docs[at:at + len(pack)]))
        at += len(pack)
    return units


def model_steps(records: Sequence[Sequence[BatchRecord]], micro_batches: int
                ) -> list[list[Placed]]:
    """``records[rank][micro_batch]`` (each rank's micro-batches in order, ``micro_batches``
    per optimizer step) -> per whole optimizer step, every unit of every rank."""
    steps = min(len(rank) for rank in records) // micro_batches
    return [[Placed(unit, r, m)
             for r, rank in enumerate(records)
             for m in range(micro_batches)
             for unit in _units(rank[s * micro_batches + m])]
            for s in range(steps)]


def _where(placed: Placed) -> str:
    return f"rank {placed.rank} micro-batch {placed.micro_batch}"


def _step_mismatch(step: int, expected: list[Placed], got: list[Placed]) -> StepMismatch | None:
    """How one step of the resumed run (``got``) differs from the uninterrupted one's."""
    if Counter(p.unit for p in expected) == Counter(p.unit for p in got):
        return None
    want = Counter(k for p in expected for k, _ in p.unit)
    have = Counter(k for p in got for k, _ in p.unit)
    if want != have:
        missing, extra = sorted((want - have).elements()), sorted((have - want).elements())
        first = next((p for p in got if any(k in extra for k, _ in p.unit)), None)
        if first is not None:
            where = f" ({_where(first)} holds {extra[0]})"
        else:  # only missing: where the uninterrupted run had the first one
            had = next(p for p in expected if any(k == missing[0] for k, _ in p.unit))
            where = f" (the uninterrupted run has {missing[0]} at {_where(had)})"
        return StepMismatch(
            step, getattr(first, "rank", None), getattr(first, "micro_batch", None),
            f"optimizer step {step}: {len(missing)} samples missing {missing[:4]}, "
            f"{len(extra)} extra or repeated {extra[:4]}{where}")
    tokens = {k: n for p in expected for k, n in p.unit}
    for p in got:
        for key, n in p.unit:
            if tokens[key] != n:
                return StepMismatch(
                    step, p.rank, p.micro_batch,
                    f"optimizer step {step}, {_where(p)}: sample {key} has {n} tokens, "
                    f"{tokens[key]} in the uninterrupted run (cut to another cap)")
    packs = Counter(p.unit for p in expected)
    for p in got:
        if packs[p.unit] <= 0:
            was = next(q.unit for q in expected if p.unit[0][0] in (k for k, _ in q.unit))
            return StepMismatch(
                step, p.rank, p.micro_batch,
                f"optimizer step {step}, {_where(p)}: pack {[k for k, _ in p.unit]}, the "
                f"uninterrupted run packs {p.unit[0][0]} in {[k for k, _ in was]}")
        packs[p.unit] -= 1
    return StepMismatch(step, None, None, f"optimizer step {step}: the packs differ "
                        f"({sum(packs.values())} of the uninterrupted run's left unmatched)")


def compare_model_steps(expected: Sequence[list[Placed]], got: Sequence[list[Placed]], *,
                        first_step: int) -> StepMismatch | None:
    """The first optimizer step (from ``first_step``, the step of ``expected[0]``) at which the
    resumed run ``got`` shows the model something else than the uninterrupted run
    ``expected``: other samples, a sample cut to another length, or other packs. Where a unit
    sits (rank, micro-batch) may differ. None if every step agrees."""
    for i, want in enumerate(expected):
        if i >= len(got):
            return StepMismatch(first_step + i, None, None,
                                f"optimizer step {first_step + i}: missing, the resumed run "
                                f"ends after {len(got)} steps of {len(expected)}")
        mismatch = _step_mismatch(first_step + i, want, got[i])
        if mismatch is not None:
            return mismatch
    if len(got) > len(expected):
        return StepMismatch(first_step + len(expected), None, None,
                            f"the resumed run has {len(got)} optimizer steps, {len(expected)} "
                            "expected")
    return None
