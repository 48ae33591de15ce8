"""The ``energon-ordering`` command: one module per sub-command, like Energon's own CLI.

``demo``, ``plan``, ``inspect``, ``check-resume``, ``index`` and ``advise`` each live in their
own module and define ``command``; the group here registers them. Shared input checks are in
:mod:`~energon_ordering.cli.preflight`, table formatting in :mod:`~energon_ordering.cli.tables`.

Importing this package (and so ``--version``, ``--help`` and click's usage errors) does not import
torch or Energon: each command imports what it needs when it runs.
"""

from __future__ import annotations

import click

from energon_ordering import __version__
from energon_ordering.cli import advise, check_resume, demo, index, inspect, plan
from energon_ordering.cli.options import CONTEXT

__all__ = ["main"]


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="energon-ordering")
def main() -> None:
    """Sample ordering for Megatron-LM + Energon: plan, inspect and check a recipe."""


for _module in (demo, plan, inspect, check_resume, index, advise):
    main.add_command(_module.command)
