"""The mixture schedule: per-source weights as a pure function of the optimizer step.

Frozen, validated and plottable before a run. :class:`MixtureSchedule` gives per-source sampling weights as a function of the step. It has two
spellings (YAML or dict), both normalised into one definition that is hashed into a
:attr:`MixtureSchedule.fingerprint` for saved state:

1. per-source weights, each a constant or knots compatible with Energon PR #208::

       total_steps: 20000
       sources:
         web:     {weight: {linear: {0: 100, 18000: 62, 20000: 35}}}   # interpolated, clamped
         curated: {weight: {step: {0: 8, 18000: 35}}}                  # held from each knot on
         code:    {weight: 18}                                         # constant

   ``step`` knots are inclusive: at step 18000 the curated weight is already 35. Before the first
   knot and after the last one, both kinds hold the nearest knot's value.

2. phases::

       total_steps: 20000
       phases:
         - {until: 0.9, weights: {web: 0.62, code: 0.18, books: 0.12, curated: 0.08}}
         - {until: 1.0, ramp_steps: 200, weights: {web: 0.35, code: 0.20, books: 0.10, curated: 0.35}}

   ``until`` is exclusive: step ``until`` (a float <= 1 is a fraction of ``total_steps``, an int
   an absolute step) already belongs to the next phase. The last phase also covers every step
   after its ``until``. ``ramp_steps: R`` (optional) blends linearly from the previous phase's
   normalised weights over the first R steps of the phase, starting at its boundary b:
   ``w(b + k) = (1 - t) prev + t cur`` with ``t = (k + 1) / R`` for ``0 <= k < R`` (so the
   boundary step already moves 1/R of the way and step ``b + R - 1`` has the phase's weights).

Weights are normalised to sum to 1 at every step; a source may have weight 0 (never drawn), but
the weights may never all be 0 at one step.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from energon_ordering.errors import OrderingConfigError, OrderingTypeError, show
from energon_ordering.yaml_file import load_yaml

__all__ = [
    "Knots",
    "MixtureSchedule",
    "Phase",
    "RepetitionWarning",
    "implied_epochs",
]

#: Bumped whenever the meaning of a schedule definition changes; part of the fingerprint.
SCHEDULE_VERSION = 1
#: The largest step (``total_steps``, an ``until``, a knot) a schedule takes: 2^53, the last
#: integer a float64 holds exactly (fractions of ``total_steps`` are computed in float64, and
#: steps in int64 arrays; 10^30 overflowed them).
MAX_STEPS = 2**53
#: Phases a schedule may have: a phase change is an event of a run (a few); a schedule that
#: changes smoothly is written as knots.
MAX_PHASES = 10_000


class RepetitionWarning(UserWarning):
    """A source would be seen more often than the configured number of epochs."""


def _err(where: str, msg: str) -> OrderingConfigError:
    return OrderingConfigError(f"MixtureSchedule {where}: {msg}")


def _weight_value(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _err(where, f"weight {show(value)} is not a number; use a finite value >= 0.")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise _err(where, f"weight {show(value)} is invalid; use a finite value >= 0.")
    return value


def _step_value(where: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # JSON objects have string keys
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise _err(where, f"knot step {show(value)} must be an int >= 0.")
    if value > MAX_STEPS:
        raise _err(where, f"knot step {show(value)} is over the largest step {MAX_STEPS:,} "
                          "(2^53); give a step of the run.")
    return int(value)


@dataclass(frozen=True)
class Knots:
    """A piecewise function of the step: ``constant``, ``linear`` or ``step``.

    Attributes:
        kind: ``"constant"`` (one knot at step 0), ``"linear"`` (interpolated between knots,
            clamped at the ends) or ``"step"`` (each knot's value holds from its step on,
            inclusive; before the first knot its value holds).
        steps: Knot steps, strictly increasing.
        values: Knot values (>= 0).
    """

    kind: Literal["constant", "linear", "step"]
    steps: tuple[int, ...]
    values: tuple[float, ...]

    @classmethod
    def parse(cls, where: str, spec: Any) -> Knots:
        """Parses ``18``, ``{linear: {0: 100, 1500: 10}}`` or ``{step: {...}}``."""
        if isinstance(spec, Mapping):
            if len(spec) != 1 or next(iter(spec)) not in ("linear", "step"):
                raise _err(
                    where,
                    f"weight {show(dict(spec))} must be a number, "
                    "{linear: {step: weight, ...}} or {step: {step: weight, ...}}.",
                )
            kind, knots = next(iter(spec.items()))
            if not isinstance(knots, Mapping) or not knots:
                raise _err(
                    where, f"{kind} knots {show(knots)} must be a non-empty mapping step -> weight."
                )
            items = sorted((_step_value(where, s), _weight_value(where, v)) for s, v in knots.items())
            steps = tuple(s for s, _ in items)
            if len(set(steps)) != len(steps):
                raise _err(where, f"{kind} knots repeat a step: {list(knots)}.")
            return cls(kind, steps, tuple(v for _, v in items))
        return cls("constant", (0,), (_weight_value(where, spec),))

    def evaluate(self, steps: np.ndarray) -> np.ndarray:
        """The values at integer ``steps`` (array), as float64."""
        xs = np.asarray(self.steps, dtype=np.float64)
        ys = np.asarray(self.values, dtype=np.float64)
        if self.kind == "linear":
            return np.interp(steps.astype(np.float64), xs, ys)
        idx = np.searchsorted(xs, steps, side="right") - 1
        return ys[np.clip(idx, 0, len(ys) - 1)]

    def to_definition(self) -> Any:
        if self.kind == "constant":
            return self.values[0]
        return {self.kind: {int(s): v for s, v in zip(self.steps, self.values)}}


@dataclass(frozen=True)
class Phase:
    """One phase of a phased schedule: weights in force until ``end`` (exclusive)."""

    end: int
    weights: tuple[float, ...]
    ramp_steps: int = 0


@dataclass(frozen=True, eq=False)
class MixtureSchedule:
    """Per-source sampling weights as a pure function of the optimizer step.

    Build it with :meth:`from_dict` or :meth:`from_yaml` (see the module docstring for the
    format). ``weights(step)`` returns normalised weights; ``sources`` the source names in their
    definition order; ``fingerprint`` a stable hash of the normalised definition.
    """

    sources: tuple[str, ...]
    total_steps: int | None
    knots: tuple[Knots, ...] | None = None
    phases: tuple[Phase, ...] | None = None

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, total_steps: int | None = None) -> MixtureSchedule:
        """Builds a schedule from a mapping with ``sources`` or ``phases`` (and ``total_steps``).

        Args:
            d: The definition.
            total_steps: Used when ``d`` has no ``total_steps``; if both are given they must agree.
        """
        if not isinstance(d, Mapping):
            raise OrderingTypeError(
                f"MixtureSchedule.from_dict: expected a mapping with `sources` or `phases`, got "
                f"{type(d).__name__}."
            )
        unknown = sorted(set(d) - {"total_steps", "sources", "phases"})
        if unknown:
            raise _err("definition", f"unknown key(s) {unknown}; use total_steps and sources or phases.")
        own_total = d.get("total_steps")
        if own_total is not None:
            own_total = _positive_int("total_steps", own_total)
            if total_steps is not None and int(total_steps) != own_total:
                raise _err(
                    "total_steps",
                    f"the schedule says total_steps = {own_total} but the run has total_steps = "
                    f"{total_steps}; make them agree.",
                )
        total = own_total if own_total is not None else (
            None if total_steps is None else _positive_int("total_steps", total_steps)
        )
        has_sources, has_phases = "sources" in d, "phases" in d
        if has_sources == has_phases:
            raise _err("definition", "give exactly one of `sources` (per-source weights) or `phases`.")
        if has_sources:
            sched = cls._from_sources(d["sources"], total)
        else:
            sched = cls._from_phases(d["phases"], total)
        sched._check_never_all_zero()
        return sched

    @classmethod
    def from_yaml(cls, path: str | Path, *, total_steps: int | None = None) -> MixtureSchedule:
        """Loads a schedule YAML file (see the module docstring)."""
        data = load_yaml(path, "MixtureSchedule.from_yaml")
        try:
            return cls.from_dict(data, total_steps=total_steps)
        except (OrderingConfigError, OrderingTypeError) as e:
            raise type(e)(f"{path}: {e}") from e

    @classmethod
    def _from_sources(cls, sources: Any, total: int | None) -> MixtureSchedule:
        if not isinstance(sources, Mapping) or not sources:
            raise _err(
                "sources", f"{show(sources)} must be a non-empty mapping name -> {{weight: ...}}."
            )
        names, knots = [], []
        for name, spec in sources.items():
            where = f"source {show(name)}"
            if not isinstance(name, str) or not name:
                raise _err(where, "source names must be non-empty strings.")
            if not isinstance(spec, Mapping) or set(spec) != {"weight"}:
                raise _err(where, f"{show(spec)} must be {{weight: <number or knots>}}.")
            names.append(name)
            knots.append(Knots.parse(where, spec["weight"]))
        return cls(tuple(names), total, knots=tuple(knots))

    @classmethod
    def _from_phases(cls, phases: Any, total: int | None) -> MixtureSchedule:
        if not isinstance(phases, Sequence) or isinstance(phases, str) or not phases:
            raise _err("phases", f"{show(phases)} must be a non-empty list of {{until, weights}}.")
        if len(phases) > MAX_PHASES:
            raise _err(
                "phases",
                f"{len(phases):,} phases, over the limit of {MAX_PHASES:,}; a phase is a change "
                "of the mixture during the run (a few). Write a schedule that changes smoothly as "
                "knots: sources: {name: {weight: {linear: {step: weight, ...}}}}.",
            )
        _check_same_sources(phases)
        names: tuple[str, ...] | None = None
        parsed: list[Phase] = []
        prev_end = 0
        for i, ph in enumerate(phases):
            where = f"phase {i}"
            if not isinstance(ph, Mapping):
                raise _err(where, f"{show(ph)} must be a mapping with `until` and `weights`.")
            extra = sorted(set(ph) - {"until", "weights", "ramp_steps"})
            if extra or "until" not in ph or "weights" not in ph:
                raise _err(where, f"keys {sorted(ph)}: need `until` and `weights`, optional `ramp_steps`.")
            end = _phase_end(where, ph["until"], total)
            if end <= prev_end:
                raise _err(
                    where,
                    f"until = {show(ph['until'])} (step {end}) does not come after the previous "
                    f"phase's end (step {prev_end}), which leaves the phase with zero steps (a "
                    "fraction is rounded to a whole step). List phases in increasing `until`, at "
                    "least one step apart.",
                )
            w = ph["weights"]
            if not isinstance(w, Mapping) or not w:
                raise _err(
                    where, f"weights {show(w)} must be a non-empty mapping source -> weight."
                )
            bad_keys = [n for n in w if not isinstance(n, str)]
            if bad_keys:
                raise _err(
                    where,
                    f"weights are keyed by {show(bad_keys)}; source names must be strings (quote "
                    "them in YAML, e.g. '2024': 0.5).",
                )
            if names is None:
                names = tuple(str(n) for n in w)
            values = tuple(_weight_value(f"{where} source {show(n)}", w[n]) for n in names)
            if sum(values) <= 0:
                raise _err(where, f"all weights are 0 ({dict(w)}); give one source a weight > 0.")
            ramp = ph.get("ramp_steps", 0)
            if isinstance(ramp, bool) or not isinstance(ramp, numbers.Integral) or ramp < 0:
                raise _err(where, f"ramp_steps = {show(ramp)} must be an int >= 0.")
            if ramp and i == 0:
                raise _err(where, "ramp_steps on the first phase has nothing to ramp from; remove it.")
            if ramp > end - prev_end:
                raise _err(
                    where,
                    f"ramp_steps = {ramp} is longer than the phase ({end - prev_end} steps, from "
                    f"step {prev_end} to {end}); use ramp_steps <= {end - prev_end} or a later "
                    "`until`.",
                )
            parsed.append(Phase(end, values, int(ramp)))
            prev_end = end
        assert names is not None
        return cls(names, total, phases=tuple(parsed))

    def _breakpoints(self) -> np.ndarray:
        pts = {0}
        if self.knots is not None:
            for k in self.knots:
                pts.update(k.steps)
        else:
            assert self.phases is not None
            for ph in self.phases:
                pts.add(ph.end)
        return np.array(sorted(pts), dtype=np.int64)

    def _check_never_all_zero(self) -> None:
        if self.knots is None:
            return  # each phase has a positive sum, and ramps blend normalised weights
        # Weights are >= 0 and piecewise linear/constant between the knots: if their sum is 0
        # anywhere it is 0 at a knot (or right after a step knot), so the knots suffice.
        steps = self._breakpoints()
        raw = self._raw(steps)
        zero = steps[raw.sum(axis=1) <= 0]
        if len(zero):
            raise _err(
                "sources",
                f"all weights are 0 at step {int(zero[0])}; give one source a weight > 0 there.",
            )

    # ---- evaluation ---------------------------------------------------------------------

    def _raw(self, steps: np.ndarray) -> np.ndarray:
        if self.knots is not None:
            return np.stack([k.evaluate(steps) for k in self.knots], axis=1)
        assert self.phases is not None
        ends = np.array([ph.end for ph in self.phases], dtype=np.int64)
        table = np.array([ph.weights for ph in self.phases], dtype=np.float64)
        table = table / table.sum(axis=1, keepdims=True)
        idx = np.minimum(np.searchsorted(ends, steps, side="right"), len(ends) - 1)
        out = table[idx]
        for i, ph in enumerate(self.phases):
            if i == 0 or ph.ramp_steps == 0:
                continue
            start = self.phases[i - 1].end
            k = steps - start
            mask = (idx == i) & (k < ph.ramp_steps)
            if mask.any():
                t = ((k[mask] + 1) / ph.ramp_steps)[:, None]
                out[mask] = (1 - t) * table[i - 1] + t * table[i]
        return out

    def weights_table(self, steps: Sequence[int] | np.ndarray) -> np.ndarray:
        """Normalised weights at many steps: array ``[len(steps), len(sources)]``."""
        steps = np.asarray(steps, dtype=np.int64)
        if steps.ndim != 1:
            raise ValueError("weights_table: steps must be one-dimensional.")
        if len(steps) and steps.min() < 0:
            raise OrderingConfigError(f"MixtureSchedule: step {int(steps.min())} is negative.")
        raw = self._raw(steps)
        return raw / raw.sum(axis=1, keepdims=True)

    @property
    def changes_weights(self) -> bool:
        """Whether the normalised weights differ between two steps of the run.

        The raw weights are piecewise linear (or constant) between the breakpoints, and a
        phase's ramp blends two normalised rows linearly, so the normalised weights are
        constant on a piece wherever they are equal at its ends: checking every breakpoint,
        the step after it and each ramp's end covers every piece."""
        table = self.weights_table(self.piece_ends())
        return bool(np.abs(table - table[0]).max() > 1e-12)

    def piece_ends(self) -> np.ndarray:
        """The steps that end the pieces of the weights: every breakpoint, the step after it
        and each ramp's end. Between two of them the raw weights move linearly (a ramp blends
        two normalised rows linearly), so a weighted mean of per-source values, such as a mean
        length, moves monotonically: its extremes over the run are at these steps."""
        steps = set(self._breakpoints().tolist())
        steps |= {s + 1 for s in steps}
        for i, ph in enumerate(self.phases or ()):
            if i and ph.ramp_steps:
                steps.add(self.phases[i - 1].end + ph.ramp_steps)
        return np.array(sorted(steps), dtype=np.int64)

    def first_change_after(self, total_steps: int, tolerance: float = 0.01) -> int | None:
        """The first step at or after ``total_steps`` whose normalised weights differ from those
        of the run's last step (``total_steps - 1``) by more than ``tolerance``: a change the
        run never reaches (a ramp ending at ``total_steps`` moves less than that in its last
        step); None if none."""
        last = int(total_steps) - 1
        later = [int(p) for p in self.piece_ends() if p > last]
        if not later:
            return None
        table = self.weights_table([last, *later])
        table = table / table.sum(axis=1, keepdims=True)
        differs = np.abs(table[1:] - table[0]).max(axis=1) > tolerance
        return later[int(np.argmax(differs))] if differs.any() else None

    def columns_of(self, names: Sequence[str | None]) -> list[int]:
        """The column of :meth:`weights_table` of each source of ``names`` (a metadataset's
        sources, in its order); sources without a name take the schedule's order."""
        if None in names:
            return list(range(len(self.sources)))
        return [list(self.sources).index(n) for n in names]

    def weights(self, step: int) -> dict[str, float]:
        """Normalised weights at ``step`` (an int >= 0)."""
        row = self.weights_table([step])[0]
        return {name: float(w) for name, w in zip(self.sources, row)}

    # ---- identity -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The normalised definition (absolute steps); :meth:`from_dict` round-trips it."""
        d: dict[str, Any] = {}
        if self.total_steps is not None:
            d["total_steps"] = self.total_steps
        if self.knots is not None:
            d["sources"] = {n: {"weight": k.to_definition()} for n, k in zip(self.sources, self.knots)}
        else:
            assert self.phases is not None
            d["phases"] = [
                {
                    "until": ph.end,
                    "weights": dict(zip(self.sources, ph.weights)),
                    **({"ramp_steps": ph.ramp_steps} if ph.ramp_steps else {}),
                }
                for ph in self.phases
            ]
        return d

    @property
    def fingerprint(self) -> str:
        """Stable hash of the normalised definition (16 hex digits); goes into saved state."""
        d = self.to_dict()
        d.pop("total_steps", None)  # only used to resolve fractions, already resolved
        blob = json.dumps({"v": SCHEDULE_VERSION, **d}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MixtureSchedule) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        form = "sources" if self.knots is not None else f"{len(self.phases or ())} phases"
        return f"MixtureSchedule({list(self.sources)}, {form}, fingerprint={self.fingerprint})"


