"""SamplePacker: bytes per sample, round trip, shared EPaths, nothing for the GC to walk."""

from __future__ import annotations

import dataclasses
import gc

from megatron.energon import Sample
from megatron.energon.epathlib import EPath
from megatron.energon.source_info import SourceInfo

from energon_ordering.pool.packed_sample import SamplePacker


@dataclasses.dataclass
class Raw(Sample):
    files: dict


def _sample(i: int, path: EPath) -> Raw:
    return Raw(__key__=f"k{i}", __restore_key__=("MapDataset", i, "Webdataset", i),
               __sources__=(SourceInfo(dataset_path=path, index=i, shard_name="s.tar",
                                       file_names=(f"k{i}.jpg",)),),
               files={"jpg": bytes(range(256)) * 40, "txt": b"a caption"})


def test_round_trip_is_exact_and_shares_paths(tmp_path):
    path = EPath(str(tmp_path))
    packer = SamplePacker()
    samples = [_sample(i, path) for i in range(3)]
    packed = [packer.pack(s) for s in samples]
    assert all(isinstance(p, bytes) and not gc.is_tracked(p) for p in packed)
    back = [packer.unpack(p) for p in packed]
    assert back == samples
    assert all(b.__sources__[0].dataset_path is path for b in back), "EPath shared, not copied"
    assert len(packed[0]) < len(samples[0].files["jpg"]) + 1_000
