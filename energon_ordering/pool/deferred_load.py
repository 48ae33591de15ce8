"""Loading after the pool: sources yield raw, still-compressed samples; decoding comes later.

Energon builds each source as ``MapDataset(WebdatasetSampleLoaderDataset, load_sample)`` (plus a
``cook_crude_sample`` map for crude datasets); ``load_sample`` decodes images into tensors. For
a pool placed before encoding (``length_sort_placement = "pre-encode"``), that chain is split:

    WebdatasetSampleLoaderDataset -> MapDataset(Defer(i))         raw bytes, wrapped per source
    -> repeat / shuffle / blend -> KeyPoolSortDataset              (restore key, length) only
    -> MapDataset(Materialize(loaders)) -> encode_sample           load + decode, emission order

The load functions are Energon's own (the factory's ``_load_sample_raw`` and any cooker), run
unchanged on the same raw sample; only their position moves. A :class:`DeferredSample` keeps the
restore key of its raw sample, and :class:`Materialize` gives the loaded sample that same key, so
Energon's restore-by-key works through the split chain exactly as before.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from megatron.energon import Sample
from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.flavors.webdataset.sample_loader import WebdatasetSampleLoaderDataset
from megatron.energon.wrappers.map_dataset import MapDataset

from energon_ordering.errors import OrderingConfigError
from energon_ordering.source_tag import sample_source, tag_source
from energon_ordering.errors import show

__all__ = [
    "INDEXED_LENGTH_FIELD",
    "Defer",
    "DeferredLength",
    "DeferredSample",
    "Materialize",
    "raw_fields",
    "split_loader",
]


#: Field of a key-only raw sample (:mod:`energon_ordering.pool.index_fill`) that holds the
#: sample's length, read from the length index with its key; None if the index lacks the key.
INDEXED_LENGTH_FIELD = "__ordering_length__"


@dataclasses.dataclass
class DeferredSample(Sample):
    """A raw sample of source ``source_index`` whose loading (decoding) is deferred.

    Attributes:
        source_index: Which source's load functions apply (index into :class:`Materialize`).
        raw: Energon's ``RawSampleData`` as read from the tar files (bytes, not decoded).
    """

    source_index: int
    raw: Any


def raw_fields(sample: DeferredSample) -> dict[str, Any]:
    """The raw files of a deferred sample: ``{"__key__": ..., "jpg": b"...", "txt": b"...", ...}``."""
    return sample.raw.data[0]


def split_loader(dataset: SavableDataset) -> tuple[WebdatasetSampleLoaderDataset, list[Callable]]:
    """Splits a loaded source into its raw reader and its load functions (innermost first).

    Raises:
        OrderingConfigError: The source is not a webdataset read by stateless 1:1 maps, so its
            loading cannot be moved behind the pool.
    """
    fns: list[Callable] = []
    stage = dataset
    while isinstance(stage, MapDataset):
        if not stage.stateless_map_fn or inspect.isgeneratorfunction(stage.map_fn):
            raise OrderingConfigError(
                f"length_sort_placement = 'pre-encode': the source stage {show(stage.map_fn)} is not "
                "a stateless one-to-one map, so loading cannot move behind the pool; mark it "
                "@stateless or use length_sort_placement = 'post-encode'."
            )
        fns.append(stage.map_fn)
        stage = stage.dataset
    if not isinstance(stage, WebdatasetSampleLoaderDataset):
        raise OrderingConfigError(
            f"length_sort_placement = 'pre-encode' needs webdataset sources read by Energon's "
            f"WebdatasetSampleLoaderDataset, got {type(stage).__name__} ({stage}); use "
            "length_sort_placement = 'post-encode' for this dataset."
        )
    return stage, fns[::-1]


class Defer:
    """Map function: Energon raw sample -> :class:`DeferredSample` of one source."""

    def __init__(self, source_index: int):
        self.source_index = source_index

    def __call__(self, raw: Any) -> DeferredSample:
        first = raw.data[0]
        return DeferredSample(
            __key__=first["__key__"],
            __restore_key__=raw.__restore_key__,
            __subflavors__=None,
            __sources__=first.get("__sources__"),
            source_index=self.source_index,
            raw=raw,
        )

    def __repr__(self) -> str:
        return f"Defer(source_index={self.source_index})"


class Materialize:
    """Map function: :class:`DeferredSample` -> the sample its source would have loaded.

    Runs the source's load functions on the raw sample, then gives the result the deferred
    sample's restore key and source tag.
    """

    def __init__(self, loaders: Sequence[Sequence[Callable]]):
        self.loaders = [list(fns) for fns in loaders]

    def __call__(self, deferred: DeferredSample) -> Any:
        sample: Any = deferred.raw
        for fn in self.loaders[deferred.source_index]:
            sample = fn(sample)
        if isinstance(sample, dict):
            sample["__restore_key__"] = deferred.__restore_key__
        else:
            sample.__restore_key__ = deferred.__restore_key__
        source = sample_source(deferred)
        if source is not None:
            sample = tag_source(sample, source)
        return sample

    def __repr__(self) -> str:
        return f"Materialize(sources={len(self.loaders)})"


class DeferredLength:
    """Length of a :class:`DeferredSample` without loading it, per source: a length index
    (anything with ``.length(key)``) or a function of the raw files (:func:`raw_fields`)."""

    def __init__(self, sources: Sequence[Any]):
        self.sources = list(sources)

    def __call__(self, deferred: DeferredSample) -> float:
        source = self.sources[deferred.source_index]
        if hasattr(source, "length"):
            known = deferred.raw.data[0].get(INDEXED_LENGTH_FIELD)
            return known if known is not None else source.length(deferred.__key__)
        return source(raw_fields(deferred))

    def __repr__(self) -> str:
        return f"DeferredLength({show(self.sources)})"
