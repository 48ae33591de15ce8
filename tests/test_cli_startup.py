"""The CLI starts without torch or Energon: ``--version``, ``--help`` and click's usage errors
import only the command group, and each command imports what it needs when it runs. The
package's own top level is lazy too (PEP 562), and still exports every public name.

Asserted on the modules a fresh interpreter imported, never on a time.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys

import pytest

import energon_ordering

HEAVY = ("torch", "megatron.energon")


def _imported(cmd: list[str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Runs ``cmd`` with Python's import profiler on; its result and every module it imported."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    modules = {line.rsplit("|", 1)[1].strip() for line in res.stderr.splitlines()
               if line.startswith("import time:") and "|" in line}
    return res, modules


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(f"{h}.") for h in HEAVY))


CLI = [sys.executable, "-m", "energon_ordering.cli"]


@pytest.mark.parametrize("args, exit_code", [
    (["--version"], 0),
    (["--help"], 0),
    *[([cmd, "--help"], 0) for cmd in ("demo", "plan", "inspect", "check-resume", "index", "advise")],
    (["plan"], 2),  # missing RECIPE
    (["plan", "demo", "--global-batch-size", "0"], 2),  # out of range
    (["plan", "demo_recipe", "--global-batch-size", "8"], 2),  # no such recipe
    (["no-such-command"], 2),
    (["index", ".", "--name", "../../evil"], 2),  # a name that would leave its folder
    (["index", ".", "--rendezvous", "nohost"], 2),  # not HOST:PORT
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_cli_answers_without_torch_or_energon(args, exit_code):
    res, modules = _imported([*CLI, *args])
    assert res.returncode == exit_code, res.stdout + res.stderr
    assert _heavy(modules) == []
    assert "energon_ordering.cli" in modules  # the profile saw the CLI's own imports


def test_version_through_the_installed_command():
    exe = shutil.which("energon-ordering")
    if exe is None:
        pytest.skip("the energon-ordering console script is not installed")
    res, modules = _imported([exe, "--version"])
    assert res.returncode == 0 and res.stdout.strip() == (
        f"energon-ordering, version {energon_ordering.__version__}")
    assert _heavy(modules) == [] and "energon_ordering.cli" in modules


def test_importing_the_cli_group_leaves_torch_and_energon_out():
    code = ("import sys; from energon_ordering.cli import main; "
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "[]"


def test_the_profile_sees_torch_where_it_is_imported():
    """The check above can fail: a module that needs torch shows up in the profile."""
    res, modules = _imported([sys.executable, "-c", "import energon_ordering.task_encoder"])
    assert res.returncode == 0, res.stderr
    assert set(_heavy(modules)) >= {"torch", "megatron.energon"}


def test_every_public_name_imports_from_the_package():
    names = ", ".join(n for n in energon_ordering.__all__)
    code = (f"import sys; from energon_ordering import {names}\n"
            "import energon_ordering as e\n"
            "assert all(getattr(e, n) is globals()[n] for n in e.__all__)\n"
            "assert set(e.__all__) <= set(dir(e))\n"
            "print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        energon_ordering.NoSuchName  # noqa: B018


def test_the_lazy_table_matches_the_type_checking_imports():
    """``_EXPORTS`` (what loads at run time) and the ``TYPE_CHECKING`` block (what type checkers
    see) name the same modules for the same names, and together they are ``__all__``."""
    tree = ast.parse(open(energon_ordering.__file__).read())
    block = next(n for n in tree.body if isinstance(n, ast.If)
                 and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING")
    typed = {a.name: node.module for node in block.body for a in node.names}
    assert typed == energon_ordering._EXPORTS
    assert set(typed) | {"__version__"} == set(energon_ordering.__all__)


@pytest.mark.parametrize("command", ["plan", "inspect", "check-resume", "demo"])
@pytest.mark.parametrize("mistake", ["length_sort_pool_sise: 64\n",  # a typo: did you mean
                                     "length_sort_pool_size: -1\n",  # a bad value
                                     "mixture_schedule: {phases: [{until: 1.0, weights: "
                                     "{web: -1}}]}\ntotal_steps: 10\n"])  # a bad schedule
def test_a_mistake_in_the_recipe_is_reported_without_torch_or_energon(command, mistake, tmp_path):
    """A recipe-level error is answered before torch and Energon are imported (2.75 s of CPU)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(mistake)
    args = {"plan": ["plan", str(recipe), "--global-batch-size", "8"],
            "inspect": ["inspect", str(tmp_path), "--recipe", str(recipe)],
            "check-resume": ["check-resume", str(tmp_path), "--recipe", str(recipe), "--cut", "1"],
            "demo": ["demo", "--recipe", str(recipe), "--out", str(tmp_path / "demo")]}[command]
    res, modules = _imported([*CLI, *args])
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith(f"Error: {recipe}: "), res.stderr
    assert _heavy(modules) == []
