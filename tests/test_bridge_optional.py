"""Megatron-Bridge is optional: the package and its CLI import without it, and the Bridge
module says how to install Bridge when it is missing (on the default Python it always is:
Bridge 0.6.2 needs Python 3.12; the Bridge tests themselves are in test_bridge.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


def test_package_and_cli_do_not_import_bridge():
    code = ("import sys, energon_ordering, energon_ordering.cli, energon_ordering.integrations.megatron_lm; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron.bridge')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("megatron.bridge") is not None, reason="Bridge is installed")
def test_bridge_module_without_bridge_says_how_to_install():
    with pytest.raises(ImportError, match=r"pip install --no-deps megatron-bridge==0\.6\.2"):
        import energon_ordering.integrations.bridge  # noqa: F401
