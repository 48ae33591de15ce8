"""OrderingConfig: validation, YAML recipes, round trips."""

from __future__ import annotations

from pathlib import Path

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
    ],
)
def test_bad_values(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        OrderingConfig(**kwargs)


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
    assert cfg.length_sort_enabled
    if cfg.length_sort_mode == "batch":
        # Recipes are written for the usual micro-batch sizes.
        assert all(cfg.length_sort_pool_size % b == 0 for b in (1, 2, 4, 8))
