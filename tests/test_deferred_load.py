"""Deferred loading: Energon's source chain split into raw reader + load functions."""

from __future__ import annotations

import pytest
import torch
from megatron.energon import DefaultTaskEncoder, WorkerConfig
from megatron.energon.flavors.webdataset.sample_loader import WebdatasetSampleLoaderDataset
from megatron.energon.metadataset.loader import load_dataset
from megatron.energon.wrappers.map_dataset import MapDataset
from megatron.energon.wrappers.repeat_dataset import RepeatDataset

from energon_ordering.pool.deferred_load import (
    Defer,
    DeferredLength,
    DeferredSample,
    Materialize,
    raw_fields,
    split_loader,
)
from energon_ordering.errors import OrderingConfigError
from energon_ordering.source_tag import sample_source, tag_source


@pytest.fixture
def source(small_dataset):
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    te = DefaultTaskEncoder()
    entry = load_dataset(small_dataset).get_datasets(
        training=False, split_part="train", worker_config=wc, decoder=te.decoder).datasets[0]
    return te._load_dataset(entry, 0, worker_config=wc), wc


def test_split_gives_the_raw_reader_and_the_load_functions(source):
    loaded, wc = source
    raw, fns = split_loader(loaded)
    assert isinstance(raw, WebdatasetSampleLoaderDataset) and len(fns) == 1
    first = next(iter(raw))
    files = first.data[0]
    assert isinstance(files["png"], bytes) and isinstance(files["txt"], bytes)
    # The deferred path reproduces Energon's loaded sample exactly, with the deferred key.
    deferred = Defer(3)(first)
    assert deferred.source_index == 3 and deferred.__key__ == files["__key__"]
    assert raw_fields(deferred) is files
    tag_source(deferred, "web")
    loaded_sample = Materialize([[], [], [], fns])(deferred)
    direct = fns[0](raw.restore_sample(first.__restore_key__))
    assert loaded_sample.__key__ == direct.__key__ and loaded_sample.caption == direct.caption
    assert torch.equal(loaded_sample.image, direct.image)
    assert loaded_sample.__restore_key__ == deferred.__restore_key__
    assert sample_source(loaded_sample) == "web"


def test_deferred_length_reads_an_index_or_the_raw_files():
    class Index:
        def length(self, key):
            return {"a": 7.0}[key]

    raw = type("Raw", (), {"data": ({"__key__": "a", "txt": b"one two three"},),
                           "__restore_key__": ("Webdataset", 0)})()
    d = Defer(0)(raw)
    assert DeferredLength([Index()])(d) == 7.0
    d1 = DeferredSample(__key__="a", __restore_key__=(), source_index=1, raw=raw)
    assert DeferredLength([Index(), lambda f: len(f["txt"].split())])(d1) == 3


def test_split_refuses_what_it_cannot_move(source):
    loaded, wc = source
    with pytest.raises(OrderingConfigError, match=r"not a stateless one-to-one map.*post-encode"):
        split_loader(MapDataset(loaded, lambda s: s, worker_config=wc, stateless_map_fn=False))
    with pytest.raises(OrderingConfigError, match=r"needs webdataset sources.*got RepeatDataset.*post-encode"):
        split_loader(MapDataset(RepeatDataset(loaded, worker_config=wc), lambda s: s,
                                worker_config=wc, stateless_map_fn=True))
