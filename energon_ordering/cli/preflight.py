"""Pre-flight: every input of a command checked before any work starts.

Each check raises a one-line :class:`~energon_ordering.cli.user_error.UserError` (exit code 2)
that names the argument, the value and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from energon_ordering.cli.user_error import UserError, user_errors

if TYPE_CHECKING:
    from energon_ordering.config import OrderingConfig


def looks_like_recipe(path: Path) -> bool:
    """Whether the YAML file ``path`` holds ordering settings rather than a metadataset."""
    import yaml

    from energon_ordering.config import OrderingConfig

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    fields = {f.name for f in dataclasses.fields(OrderingConfig)} | {"placement"}
    return isinstance(data, dict) and bool(fields & set(data)) and "splits" not in data


def check_dataset(path: str, what: str, recipe_goes: str | None = None, *,
                  open_train_split: bool = True) -> None:
    """Raises a one-line :class:`UserError` unless ``path`` is a prepared Energon dataset folder
    or a metadataset YAML (whose train split opens, with ``open_train_split``); ``what`` names
    the argument (e.g. ``METADATASET``), ``recipe_goes`` where a recipe belongs instead (e.g.
    ``--recipe``), if the command takes one."""
    from megatron.energon.metadataset import load_dataset

    how = ("prepare a folder of WebDataset shards with `energon prepare DIR`, or pass a "
           "metadataset YAML that lists prepared folders")
    if Path(path).is_file() and looks_like_recipe(Path(path)):
        where = f"pass it as {recipe_goes}, and " if recipe_goes else ""
        raise UserError(f"{what} {path} is a recipe (ordering settings), not a dataset: {where}"
                        f"give as {what} a prepared dataset: {how}.")
    try:
        dataset = load_dataset(path)
        if open_train_split:  # a metadataset's entries must be prepared datasets too
            from megatron.energon import WorkerConfig

            dataset.get_datasets(training=True, split_part="train",
                                 worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    except ZeroDivisionError as e:  # Energon normalises the blend weights by their sum
        raise UserError(f"{what} {path}: every blend weight of the metadataset is 0, so nothing "
                        "would be drawn; give at least one entry a positive weight.") from e
    except Exception as e:  # Energon raises ValueError, TypeError, OSError or YAML errors here
        inside = Path(path) / "metadataset.yaml"
        if Path(path).is_dir() and inside.is_file():  # e.g. the demo's data_5200/
            raise UserError(f"{what} {path} is not a prepared Energon dataset but a folder "
                            f"holding a metadataset: did you mean {what} {inside}?") from e
        raise UserError(f"{what} {path} is not a prepared Energon dataset or metadataset "
                        f"({type(e).__name__}: {e}); {how}.") from e


def check_out_dir(out: str, writes: str, option: str = "--out") -> Path:
    """Checks, before a command prints anything, that the output folder ``out`` can be created
    and written to (nothing is created: a temporary file in its nearest existing folder); a
    one-line :class:`UserError` naming ``option`` and what the command ``writes`` there
    otherwise (e.g. ``/proc/x``, or a path below a regular file)."""
    import tempfile

    folder = Path(out)
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, f"{existing} is a file, not a folder")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise UserError(f"{option} {out}: cannot write {writes} there ({e.strerror or e}); pass "
                        "a folder you can write to.") from e
    return folder


def dataset_folders(path: str) -> list[str]:
    """The prepared dataset folders of ``path`` (itself, or every one its metadataset lists)."""
    from megatron.energon import WorkerConfig
    from megatron.energon.metadataset import load_dataset

    loaded = load_dataset(path).get_datasets(
        training=False, split_part="train",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    return list(dict.fromkeys(str(e.dataset.path) for e in loaded.datasets
                              if getattr(e.dataset, "path", None) is not None))


def check_length_index_choice(path: str, name: str | None, option: str = "--length-index") -> None:
    """Each prepared dataset of ``path`` that has length indexes has the one named ``name``,
    or, without a name, one to take without asking (the unnamed one or the only one); else a
    one-line :class:`UserError` naming the indexes found and ``option``."""
    from energon_ordering.length_index.index import length_index_files

    for folder in dataset_folders(path):
        files = length_index_files(folder)
        names = [("(unnamed)" if n is None else n) for n in files]
        if name is not None and files and name not in files:
            raise UserError(f"{option} {name}: {folder} has no length index of that name; its "
                            f"indexes are {', '.join(names)}: choose one of them.")
        if name is None and len(files) > 1 and None not in files:
            raise UserError(f"{folder} has several length indexes ({', '.join(names)}) and none "
                            f"is unnamed; choose one with {option} NAME.")


def check_pool(cfg: OrderingConfig, batch_size: int) -> None:
    """The recipe's pool against the micro-batch size (checked without any data)."""
    if not (cfg.length_sort_enabled and cfg.length_sort_mode == "batch"):
        return
    pool = cfg.length_sort_pool_size
    if pool % batch_size:
        lower, upper = pool // batch_size * batch_size, (pool // batch_size + 1) * batch_size
        fix = f"{lower} or {upper}" if lower else f"{upper}"
        raise UserError(f"the recipe's length_sort_pool_size = {pool} is not a multiple of the "
                        f"micro-batch size --batch-size {batch_size} (length_sort_mode: batch); "
                        f"set length_sort_pool_size to {fix}, or change --batch-size.")


