"""A metadataset entry as the plan sees it: its name, blend weight and identity.

Energon hands ``build_train_datasets`` one ``LoadedDataset`` per metadataset entry;
:func:`describe_source` reads from it what the plan (:mod:`energon_ordering.pipeline.plan`) and
the state stamp need, as plain values, so that planning needs no dataset.
"""

from __future__ import annotations

import hashlib
from typing import Any

from energon_ordering.errors import OrderingConfigError
from energon_ordering.pipeline.plan import Source
from energon_ordering.source_tag import SOURCE_KEY
from energon_ordering.errors import show

__all__ = ["describe_source", "source_label", "source_name"]


def source_name(loaded: Any) -> str:
    """A metadataset entry's source name: ``subflavors.source``, else its folder name."""
    factory = loaded.dataset
    subflavors = getattr(factory, "subflavors", None) or {}
    if subflavors.get(SOURCE_KEY):
        return str(subflavors[SOURCE_KEY])
    path = getattr(factory, "path", None)
    if path is None:
        raise OrderingConfigError(
            f"OrderingConfig.mixture_schedule: cannot name the metadataset entry {show(factory)}; "
            f"give it `subflavors: {{{SOURCE_KEY}: NAME}}`."
        )
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def source_label(loaded: Any) -> str:
    """A metadataset entry's name for messages: :func:`source_name`, else how it shows."""
    try:
        return source_name(loaded)
    except OrderingConfigError:
        return show(loaded.dataset)


def describe_source(loaded: Any, *, named: bool) -> Source:
    """A metadataset entry's :class:`Source`: Energon's ``index.uuid``, a digest of its split
    (shard names and sample counts, excludes, subset), the loading settings that decide its
    stream, and its blend weight and repetitions.

    Args:
        loaded: Energon's ``LoadedDataset``.
        named: Also read its source name (:func:`source_name`; raises if it has none).
    """
    factory = loaded.dataset
    path = getattr(factory, "path", None)
    uuid = None
    if path is not None:
        try:
            uuid = (path / ".nv-meta" / "index.uuid").read_text().strip()
        except (OSError, TypeError):
            uuid = None
    shards = getattr(factory, "shards", None) or []
    split = hashlib.sha1(
        repr(
            (
                [(str(getattr(s, "name", s)), int(getattr(s, "count", 0))) for s in shards],
                sorted(str(x) for x in (getattr(factory, "sample_excludes", None) or ())),
                repr(getattr(factory, "subset", None)),
            )
        ).encode()
    ).hexdigest()[:16]
    return Source(
        name=source_name(loaded) if named else None,
        weight=getattr(loaded, "weight", None),
        repetitions=getattr(loaded, "repetitions", None),
        uuid=uuid,
        split=split,
        max_samples_per_sequence=getattr(factory, "max_samples_per_sequence", None),
        shuffle_over_epochs=getattr(factory, "shuffle_over_epochs", None),
        parallel_shard_iters=getattr(factory, "parallel_shard_iters", None),
    )