def unknown_source_message(name: str, known: Sequence[str]) -> str:
    """``"unknown source 'captoin' (did you mean 'caption'?)"``: names a source that is not
    among ``known`` and, if one is close, the source it was probably meant to be."""
    close = _closest(name, known)
    hint = (
        f" (did you mean {show(close)}?)" if close
        else f" (known: {show(sorted(map(str, known)))})"
    )
    return f"unknown source {show(name)}{hint}"


def _closest(name: str, known: Sequence[str]) -> str | None:
    import difflib

    close = difflib.get_close_matches(name, [str(k) for k in known], n=1, cutoff=0.6)
    return close[0] if close else None


def _check_same_sources(phases: Sequence[Any]) -> None:
    """Every phase must weight the same sources. A name is judged against the names most
    phases use (on a tie, the larger set, then the later phases'), so a typo is reported as the unknown name with
    the name it was probably meant to be, not the other way round."""
    named = [
        [str(n) for n in ph["weights"]]
        for ph in phases
        if isinstance(ph, Mapping) and isinstance(ph.get("weights"), Mapping)
    ]
    if len(named) < 2:
        return
    votes: dict[frozenset[str], list[int]] = {}
    for i, names in enumerate(named):
        votes.setdefault(frozenset(names), []).append(i)
    if len(votes) == 1:
        return
    # The reference: the name set of the most phases; on a tie the larger set (a source left
    # out is likelier than one added), then the one used last.
    reference = max(votes, key=lambda k: (len(votes[k]), len(k), max(votes[k])))
    problems = []
    for i, names in enumerate(named):
        unknown = [n for n in names if n not in reference]
        missing = [n for n in reference if n not in names]
        meant = {_closest(n, missing) for n in unknown}
        problems += [f"phase {i}: {unknown_source_message(n, missing or sorted(reference))}"
                     for n in unknown]
        problems += [f"phase {i}: source {show(n)} is missing" for n in missing if n not in meant]
    others = ", ".join(str(i) for i in votes[reference])
    raise _err(
        "phases",
        f"{'; '.join(problems)}. Every phase must weight the same sources as phase(s) {others} "
        "(use 0 to switch one off).",
    )


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise _err(name, f"{name} = {show(value)} must be an int >= 1.")
    if value > MAX_STEPS:
        raise _err(name, f"{name} = {show(value)} is over the limit of {MAX_STEPS:,} (2^53, "
                         "the last integer exact in float64); give the run's real value.")
    return int(value)


