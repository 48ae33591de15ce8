"""A mistake in a command's input, reported as one line and exit code 2."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import click

from energon_ordering.errors import OrderingError


class UserError(click.ClickException):
    """A mistake in the command's input: one line ``Error: ...`` and exit code 2, like click's
    own usage errors (exit code 1 means a check ran and failed, e.g. ``check-resume``)."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))  # one line, whatever the message holds


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turns the package's typed errors into one clear line and exit code 2."""
    try:
        yield
    except OrderingError as e:
        raise UserError(str(e)) from e