def _source_sizes_flag(sources: Iterable[str], known: Mapping[str, int]) -> str:
    """``--source-sizes a=1,b=N``: every source, with the sizes known and ``N`` for the rest."""
    return "--source-sizes " + ",".join(f"{s}={known.get(s, 'N')}" for s in sources)


def check_source_sizes(sources: Iterable[str], sizes: Mapping[str, int], *,
                       metadataset: str | None = None) -> None:
    """Every source of the recipe's mixture schedule has a size: read from ``metadataset``, or
    else given with ``--source-sizes``. The message lists both sides and the flag to pass."""
    sources = list(sources)
    missing = [s for s in sources if s not in sizes]
    if not missing:
        return
    flag = f"{_source_sizes_flag(sources, sizes)} (N: samples of that source)"
    if metadataset is not None:
        raise UserError(
            f"--metadataset {metadataset} has no source {missing} of the recipe's mixture "
            f"schedule. The metadataset's sources: {', '.join(sizes) or '(none)'} (each entry's "
            f"`subflavors: {{source: NAME}}`, else its folder name); the recipe's: "
            f"{', '.join(sources)}. Name the metadataset's entries after the recipe's sources, "
            f"or pass the samples per source instead of --metadataset: {flag}.")
    raise UserError(
        f"--source-sizes has no size for {missing}; the recipe's mixture schedule draws from "
        f"{', '.join(sources)}: give every one, e.g. {flag}.")


def preflight(path: str, configs: list[OrderingConfig], *, batch_size: int, num_workers: int,
              world_size: int, task_encoder_factory: Callable[[], Any] | None) -> None:
    """Checks every input before any work starts: the dataset, the pool against the
    micro-batch, and then builds (without iterating) the last rank's pipeline for each
    configuration, which raises every construction-time error (sources against the schedule,
    a missing length index, the task encoder) before the first run begins."""
    from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader

    check_dataset(path, "METADATASET", "--recipe")
    for cfg in configs:
        check_pool(cfg, batch_size)
    from energon_ordering.errors import LengthIndexError

    with user_errors():
        for cfg in configs:
            try:
                loader = build_train_loader(path, ordering=cfg, rank=world_size - 1,
                                            world_size=world_size, num_workers=num_workers,
                                            batch_size=batch_size,
                                            task_encoder_factory=task_encoder_factory)
            except LengthIndexError as e:
                missing_length_indexes(path, cfg, e)
                raise
            close_loader(loader)


def missing_length_indexes(path: str, cfg: OrderingConfig, error: Exception) -> None:
    """Where building a pipeline stopped at the first dataset without a length index
    (``error``), a one-line :class:`UserError` naming every dataset of ``path`` that lacks one,
    and the one command that builds them all; returns for any other length index error."""
    from energon_ordering.length_index.index import length_index_files

    if "no length index for" not in str(error):
        return
    missing = [f for f in dataset_folders(path)
               if not length_index_files(f, cfg.length_index_dir)
               or (cfg.length_index is not None
                   and cfg.length_index not in length_index_files(f, cfg.length_index_dir))]
    if not missing:
        return
    named = "" if cfg.length_index is None else f" named {cfg.length_index}"
    raise UserError(
        f"no length index{named} for {len(missing)} dataset(s) of {path}: {', '.join(missing)}; "
        f"{cfg.length_sort_mode} with length_sort_placement: pre-encode sorts by lengths known "
        f"before encoding. Build them all with `energon-ordering index {path}"
        + (f" --name {cfg.length_index}" if cfg.length_index else "")
        + (f" --index-dir {cfg.length_index_dir}" if cfg.length_index_dir else "")
        + "` (add --task-encoder MODULE:CLASS for your encoder).") from error