def _phase_end(where: str, until: Any, total: int | None) -> int:
    if isinstance(until, bool) or not isinstance(until, numbers.Real) or not math.isfinite(until):
        raise _err(where, f"until = {show(until)} must be a fraction (float <= 1) or a step (int).")
    if isinstance(until, numbers.Integral):
        if until < 1 or until > MAX_STEPS:
            raise _err(
                where, f"until = {show(until)} must be a step >= 1 and <= {MAX_STEPS:,} (2^53), "
                "or a fraction such as 0.9."
            )
        return int(until)
    if not 0 < until <= 1:
        raise _err(
            where,
            f"until = {show(until)}: a float is a fraction of total_steps and must lie in (0, 1]; "
            "write an absolute step as an int.",
        )
    if total is None:
        raise _err(
            where,
            f"until = {show(until)} is a fraction of total_steps, but total_steps is not set; add "
            "`total_steps: N` to the schedule (or OrderingConfig.total_steps).",
        )
    return int(round(until * total))


def implied_epochs(
    schedule: MixtureSchedule,
    total_steps: int,
    global_batch_size: int,
    source_sizes: Mapping[str, int],
    *,
    warn_above: float | None = 4.0,
) -> dict[str, float]:
    """Expected passes over each source: ``sum_{step < total_steps} w_s(step) * B / size_s``.

    Args:
        schedule: The mixture schedule.
        total_steps: Optimizer steps of the run.
        global_batch_size: Samples per optimizer step (all ranks, all micro-batches).
        source_sizes: Samples per source; must name every source of the schedule.
        warn_above: Emit a :class:`RepetitionWarning` naming every source whose implied epochs
            exceed this (None: never warn). Small annealing sets above a few epochs risk
            memorisation.

    Returns:
        ``{source: epochs}``.
    """
    total_steps = _positive_int("total_steps", total_steps)
    global_batch_size = _positive_int("global_batch_size", global_batch_size)
    missing = [s for s in schedule.sources if s not in source_sizes]
    if missing:
        raise OrderingConfigError(
            f"implied_epochs: source_sizes has no size for {missing}; give samples per source."
        )
    totals = np.zeros(len(schedule.sources))
    chunk = 1 << 16
    for start in range(0, total_steps, chunk):
        steps = np.arange(start, min(total_steps, start + chunk))
        totals += schedule.weights_table(steps).sum(axis=0)
    out = {}
    for name, draws in zip(schedule.sources, totals):
        size = source_sizes[name]
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise OrderingConfigError(
                f"implied_epochs: source_sizes[{show(name)}] = {show(size)} must be an int >= 1."
            )
        out[name] = float(draws * global_batch_size / size)
    if warn_above is not None:
        over = {n: round(e, 2) for n, e in out.items() if e > warn_above}
        if over:
            warnings.warn(
                f"implied epochs above {warn_above} for {over}: these sources repeat often "
                "enough to risk memorisation; lower their weight or add data.",
                RepetitionWarning,
                stacklevel=2,
            )
    return out
