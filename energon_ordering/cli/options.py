"""Options several commands share: click's context settings and the task encoder to measure
lengths with (``--task-encoder``, ``--tokens-per-media``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from energon_ordering.errors import show

#: ``-h`` as well as ``--help``, and every option's default in its help, as in ``energon``.
CONTEXT = {"help_option_names": ["-h", "--help"], "show_default": True}

TASK_ENCODER_OPTIONS = [
    click.option("--task-encoder", default=None, metavar="MODULE:CLASS",
                 help="Your task encoder (with the OrderingTaskEncoder mixin) for exact lengths "
                      "[default: estimate lengths from text tokens and media count]."),
    click.option("--tokens-per-media", type=click.IntRange(min=0), default=256,
                 help="Tokens per image/video for the length estimate."),
]


def with_task_encoder(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Adds :data:`TASK_ENCODER_OPTIONS` to a command."""
    for opt in reversed(TASK_ENCODER_OPTIONS):
        fn = opt(fn)
    return fn


def import_function(spec: str, param_hint: str) -> Callable[..., Any]:
    """The callable ``MODULE:FUNCTION`` names; a usage error naming ``param_hint`` if it cannot
    be imported or is not callable."""
    import importlib

    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise click.BadParameter(f"{show(spec)}: cannot import it ({e}); give MODULE:FUNCTION.",
                                 param_hint=param_hint) from e
    if not callable(fn):
        raise click.BadParameter(f"{show(spec)} is not callable.", param_hint=param_hint)
    return fn


def resolve_task_encoder(spec: str | None, tokens_per_media: int) -> Callable[[], Any]:
    """``MODULE:CLASS`` of a task encoder with the OrderingTaskEncoder mixin, or the estimator.

    Imports torch and Energon: call it inside a command, not at import time.
    """
    import functools
    import importlib

    from energon_ordering.inspect.length_estimate import LengthEstimateTaskEncoder
    from energon_ordering.task_encoder import OrderingTaskEncoder

    if spec is None:
        return functools.partial(LengthEstimateTaskEncoder, tokens_per_media)
    module, _, name = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise click.BadParameter(f"{show(spec)}: cannot import it ({e}); give MODULE:CLASS.",
                                 param_hint="--task-encoder") from e
    if not (isinstance(cls, type) and issubclass(cls, OrderingTaskEncoder)):
        raise click.BadParameter(
            f"{show(spec)} is not a task encoder class with the OrderingTaskEncoder mixin; define "
            "class MyTE(OrderingTaskEncoder, YourTaskEncoder).", param_hint="--task-encoder")
    return cls
