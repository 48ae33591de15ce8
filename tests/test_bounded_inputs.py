"""Inputs that could exhaust the machine are refused, bounded or typed: YAML alias bombs, error
messages quoting huge values, and data states of the wrong shape."""

from __future__ import annotations

import pickle

import pytest

from energon_ordering import (
    MixtureSchedule,
    OrderingConfig,
    OrderingConfigError,
    OrderingTypeError,
    StateMismatchError,
    restore_state_rank,
)
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader

# 354 bytes, 9**9 = 387 million strings once the aliases are expanded.
ALIAS_BOMB = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{b}: &{b} [{','.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefg", "bcdefgh")]
    + ["length_sort_mode: [*h,*h,*h,*h,*h,*h,*h,*h,*h]", ""]
)


def test_a_yaml_alias_bomb_is_refused_naming_the_file(tmp_path):
    # Before: 139 s and 4.6 GB, then an error message of 2.3 billion characters.
    assert len(ALIAS_BOMB) < 400
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(ALIAS_BOMB)
    with pytest.raises(OrderingConfigError, match=(
            rf"OrderingConfig.from_yaml: {recipe} expands to more than 100,000 YAML nodes "
            r"through its aliases .*Write the values out, or alias only small nodes")):
        OrderingConfig.from_yaml(recipe)
    with pytest.raises(OrderingConfigError, match=r"MixtureSchedule.from_yaml: .*bomb.yaml expands"):
        MixtureSchedule.from_yaml(recipe)


def test_a_recursive_yaml_alias_is_refused(tmp_path):
    recipe = tmp_path / "loop.yaml"
    recipe.write_text("length_sort_mode: &loop [1, *loop]\n")
    with pytest.raises(OrderingConfigError, match=(
            rf"{recipe} is not valid YAML: .*found a recursive alias")):
        OrderingConfig.from_yaml(recipe)


def test_small_aliases_still_load(tmp_path):
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text(
        "phases:\n"
        "  - until: 0.5\n"
        "    weights: &mix {web: 0.7, code: 0.3}\n"
        "  - until: 1.0\n"
        "    weights: *mix\n"
    )
    loaded = MixtureSchedule.from_yaml(schedule, total_steps=100)
    assert loaded.weights(0) == loaded.weights(99) == pytest.approx({"web": 0.7, "code": 0.3})


@pytest.mark.parametrize("make,exc,match", [
    (lambda v: OrderingConfig(length_sort_mode="x" * v), OrderingConfigError,
     r"OrderingConfig.length_sort_mode = 'x+\.\.\.x+' is unknown"),
    (lambda v: OrderingConfig(length_sort_pool_size=[0] * v), OrderingTypeError,
     r"OrderingConfig.length_sort_pool_size = \[0, 0, .*\.\.\.\] \(list\) must be an int"),
    (lambda v: MixtureSchedule.from_dict({"phases": [{"until": 1.0, "weights": {"w": "9" * v}}]},
                                         total_steps=10),
     OrderingConfigError, r"weight '9+\.\.\.9+' is not a number"),
    (lambda v: OrderingConfig.from_dict({"k" * v: 1}), OrderingConfigError,
     r"unknown setting\(s\) \['k+\.\.\.k+.*; known settings are"),
])
def test_error_messages_quote_at_most_a_bounded_excerpt_of_a_value(make, exc, match):
    # Before: the whole value, e.g. a million characters for a million-element list.
    with pytest.raises(exc, match=match) as caught:
        make(1_000_000)
    assert len(str(caught.value)) < 2_000


def test_show_is_repr_for_small_values_and_bounded_for_huge_ones():
    from energon_ordering.errors import show

    for value in ("web", 3, 2.5, None, True, [1, "a"], (1,), {"b": 1, "a": [2, 3]}):
        assert show(value) == repr(value)
    bomb: list = ["lol"] * 9
    for _ in range(20):  # 9**21 strings by reference
        bomb = [bomb] * 9
    assert len(show(bomb)) <= 200 and show(bomb).endswith("...")
    assert len(show("x" * 10_000)) <= 200 and "..." in show("x" * 10_000)


# -- data states of the wrong shape ------------------------------------------------------------

CFG = OrderingConfig(length_sort_pool_size=8, length_sort_mode="batch", seed=1)


def _saved(path, num_workers):
    loader = build_train_loader(path, ordering=CFG, num_workers=num_workers, batch_size=4)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.save_state_rank()
    del it
    close_loader(loader)
    return pickle.dumps(state)


@pytest.fixture(scope="module")
def states(small_dataset):
    return {n: _saved(small_dataset, n) for n in (0, 2)}


EDITS = {
    "worker_states=[None]": (
        lambda s: setattr(s, "worker_states", [None] * len(s.worker_states)),
        r"worker_states\[0\] is None \(NoneType\); it must be a FlexState .* or a "
        r"SavableDatasetCheckpoint"),
    "a worker state None": (
        lambda s: s.worker_states.__setitem__(-1, None),
        r"worker_states\[(0|1)\] is None \(NoneType\)"),
    "worker_states a dict": (
        lambda s: setattr(s, "worker_states", {"0": 1}),
        r"worker_states is \{'0': 1\} \(dict\); it must be a non-empty list"),
    "next_worker_id a string": (
        lambda s: setattr(s, "next_worker_id", "1"),
        r"next_worker_id is '1' \(str\); it must be an int in \[0, (1|2)\)"),
    "micro_batch_size a string": (
        lambda s: setattr(s, "micro_batch_size", "4"),
        r"micro_batch_size is '4' \(str\); it must be None or an int >= 1"),
}
WORKER_EDITS = {
    "offset None": (
        lambda s: setattr(s.worker_states[0], "offset", None),
        r"worker_states\[0\]\.offset is None \(NoneType\); it must be an int >= 0"),
    "inner state an int": (
        lambda s: setattr(s.worker_states[1], "state", 3),
        r"worker_states\[1\]\.state is 3 \(int\); it must be None or a SavableDatasetState"),
}
CASES = [(0, name) for name in EDITS] + [(2, name) for name in [*EDITS, *WORKER_EDITS]]


@pytest.mark.parametrize("num_workers,edit", CASES)
def test_a_state_of_the_wrong_shape_is_a_typed_error_naming_what_is_wrong(
        small_dataset, states, num_workers, edit):
    # Before: bare AssertionError / TypeError / AttributeError from Energon's restore (or a
    # misleading "carries no energon_ordering stamp").
    change, match = {**EDITS, **WORKER_EDITS}[edit]
    state = pickle.loads(states[num_workers])
    change(state)
    loader = build_train_loader(small_dataset, ordering=CFG, num_workers=num_workers, batch_size=4)
    try:
        with pytest.raises(StateMismatchError, match=(
                rf"restore_state_rank: {match}.*The state was edited or damaged: pass the "
                r"per-rank state exactly as loader.save_state_rank\(\) returned it")):
            restore_state_rank(loader, state)
            next(iter(loader))
    finally:
        close_loader(loader)


def test_a_state_that_is_not_a_loader_state_is_a_typed_error(small_dataset):
    loader = build_train_loader(small_dataset, ordering=CFG, num_workers=0, batch_size=4)
    with pytest.raises(StateMismatchError, match=(
            r"the state is \{'worker_states': \[\]\} \(dict\); it must be the "
            r"SavableDataLoaderState")):
        restore_state_rank(loader, {"worker_states": []})
    close_loader(loader)


def test_no_message_quotes_a_value_unbounded():
    # every value an f-string of the package quotes goes through errors.show(), which bounds it
    import re
    from pathlib import Path

    import energon_ordering

    root = Path(energon_ordering.__file__).parent
    unbounded = [
        f"{p.relative_to(root)}:{i}"
        for p in root.rglob("*.py") if p.name != "errors.py" and p != root / "__init__.py"
        for i, line in enumerate(p.read_text().splitlines(), start=1)
        if re.search(r"\{[^{}!:\n]+!r\}", line)
    ]
    assert not unbounded, f"use errors.show(value) instead of {{value!r}} at {unbounded}"
