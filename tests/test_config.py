"""OrderingConfig: validation, YAML recipes, round trips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from energon_ordering import OrderingConfig, OrderingConfigError, OrderingTypeError

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


def test_default_is_off():
    cfg = OrderingConfig()
    assert not cfg.length_sort_enabled
    assert cfg.length_sort_pool_size == 0


def test_round_trip():
    cfg = OrderingConfig(length_sort_pool_size=64, length_sort_mode="batch", seed=7)
    assert OrderingConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(length_sort_pool_size=-1), OrderingConfigError, r"length_sort_pool_size = -1 must be >= 0"),
        (dict(length_sort_pool_size=1.5), OrderingTypeError, r"length_sort_pool_size = 1.5 \(float\)"),
        (dict(length_sort_mode="sorted"), OrderingConfigError, r"length_sort_mode = 'sorted' is unknown"),
        (dict(seed=None), OrderingTypeError, r"seed = None"),
        (dict(length_sort_pool_size=8, length_sort_placement="pre-decode"), OrderingConfigError,
         r"length_sort_placement = 'pre-decode' is unknown.*'post-encode', 'pre-encode'"),
        (dict(length_sort_pool_size=8, length_sort_placement="pre-encode", length_sort_pool_holds="all"),
         OrderingConfigError, r"length_sort_pool_holds = 'all' is unknown.*'keys', 'raw'"),
        (dict(length_sort_pool_size=8, length_sort_pool_holds="keys"), OrderingConfigError,
         r"length_sort_pool_holds = 'keys' applies to the pre-encode pool only"),
    ],
)
def test_bad_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        OrderingConfig(**kwargs)


def test_placement_short_spelling_from_recipes(tmp_path):
    recipe = tmp_path / "lean.yaml"
    recipe.write_text("length_sort_pool_size: 10000\nlength_sort_mode: batch\nplacement: pre-encode\n")
    cfg = OrderingConfig.from_yaml(recipe)
    assert cfg.length_sort_placement == "pre-encode"
    assert OrderingConfig.from_dict(cfg.to_dict()) == cfg
    assert OrderingConfig().length_sort_placement == "post-encode"
    # Pool size 0 turns the pool off, wherever it would be placed (e.g. a flag over a recipe).
    assert not OrderingConfig(length_sort_placement="pre-encode").length_sort_enabled
    with pytest.raises(OrderingConfigError, match=r"placement = 'pre-encode' contradicts length_sort_placement = 'post-encode'"):
        OrderingConfig.from_dict({"length_sort_pool_size": 8, "placement": "pre-encode",
                                  "length_sort_placement": "post-encode"})


def test_unknown_key_is_named():
    with pytest.raises(OrderingConfigError, match=r"unknown setting\(s\) \['pool_size'\].*length_sort_pool_size"):
        OrderingConfig.from_dict({"pool_size": 10})


def test_from_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("length_sort_mode: nope\n")
    with pytest.raises(OrderingConfigError, match=r"bad.yaml: .*length_sort_mode = 'nope'"):
        OrderingConfig.from_yaml(bad)
    with pytest.raises(OrderingConfigError, match=r"no file at"):
        OrderingConfig.from_yaml(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    with pytest.raises(OrderingConfigError, match=r"not valid YAML"):
        OrderingConfig.from_yaml(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(OrderingTypeError, match=r"expected a mapping"):
        OrderingConfig.from_yaml(listy)


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_validates(recipe):
    cfg = OrderingConfig.from_yaml(recipe)
    assert OrderingConfig.from_dict(cfg.to_dict()) == cfg
    if cfg.length_sort_enabled and cfg.length_sort_mode == "batch":
        # Recipes are written for the usual micro-batch sizes.
        assert all(cfg.length_sort_pool_size % b == 0 for b in (1, 2, 4))
    if cfg.mixture_schedule is not None:
        sched = cfg.mixture_schedule
        total = cfg.total_steps or sched.total_steps
        assert total is not None, "a recipe with a schedule states total_steps"
        table = sched.weights_table(np.arange(0, total + 1, max(1, total // 500)))
        assert np.allclose(table.sum(axis=1), 1.0) and (table >= 0).all()
        assert sched.fingerprint


def test_slm_recipe_is_the_worked_example():
    cfg = OrderingConfig.from_yaml(Path(__file__).parent.parent / "recipes" / "slm_350m_20b.yaml")
    sched = cfg.mixture_schedule
    anneal = int(0.9 * cfg.total_steps)  # the guide's anneal_start
    assert sched.weights(anneal - 1) == pytest.approx(
        {"web": 0.62, "code": 0.18, "books": 0.12, "curated": 0.08})
    assert sched.weights(anneal) == pytest.approx(
        {"web": 0.35, "code": 0.20, "books": 0.10, "curated": 0.35})
    guide = lambda step: 512 + (2048 - 512) * step // 2000 if step < 2000 else 2048  # noqa: E731
    assert all(cfg.seq_length_warmup.max_seq_len(s) == guide(s) for s in range(0, 2100, 7))
    assert cfg.pack_seq_length == 2048 and cfg.packing_buffer_size is not None
    assert cfg.length_sort_enabled and cfg.pack_pool_placement in ("packs", "samples")


def test_recipe_may_point_to_a_schedule_file(tmp_path):
    (tmp_path / "mix.yaml").write_text("sources:\n  a: {weight: 1}\n  b: {weight: 3}\n")
    (tmp_path / "recipe.yaml").write_text("mixture_schedule: mix.yaml\nblend_policy: deterministic\n")
    cfg = OrderingConfig.from_yaml(tmp_path / "recipe.yaml")
    assert cfg.mixture_schedule.weights(0) == {"a": 0.25, "b": 0.75}


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(micro_batches_per_step=0), OrderingConfigError, r"micro_batches_per_step = 0"),
        (dict(total_steps=0), OrderingConfigError, r"total_steps = 0 must be >= 1"),
        (dict(blend_policy="greedy"), OrderingConfigError, r"blend_policy = 'greedy' is unknown"),
        # found by review (7 December 2026): silently random without a schedule
        (dict(blend_policy="deterministic"), OrderingConfigError,
         r"blend_policy = 'deterministic' needs a mixture_schedule.*drop blend_policy"),
        (dict(blend_policy="deterministic", length_sort_pool_size=64, length_sort_mode="batch"),
         OrderingConfigError, r"blend_policy = 'deterministic' needs a mixture_schedule"),
        (dict(schedule_lag_compensation="yes"), OrderingTypeError, r"schedule_lag_compensation = 'yes'"),
        (dict(mixture_schedule=42), OrderingTypeError, r"mixture_schedule = 42 must be"),
        (dict(mixture_schedule={"phases": [{"until": 0.5, "weights": {"a": 1}}]}),
         OrderingConfigError, r"total_steps is not set"),
        (dict(mixture_schedule={"total_steps": 10, "sources": {"a": {"weight": 1}}}, total_steps=20),
         OrderingConfigError, r"total_steps = 10 but the run has total_steps = 20"),
    ],
)
def test_bad_schedule_settings(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        OrderingConfig(**kwargs)


PLANNED = dict(length_sort_mode="planned", length_sort_placement="pre-encode",
               length_sort_pool_holds="keys")


@pytest.mark.parametrize("mix", ["auto", "step", "window"])
def test_planned_mix_is_a_recipe_key(tmp_path, mix):
    recipe = tmp_path / "planned.yaml"
    recipe.write_text("length_sort_mode: planned\nplacement: pre-encode\n"
                      f"length_sort_pool_holds: keys\nplanned_mix: {mix}\n")
    cfg = OrderingConfig.from_yaml(recipe)
    assert cfg.planned_mix == mix
    assert OrderingConfig.from_dict(cfg.to_dict()) == cfg
    assert OrderingConfig(**PLANNED).planned_mix == "auto"


#: A schedule that anneals (its weights change over training) and one whose weights only scale.
ANNEAL = {"sources": {"web": {"weight": {"linear": {0: 9, 100: 1}}}, "code": {"weight": 1}}}
SCALED = {"sources": {"web": {"weight": {"linear": {0: 2, 100: 4}}},
                      "code": {"weight": {"linear": {0: 1, 100: 2}}}}}


@pytest.mark.parametrize("mix,schedule,resolved", [
    ("auto", None, "window"), ("auto", SCALED, "window"), ("auto", ANNEAL, "step"),
    ("step", None, "step"), ("window", ANNEAL, "window"),
])
def test_auto_plans_per_step_only_where_the_schedule_changes_the_weights(mix, schedule,
                                                                          resolved):
    cfg = OrderingConfig(**PLANNED, planned_mix=mix, mixture_schedule=schedule, total_steps=200)
    assert cfg.resolved_planned_mix == resolved
    # the default window follows the granularity resolved: the window mix's is ~2^20 samples
    assert cfg.window_steps(8, 4) == (128 if resolved == "step" else 4096)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(PLANNED, planned_mix="epoch"), OrderingConfigError,
         r"^OrderingConfig.planned_mix = 'epoch' is unknown; use one of "
         r"\['auto', 'step', 'window'\]"),
        (dict(planned_mix="window"), OrderingConfigError,
         r"^OrderingConfig.planned_mix = 'window' applies to length_sort_mode = 'planned' only "
         r"\(length_sort_mode is 'sample'\); drop planned_mix or set length_sort_mode"),
        (dict(planned_mix="bogus"), OrderingConfigError, r"planned_mix = 'bogus' is unknown"),
        (dict(PLANNED, planned_mix=1), OrderingTypeError, r"planned_mix = 1 \(int\) must be a"),
    ],
)
def test_bad_planned_mix(kwargs, exc, match):
    with pytest.raises(exc, match=match) as e:
        OrderingConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_a_schedule_or_warmup_beyond_the_run_is_warned_about():
    """Found by review (7 December 2026): an anneal at step 17,165 of a 1,000-step run, or a
    warmup of 5,000 steps, was accepted silently; the run never reaches either."""
    late = {"phases": [{"until": 17165, "weights": {"web": 0.6, "cur": 0.4}},
                       {"until": 19073, "weights": {"web": 0.3, "cur": 0.7}}]}
    with pytest.warns(UserWarning, match=r"changes its weights at step 17,165, after the run's "
                      r"last step \(total_steps = 1,000\)"):
        OrderingConfig(total_steps=1000, mixture_schedule=late)
    with pytest.warns(UserWarning, match=r"changes its weights at step 1,000"):  # one past
        OrderingConfig(total_steps=1000, mixture_schedule={"phases": [
            {"until": 1000, "weights": {"web": 0.6, "cur": 0.4}},
            {"until": 2000, "weights": {"web": 0.3, "cur": 0.7}}]})
    with pytest.warns(UserWarning, match=r"warmup_steps = 5,000 is longer than the run"):
        OrderingConfig(total_steps=1000,
                       seq_length_warmup={"start": 64, "full": 512, "warmup_steps": 5000})
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # fractions, a last phase running past the end, or no total_steps: nothing to say
        OrderingConfig(total_steps=1000, mixture_schedule={"phases": [
            {"until": 0.5, "weights": {"web": 0.6, "cur": 0.4}},
            {"until": 1.0, "weights": {"web": 0.3, "cur": 0.7}}]})
        OrderingConfig(total_steps=1000, mixture_schedule={"phases": [
            {"until": 500, "weights": {"web": 0.6, "cur": 0.4}},
            {"until": 2000, "weights": {"web": 0.3, "cur": 0.7}}]})
        OrderingConfig(mixture_schedule=late)
        OrderingConfig(total_steps=1000,
                       seq_length_warmup={"start": 64, "full": 512, "warmup_steps": 1000})
