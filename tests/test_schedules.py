"""MixtureSchedule and implied_epochs as pure functions."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import yaml

from energon_ordering import OrderingConfigError, OrderingTypeError
from energon_ordering.mixture.schedule import MixtureSchedule, RepetitionWarning, implied_epochs

KNOTS = {
    "total_steps": 20000,
    "sources": {
        "web": {"weight": {"linear": {0: 100, 18000: 62, 20000: 35}}},
        "curated": {"weight": {"step": {0: 8, 18000: 35}}},
        "code": {"weight": 18},
    },
}
PHASES = {
    "total_steps": 20000,
    "phases": [
        {"until": 0.9, "weights": {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}},
        {"until": 1.0, "ramp_steps": 200,
         "weights": {"web": 0.35, "code": 0.20, "books": 0.10, "curated": 0.35}},
    ],
}


def _raw(step, web, curated, code=18.0):
    total = web + curated + code
    return {"web": web / total, "curated": curated / total, "code": code / total}


def test_knots_linear_step_and_constant():
    s = MixtureSchedule.from_dict(KNOTS)
    assert s.sources == ("web", "curated", "code")
    assert s.weights(0) == pytest.approx(_raw(0, 100, 8))
    assert s.weights(9000) == pytest.approx(_raw(9000, 81, 8))  # linear midpoint
    assert s.weights(17999) == pytest.approx(_raw(17999, 100 - 38 * 17999 / 18000, 8))
    assert s.weights(18000) == pytest.approx(_raw(18000, 62, 35))  # step knot is inclusive
    assert s.weights(19000) == pytest.approx(_raw(19000, 48.5, 35))
    assert s.weights(20000) == pytest.approx(_raw(20000, 35, 35))
    assert s.weights(10**6) == s.weights(20000)  # clamped after the last knot
    for step in (0, 5, 18000, 25000):
        assert sum(s.weights(step).values()) == pytest.approx(1.0)


def test_knots_before_first_knot_hold_its_value():
    s = MixtureSchedule.from_dict({"sources": {"a": {"weight": {"linear": {100: 1, 200: 3}}},
                                               "b": {"weight": {"step": {50: 1}}}}})
    assert s.weights(0) == pytest.approx({"a": 0.5, "b": 0.5})


def test_phases_until_is_exclusive_and_ramp_is_linear():
    s = MixtureSchedule.from_dict(PHASES)
    first = {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08}
    last = {"web": 0.35, "code": 0.20, "books": 0.10, "curated": 0.35}
    assert s.weights(0) == pytest.approx(first)
    assert s.weights(17999) == pytest.approx(first)
    mix = lambda t: {k: (1 - t) * first[k] + t * last[k] for k in first}  # noqa: E731
    assert s.weights(18000) == pytest.approx(mix(1 / 200))  # boundary belongs to phase 1
    assert s.weights(18099) == pytest.approx(mix(100 / 200))
    assert s.weights(18199) == pytest.approx(last)
    assert s.weights(30000) == pytest.approx(last)


def test_phase_without_ramp_switches_at_until():
    s = MixtureSchedule.from_dict({"total_steps": 10, "phases": [
        {"until": 0.5, "weights": {"a": 1, "b": 0}},
        {"until": 1.0, "weights": {"a": 0, "b": 1}}]})
    assert s.weights(4) == {"a": 1.0, "b": 0.0}
    assert s.weights(5) == {"a": 0.0, "b": 1.0}


def test_absolute_until_and_unnormalised_weights():
    s = MixtureSchedule.from_dict({"phases": [
        {"until": 100, "weights": {"a": 3, "b": 1}},
        {"until": 200, "weights": {"a": 1, "b": 1}}]})
    assert s.weights(99) == {"a": 0.75, "b": 0.25}
    assert s.weights(100) == {"a": 0.5, "b": 0.5}


def test_weights_table_matches_weights():
    s = MixtureSchedule.from_dict(PHASES)
    steps = np.arange(17900, 18300, 7)
    table = s.weights_table(steps)
    for row, step in zip(table, steps):
        assert list(row) == pytest.approx(list(s.weights(int(step)).values()))


def test_fingerprint_is_stable_and_sensitive():
    a = MixtureSchedule.from_dict(PHASES)
    b = MixtureSchedule.from_dict(yaml.safe_load(yaml.safe_dump(PHASES)))
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 16
    # fractions resolved: the same phase ends written as absolute steps give the same schedule
    absolute = {"phases": [{**PHASES["phases"][0], "until": 18000},
                           {**PHASES["phases"][1], "until": 20000}]}
    assert MixtureSchedule.from_dict(absolute).fingerprint == a.fingerprint
    changed = {**PHASES, "phases": [PHASES["phases"][0], {**PHASES["phases"][1], "ramp_steps": 100}]}
    assert MixtureSchedule.from_dict(changed).fingerprint != a.fingerprint
    assert MixtureSchedule.from_dict(KNOTS).fingerprint != a.fingerprint
    assert MixtureSchedule.from_dict(a.to_dict()) == a


def test_from_yaml(tmp_path):
    p = tmp_path / "mix.yaml"
    p.write_text(yaml.safe_dump(KNOTS))
    assert MixtureSchedule.from_yaml(p) == MixtureSchedule.from_dict(KNOTS)
    with pytest.raises(OrderingConfigError, match="no file at"):
        MixtureSchedule.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  web: {weight: -1}\n")
    with pytest.raises(OrderingConfigError, match=r"bad.yaml: .*source 'web'.*-1"):
        MixtureSchedule.from_yaml(bad)


def _phases(*phases, total=100):
    return {"total_steps": total, "phases": list(phases)}


@pytest.mark.parametrize(
    "d,match",
    [
        ({"sources": {"web": {"weight": -1}}}, r"source 'web': weight -1.0 is invalid"),
        ({"sources": {"web": {"weight": math.nan}}}, r"source 'web': weight nan is invalid"),
        ({"sources": {"web": {"weight": "lots"}}}, r"source 'web': weight 'lots' is not a number"),
        ({"sources": {"web": {"weight": {"cubic": {0: 1}}}}}, r"source 'web'.*linear"),
        ({"sources": {"web": {"weight": {"linear": {-5: 1}}}}}, r"knot step -5"),
        ({"sources": {"web": 3}}, r"source 'web': 3 must be \{weight"),
        ({"sources": {"a": {"weight": {"step": {0: 1, 10: 0}}}, "b": {"weight": 0}}},
         r"all weights are 0 at step 10"),
        ({}, r"exactly one of `sources`"),
        ({"sources": {"a": {"weight": 1}}, "phases": []}, r"exactly one of"),
        ({"sources": {"a": {"weight": 1}}, "mix": 1}, r"unknown key\(s\) \['mix'\]"),
        (_phases({"until": 0.9, "weights": {"a": 1, "b": 1}},
                 {"until": 0.5, "weights": {"a": 1, "b": 1}}),
         r"phase 1: until = 0.5 \(step 50\) does not come after.*step 90"),
        (_phases({"until": 0.5, "weights": {"a": 1, "b": 1}},
                 {"until": 1.0, "weights": {"a": 1}}), r"phase 1: source 'b' is missing"),
        (_phases({"until": 0.5, "weights": {"a": 1, "b": 1}},
                 {"until": 1.0, "weights": {"a": 1, "b": 1, "c": 1}}), r"phase 0: source 'c' is missing"),
        (_phases({"until": 0.5, "weights": {"a": 0, "b": 0}}), r"phase 0: all weights are 0"),
        (_phases({"until": 0.5, "weights": {"a": 1, "b": -2}}), r"phase 0 source 'b': weight -2.0"),
        (_phases({"until": 1.5, "weights": {"a": 1}}), r"phase 0: until = 1.5: a float is a fraction"),
        ({"phases": [{"until": 0.5, "weights": {"a": 1}}]}, r"total_steps is not set"),
        (_phases({"until": 0.5, "weights": {"a": 1}, "ramp_steps": 10}), r"first phase"),
        (_phases({"until": 0.5, "weights": {"a": 1}}, {"until": 1.0, "weights": {"a": 1}, "ramp_steps": -1}),
         r"phase 1: ramp_steps = -1"),
        (_phases({"until": 0.5, "weight": {"a": 1}}), r"phase 0: keys"),
        ({"total_steps": 0, "sources": {"a": {"weight": 1}}}, r"total_steps = 0 must be an int >= 1"),
    ],
)
def test_bad_definitions(d, match):
    with pytest.raises(OrderingConfigError, match=match):
        MixtureSchedule.from_dict(d)


DEMO_SOURCES = {"caption": 0.5, "vqa": 0.25, "ocr": 0.15, "curated": 0.1}


def _renamed(weights, old, new):
    return {(new if k == old else k): v for k, v in weights.items()}


@pytest.mark.parametrize("typo_phase", [0, 1])
def test_a_typo_is_named_as_the_unknown_source(typo_phase):
    # The case: the typo in phase 0 of two; and a typo in the middle one of three.
    phases = [{"until": 100, "weights": DEMO_SOURCES}, {"until": 200, "weights": DEMO_SOURCES}]
    if typo_phase == 1:
        phases.append({"until": 300, "weights": DEMO_SOURCES})
    phases[typo_phase] = {**phases[typo_phase],
                          "weights": _renamed(DEMO_SOURCES, "caption", "captoin")}
    with pytest.raises(OrderingConfigError,
                       match=rf"phase {typo_phase}: unknown source 'captoin' \(did you mean "
                             r"'caption'\?\)\. Every phase must weight the same sources") as e:
        MixtureSchedule.from_dict({"phases": phases})
    assert "missing" not in str(e.value)


def test_an_unrelated_name_lists_the_known_sources():
    phases = [{"until": 10, "weights": {"web": 1, "code": 1}},
              {"until": 20, "weights": {"web": 1, "code": 1}},
              {"until": 30, "weights": {"web": 1, "zzz": 1}}]
    with pytest.raises(OrderingConfigError, match=r"phase 2: unknown source 'zzz' \(known: "
                                                  r"\['code'\]\)"):
        MixtureSchedule.from_dict({"phases": phases})


def test_knot_steps_from_json_may_be_strings():
    s = MixtureSchedule.from_dict({"sources": {"a": {"weight": {"step": {"0": 1, "10": 3}}},
                                               "b": {"weight": 1}}})
    assert s.weights(10) == {"a": 0.75, "b": 0.25}


def test_crossing_ramps_are_valid():
    # a ramps down while b ramps up: the sum never reaches 0
    s = MixtureSchedule.from_dict({"sources": {"a": {"weight": {"linear": {0: 1, 10: 0}}},
                                               "b": {"weight": {"linear": {0: 0, 20: 1}}}}})
    assert s.weights(10) == {"a": 0.0, "b": 1.0}


def test_total_steps_must_agree():
    with pytest.raises(OrderingConfigError, match=r"total_steps = 20000 but the run has total_steps = 100"):
        MixtureSchedule.from_dict(PHASES, total_steps=100)
    s = MixtureSchedule.from_dict({"phases": PHASES["phases"]}, total_steps=20000)
    assert s == MixtureSchedule.from_dict(PHASES)


def test_not_a_mapping():
    with pytest.raises(OrderingTypeError, match="expected a mapping"):
        MixtureSchedule.from_dict([1, 2])


def test_negative_step():
    with pytest.raises(OrderingConfigError, match="step -1 is negative"):
        MixtureSchedule.from_dict(KNOTS).weights(-1)


def test_implied_epochs():
    s = MixtureSchedule.from_dict(PHASES)
    sizes = {"web": 10_000_000, "code": 1_000_000, "books": 1_000_000, "curated": 50_000}
    with pytest.warns(RepetitionWarning, match=r"curated"):
        ep = implied_epochs(s, 20000, 256, sizes)
    table = s.weights_table(np.arange(20000)).sum(axis=0)
    for i, name in enumerate(s.sources):
        assert ep[name] == pytest.approx(table[i] * 256 / sizes[name])
    # closed form for the first phase: 18000 steps at 0.62
    assert ep["web"] == pytest.approx((18000 * 0.62 + sum(
        (1 - (k + 1) / 200) * 0.62 + (k + 1) / 200 * 0.35 for k in range(200)) + 1800 * 0.35)
        * 256 / 1e7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        implied_epochs(s, 20000, 256, sizes, warn_above=None)
    with pytest.raises(OrderingConfigError, match=r"no size for \['curated'\]"):
        implied_epochs(s, 20000, 256, {"web": 1, "code": 1, "books": 1})
    with pytest.raises(OrderingConfigError, match=r"source_sizes\['web'\] = 0"):
        implied_epochs(s, 20000, 256, {**sizes, "web": 0})


@pytest.mark.parametrize("definition,changes", [
    ({"sources": {"a": {"weight": 1}, "b": {"weight": 3}}}, False),
    # both weights double together: the normalised weights never move
    ({"sources": {"a": {"weight": {"linear": {0: 1, 100: 2}}},
                  "b": {"weight": {"linear": {0: 3, 100: 6}}}}}, False),
    ({"sources": {"a": {"weight": {"linear": {0: 1, 100: 2}}}, "b": {"weight": 3}}}, True),
    ({"sources": {"a": {"weight": {"step": {0: 1, 150: 2}}}, "b": {"weight": 1}}}, True),
    ({"phases": [{"until": 10, "weights": {"a": 1, "b": 1}},
                 {"until": 20, "weights": {"a": 2, "b": 2}, "ramp_steps": 5}]}, False),
    ({"phases": [{"until": 10, "weights": {"a": 1, "b": 1}},
                 {"until": 20, "weights": {"a": 1, "b": 3}, "ramp_steps": 5}]}, True),
])
def test_changes_weights_is_whether_two_steps_differ(definition, changes):
    s = MixtureSchedule.from_dict(definition, total_steps=200)
    assert s.changes_weights is changes
    table = s.weights_table(np.arange(0, 200))
    assert bool(np.ptp(table, axis=0).max() > 1e-12) is changes  # every step, checked directly


def test_columns_of_maps_the_metadataset_order_onto_the_schedule():
    s = MixtureSchedule.from_dict({"sources": {"a": {"weight": 1.0}, "b": {"weight": 3.0}}})
    table = s.weights_table([0])
    # a metadataset listing b before a reads b's column first
    assert table[:, s.columns_of(["b", "a"])].tolist() == [[0.75, 0.25]]
    # unnamed sources take the schedule's order
    assert s.columns_of([None, None]) == [0, 1]
