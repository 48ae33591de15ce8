"""rescale_schedule: a schedule written for one run length, stretched to another (pure)."""

from __future__ import annotations

import pytest

from energon_ordering import OrderingConfigError
from energon_ordering.mixture.rescale import rescale_schedule
from energon_ordering.mixture.schedule import MixtureSchedule

PHASES = {"total_steps": 200, "phases": [
    {"until": 0.9, "weights": {"web": 1, "curated": 0}},
    {"until": 1.0, "ramp_steps": 10, "weights": {"web": 0, "curated": 1}}]}


def test_phases_keep_their_share_of_the_run():
    scaled = rescale_schedule(MixtureSchedule.from_dict(PHASES), 1000)
    assert scaled.to_dict() == {"total_steps": 1000, "phases": [
        {"until": 900, "weights": {"web": 1.0, "curated": 0.0}},
        {"until": 1000, "ramp_steps": 50, "weights": {"web": 0.0, "curated": 1.0}}]}
    assert scaled.weights(899) == {"web": 1.0, "curated": 0.0}
    assert scaled.weights(949) == {"web": 0.0, "curated": 1.0}  # ramp ends at 900 + 50 - 1


def test_knots_scale_and_constants_stay():
    sched = MixtureSchedule.from_dict({"total_steps": 200, "sources": {
        "web": {"weight": {"linear": {0: 1, 100: 3}}}, "code": {"weight": 2}}})
    scaled = rescale_schedule(sched, 50)
    assert scaled.to_dict()["sources"] == {"web": {"weight": {"linear": {0: 1.0, 25: 3.0}}},
                                           "code": {"weight": 2.0}}
    assert scaled.weights(25) == pytest.approx(sched.weights(100))


def test_same_length_is_the_same_schedule():
    sched = MixtureSchedule.from_dict(PHASES)
    assert rescale_schedule(sched, 200) is sched


def test_refusals():
    with pytest.raises(OrderingConfigError, match="has no total_steps"):
        rescale_schedule(MixtureSchedule.from_dict({"sources": {"web": {"weight": 1}}}), 10)
    with pytest.raises(OrderingConfigError, match="total_steps = 0 must be an int >= 1"):
        rescale_schedule(MixtureSchedule.from_dict(PHASES), 0)
    merged = {"total_steps": 200, "sources": {"web": {"weight": {"step": {0: 1, 1: 3}}}}}
    with pytest.raises(OrderingConfigError, match=r"source 'web'.s step knots at steps \[0, 1\] merge"):
        rescale_schedule(MixtureSchedule.from_dict(merged), 10)
    with pytest.raises(OrderingConfigError, match="from 200 to 2 steps leaves it invalid"):
        rescale_schedule(MixtureSchedule.from_dict(PHASES), 2)
