"""A task encoder that reads Megatron-LM's arguments, built outside ``pretrain`` (for indexing).

Megatron-LM's ``examples/multimodal`` ``TaskEncoder`` calls ``get_args()`` and
``get_tokenizer()`` in its constructor, so it can only be built after Megatron parsed its
command line and set its global variables (``pretrain`` does that; building it earlier raises
``AssertionError: args is not initialized``). :func:`task_encoder_with_megatron_args` does what
``pretrain`` does first, with Megatron's own parser and validation, on the training flags given
as one string, then builds the encoder::

    energon-ordering index /data/llava/metadataset.yaml --task-encoder mm_te:TE \\
        --megatron-args "--tokenizer-type MultimodalTokenizer --tokenizer-model ... (the training flags)"

Both calling conventions of Megatron-LM are followed: core_v0.19.0's
``arguments.parse_and_validate_args`` (which sets the global variables itself), and before it
``parse_args`` + ``validate_args`` + ``global_vars.set_global_variables`` (what core_v0.16.1's
``initialize_megatron`` runs). ``megatron.training`` is imported lazily (the megatron-core wheel
ships it only from 0.19); without it one :class:`OrderingConfigError` says how to get it.

The flags are parsed with Megatron's flags, this package's (``add_energon_ordering_args``) and,
by default, the example's own (``multimodal_args.add_multimodal_extra_args``, found when
``examples/multimodal`` is on the import path, as it is for an encoder imported from there);
pass ``extra_args_provider`` for a training script with flags of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import shlex
import sys
from collections.abc import Callable
from typing import Any

from energon_ordering.errors import OrderingConfigError, OrderingTypeError, show
from energon_ordering.integrations.megatron_args import add_energon_ordering_args

__all__ = ["build_task_encoder", "megatron_extra_args", "parse_megatron_args",
           "task_encoder_with_megatron_args"]

#: What Megatron-LM's examples/multimodal/train.py passes as ``args_defaults``.
EXAMPLE_ARGS_DEFAULTS: dict[str, Any] = {"tokenizer_type": "GPT2BPETokenizer"}

#: One line on how to get ``megatron.training`` when it is missing.
HOW_TO_GET_TRAINING = (
    "it is Megatron-LM's training package, which the megatron-core wheel ships only from 0.19: "
    "put your Megatron-LM checkout first on the import path (PYTHONPATH=/path/to/Megatron-LM:"
    "/path/to/Megatron-LM/examples/multimodal), or install megatron-core >= 0.19 (Python >= 3.12)"
)

ExtraArgs = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def megatron_extra_args(extra_args_provider: ExtraArgs | None = None) -> ExtraArgs:
    """The ``extra_args_provider`` the flags are parsed with: ``extra_args_provider`` (or, if
    None and ``multimodal_args`` is importable, the example's ``add_multimodal_extra_args``),
    followed by this package's ``add_energon_ordering_args`` unless it added them already."""
    if extra_args_provider is None:
        try:
            extra_args_provider = importlib.import_module("multimodal_args").add_multimodal_extra_args
        except (ImportError, AttributeError):
            extra_args_provider = None
    own = extra_args_provider

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = own(parser) if own is not None else parser
        if not any(a.dest == "length_sort_pool_size" for a in parser._actions):
            parser = add_energon_ordering_args(parser)
        return parser

    return provider


def _arguments_module() -> Any:
    try:
        return importlib.import_module("megatron.training.arguments")
    except ImportError as e:
        raise OrderingConfigError(
            f"--megatron-args needs megatron.training, which cannot be imported ({e}): "
            f"{HOW_TO_GET_TRAINING}."
        ) from e


def parse_megatron_args(megatron_args: str, *, extra_args_provider: ExtraArgs | None = None,
                        args_defaults: dict[str, Any] | None = None) -> argparse.Namespace:
    """Parses ``megatron_args`` (the training flags, one shell-quoted string) with Megatron-LM's
    own parser and validation and sets Megatron's global variables (args, tokenizer,
    micro-batch calculator), as ``pretrain`` does before it builds anything.

    Megatron's printout (its argument table) goes to stderr.

    Args:
        megatron_args: The flags, e.g. ``"--micro-batch-size 4 --tokenizer-type ..."``.
        extra_args_provider: Adds the training script's own flags (see
            :func:`megatron_extra_args` for the default).
        args_defaults: As ``pretrain(args_defaults=...)``; default the multimodal example's.

    Returns:
        Megatron's args (also what ``megatron.training.get_args()`` returns from now on).

    Raises:
        OrderingConfigError: ``megatron.training`` is missing, or Megatron's parser or
            validation refused the flags (its message, in one line).
    """
    try:
        flags = shlex.split(megatron_args)
    except ValueError as e:
        raise OrderingConfigError(f"--megatron-args = {show(megatron_args)}: {e}; quote it as a "
                                  "shell would.") from e
    arguments = _arguments_module()
    provider = megatron_extra_args(extra_args_provider)
    defaults = dict(EXAMPLE_ARGS_DEFAULTS if args_defaults is None else args_defaults)
    argv, sys.argv = sys.argv, ["energon-ordering", *flags]
    errors = io.StringIO()
    refused = False
    try:
        with contextlib.redirect_stdout(sys.stderr), contextlib.redirect_stderr(errors):
            if hasattr(arguments, "parse_and_validate_args"):  # core_v0.19.0 and later
                return arguments.parse_and_validate_args(extra_args_provider=provider,
                                                         args_defaults=defaults)
            # core_v0.16.1: what initialize_megatron runs
            from megatron.training.global_vars import set_global_variables

            args = arguments.parse_args(extra_args_provider=provider)
            arguments.validate_args(args, defaults)
            set_global_variables(args, build_tokenizer=True)
            return args
    except SystemExit as e:  # argparse's parser.error: usage + "error: ..." on stderr
        refused = True
        said = [ln for ln in errors.getvalue().splitlines() if ln.strip()]
        raise OrderingConfigError(
            f"--megatron-args: Megatron-LM's parser refused the flags: "
            f"{said[-1] if said else f'exit {e.code}'}. Give the flags your training run takes "
            "(and extra_args_provider for a script's own flags)."
        ) from None
    except (AssertionError, ValueError, TypeError) as e:  # validate_args asserts
        if "already initialized" in str(e):
            raise OrderingConfigError(
                f"--megatron-args: Megatron-LM's arguments are already set in this process ({e}); "
                "they are parsed once per process: inside a training script, build the encoder "
                "directly (TaskEncoder()) after Megatron parsed its flags."
            ) from e
        raise OrderingConfigError(
            f"--megatron-args: Megatron-LM refused the flags: {type(e).__name__}: {e}. Give the "
            "flags your training run takes."
        ) from e
    finally:
        sys.argv = argv
        if not refused:  # Megatron's own warnings; argparse's usage lines are not repeated
            sys.stderr.write(errors.getvalue())


def _encoder_class(spec: str | type) -> type:
    if isinstance(spec, type):
        return spec
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise OrderingTypeError(f"task encoder {show(spec)}: cannot import it ({e}); give "
                                "MODULE:CLASS importable on the path.") from e


def task_encoder_with_megatron_args(spec: str | type, megatron_args: str, *,
                                    extra_args_provider: ExtraArgs | None = None,
                                    args_defaults: dict[str, Any] | None = None,
                                    image_decode: str | None = "pil") -> Any:
    """Builds the task encoder ``spec`` (``MODULE:CLASS`` or the class) after Megatron-LM's
    arguments are parsed from ``megatron_args`` (:func:`parse_megatron_args`).

    The class is imported first (so its module's imports, e.g. the example's
    ``multimodal_args``, are found), then the flags are parsed, then the class is called with
    no arguments. Use the result as ``build_length_index(dataset, task_encoder=...)``.

    Images are decoded as ``train_valid_test_dataloaders_provider`` decodes them for training:
    to ``image_decode`` (``"pil"``, as the example's provider passes) when the encoder keeps
    Energon's default ``decoder``; an encoder with its own ``decoder`` keeps it, and None keeps
    Energon's default.

    Raises:
        OrderingTypeError: ``spec`` cannot be imported.
        OrderingConfigError: See :func:`parse_megatron_args`.
    """
    cls = _encoder_class(spec)
    parse_megatron_args(megatron_args, extra_args_provider=extra_args_provider,
                        args_defaults=args_defaults)
    encoder = cls()
    from megatron.energon import DefaultTaskEncoder, SampleDecoder

    if image_decode is not None and getattr(encoder, "decoder", None) is DefaultTaskEncoder.decoder:
        encoder.decoder = SampleDecoder(image_decode=image_decode)
    return encoder


def build_task_encoder(cls: type, megatron_args: str | None) -> Any:
    """The command line's task encoder: ``cls()``, or with ``megatron_args`` given
    :func:`task_encoder_with_megatron_args`. An encoder that reads Megatron-LM's arguments when
    built (``AssertionError: args is not initialized``) without ``megatron_args`` is one
    :class:`OrderingConfigError` naming ``--megatron-args``.
    """
    if megatron_args is not None:
        return task_encoder_with_megatron_args(cls, megatron_args)
    try:
        return cls()
    except AssertionError as e:
        if "is not initialized" not in str(e):
            raise
        raise OrderingConfigError(
            f"--task-encoder {cls.__module__}:{cls.__qualname__} reads Megatron-LM's arguments "
            f"when it is built ({e}); give the training flags with --megatron-args \"<the "
            "flags>\" (parsed by Megatron's own parser first)."
        ) from e
