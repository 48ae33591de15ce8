"""Bad configuration input that used to be accepted silently or crash bare is refused with a
typed error naming the field, the value and the fix (issue 12)."""

from __future__ import annotations

import pytest

from energon_ordering import MixtureSchedule, OrderingConfig, OrderingConfigError, OrderingTypeError


def _phases(*phases, total=100):
    return {"total_steps": total, "phases": list(phases)}


def test_until_that_rounds_to_a_zero_step_phase_is_refused():
    with pytest.raises(OrderingConfigError, match=r"phase 0: until = 0.004 \(step 0\) does not "
                                                  r"come after .*zero steps"):
        MixtureSchedule.from_dict(_phases({"until": 0.004, "weights": {"a": 1, "b": 1}},
                                          {"until": 1.0, "weights": {"a": 1, "b": 2}}))
    with pytest.raises(OrderingConfigError, match=r"phase 1: until = 0.504 \(step 50\) does not "
                                                  r"come after .*step 50.*zero steps.*at least one "
                                                  r"step apart"):
        MixtureSchedule.from_dict(_phases({"until": 0.5, "weights": {"a": 1, "b": 1}},
                                          {"until": 0.504, "weights": {"a": 1, "b": 2}},
                                          {"until": 1.0, "weights": {"a": 2, "b": 1}}))


def test_ramp_longer_than_its_phase_is_refused():
    with pytest.raises(OrderingConfigError, match=r"phase 1: ramp_steps = 60 is longer than the "
                                                  r"phase \(50 steps, from step 50 to 100\); use "
                                                  r"ramp_steps <= 50"):
        MixtureSchedule.from_dict(_phases({"until": 0.5, "weights": {"a": 1, "b": 1}},
                                          {"until": 1.0, "ramp_steps": 60,
                                           "weights": {"a": 1, "b": 2}}))
    # A ramp as long as its phase is fine.
    MixtureSchedule.from_dict(_phases({"until": 0.5, "weights": {"a": 1, "b": 1}},
                                      {"until": 1.0, "ramp_steps": 50, "weights": {"a": 1, "b": 2}}))


def test_weights_keyed_by_a_number_are_a_typed_error():
    with pytest.raises(OrderingConfigError, match=r"phase 0: weights are keyed by \[2023, 2024\]; "
                                                  r"source names must be strings"):
        MixtureSchedule.from_dict(_phases({"until": 1.0, "weights": {2023: 1, 2024: 1}}))


@pytest.mark.parametrize("name", ["length_sort_mode", "length_sort_placement",
                                  "length_sort_pool_holds", "blend_policy"])
def test_a_list_where_a_string_belongs_is_a_typed_error(name):
    with pytest.raises(OrderingTypeError, match=rf"OrderingConfig.{name} = \['batch'\] \(list\) "
                                                rf"must be a string, e.g. {name} = 'batch'"):
        OrderingConfig(**{name: ["batch"]})


def test_keep_contradicting_the_warmups_drop_is_refused():
    warmup = {"start": 64, "full": 512, "warmup_steps": 10, "overflow": "drop"}
    with pytest.raises(OrderingConfigError, match=r"seq_length_warmup.overflow = 'drop' "
                                                  r"contradicts seq_length_overflow = 'keep'"):
        OrderingConfig(seq_length_warmup=warmup, seq_length_overflow="keep")
    assert OrderingConfig(seq_length_warmup=warmup).seq_length_overflow == "drop"
    assert OrderingConfig(seq_length_warmup=warmup, seq_length_overflow="drop").seq_length_overflow == "drop"
    assert OrderingConfig().seq_length_overflow == "keep"
    # The resolved config round-trips.
    cfg = OrderingConfig(seq_length_warmup=warmup)
    assert OrderingConfig.from_dict(cfg.to_dict()) == cfg


def test_length_index_settings_are_strings():
    with pytest.raises(OrderingTypeError, match=r"OrderingConfig.length_index = 3 \(int\) must be "
                                                r"a string or None"):
        OrderingConfig(length_index=3)
