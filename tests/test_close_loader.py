"""``close_loader`` releases what a dropped in-process loader holds open: Energon's tar and
``.tar.idx`` readers and the planned source's byte-range readers keep shard files open, and
something outside the loader keeps them alive, so a test process that builds hundreds of loaders
ran out of file descriptors (about 20 per loader before)."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

from energon_ordering import OrderingConfig
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return indexed_synthetic(tmp_path_factory.mktemp("close_loader"),
                             [SourceSpec("web", 96, "short", weight=0.7),
                              SourceSpec("code", 64, "long", weight=0.3)], shard_size=16)


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


CONFIGS = {
    "no pool": OrderingConfig(),
    "batch pool": OrderingConfig(length_sort_pool_size=16, length_sort_mode="batch"),
    "planned": OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                              length_sort_pool_holds="keys", micro_batches_per_step=2),
}


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_closed_in_process_loaders_leave_no_shard_files_open(data, name):
    def once():
        loader = build_train_loader(data, ordering=CONFIGS[name], batch_size=4,
                                    task_encoder_factory=IndexedSyntheticTaskEncoder)
        list(itertools.islice(loader, 6))  # a partly read epoch: shards open
        close_loader(loader)

    once()  # the first loader's one-time files (the lengths files, the plan folder)
    before = _open_files()
    for _ in range(4):
        once()
    # at most the planned source's two memory-mapped lengths files per loader stay mapped
    assert _open_files() - before <= 2 * 4, name
