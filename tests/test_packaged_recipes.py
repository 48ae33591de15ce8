"""Packaged recipes: found by name from any working directory, paths still work, the wheel ships
them (``.ci/wheel_demo`` runs the demo from an installed wheel in an empty folder)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from energon_ordering.cli import main
from energon_ordering.errors import OrderingConfigError
from energon_ordering.packaged_recipes import recipe_dir, recipe_names, resolve_recipe

REPO = Path(__file__).parent.parent


def test_checkout_recipes_are_the_packaged_ones():
    assert recipe_dir() == (REPO / "recipes").resolve()
    assert recipe_names() == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert {"demo", "length_sync_batch", "slm_350m_20b"} <= set(recipe_names())


def test_resolve_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe("demo") == recipe_dir() / "demo.yaml"
    assert resolve_recipe("slm_350m_20b.yaml") == recipe_dir() / "slm_350m_20b.yaml"


def test_a_path_still_works_and_wins_over_a_name(tmp_path, monkeypatch):
    mine = tmp_path / "demo.yaml"
    mine.write_text("length_sort_pool_size: 8\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe("demo.yaml") == Path("demo.yaml")  # the local file, not the packaged one
    assert resolve_recipe(str(mine)) == mine
    assert resolve_recipe("demo") == recipe_dir() / "demo.yaml"  # no file called "demo" here


def test_unknown_recipe_names_the_value_and_the_choices(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OrderingConfigError, match=r"recipe 'nope'.*packaged names: demo, "):
        resolve_recipe("nope")
    with pytest.raises(OrderingConfigError, match=r"recipe 'sub/demo\.yaml' does not exist: no such file"):
        resolve_recipe("sub/demo.yaml")  # a path that does not exist is not a name
    (tmp_path / "folder").mkdir()
    with pytest.raises(OrderingConfigError, match="'folder' is a directory"):
        resolve_recipe("folder")


def test_a_mistyped_name_gets_did_you_mean(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OrderingConfigError,
                       match=r"no packaged recipe of that name\. Did you mean 'slm_350m_20b'\? Give"):
        resolve_recipe("slm_350m")
    with pytest.raises(OrderingConfigError, match=r"Did you mean 'llava_pretrain'\?"):
        resolve_recipe("llava_pretrian.yaml")
    for far_or_path in ("zzz", "sub/llava_pretrian.yaml"):  # nothing close; a path is not a name
        with pytest.raises(OrderingConfigError, match="does not exist") as e:
            resolve_recipe(far_or_path)
        assert "Did you mean" not in str(e.value)


def test_installed_layout_is_preferred(tmp_path, monkeypatch):
    """Inside an installed wheel the recipes sit in energon_ordering/recipes/; simulate that
    layout with a copy of the package and check that folder is the one used."""
    import shutil

    import energon_ordering

    site = tmp_path / "site"
    shutil.copytree(Path(energon_ordering.__file__).parent, site / "energon_ordering",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (site / "energon_ordering" / "recipes").mkdir()
    (site / "energon_ordering" / "recipes" / "only_here.yaml").write_text("seed: 3\n")
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", "from energon_ordering.packaged_recipes import recipe_names, "
         "resolve_recipe; print(recipe_names(), resolve_recipe('only_here'))"],
        cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    ).stdout
    assert out.strip() == f"['only_here'] {site / 'energon_ordering' / 'recipes' / 'only_here.yaml'}"


def test_cli_plan_by_name_from_an_empty_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["plan", "slm_350m_20b", "--total-steps", "19073",
                                    "--global-batch-size", "64", "--source-sizes",
                                    "web=100000,code=20000,books=5000,curated=3000"])
    assert res.exit_code == 0, res.output
    assert "Mixture schedule" in res.output and (tmp_path / "plan.png").is_file()


def test_cli_unknown_recipe_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["plan", "nope", "--total-steps", "10", "--global-batch-size", "8"])
    assert res.exit_code == 2
    assert "Invalid value for 'RECIPE': recipe 'nope'" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["demo", "--recipe", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "Invalid value for '--recipe'" in res.output


def test_cli_inspect_by_name_from_an_empty_folder(three_sources, tmp_path, monkeypatch):
    work = tmp_path / "empty"
    work.mkdir()
    monkeypatch.chdir(work)
    res = CliRunner().invoke(main, ["inspect", str(three_sources), "--recipe", "length_sync_batch",
                                    "--ranks", "2", "--steps", "6"])
    assert res.exit_code == 0, res.output
    assert (work / "inspect.png").is_file()
