"""The planned order resumed around a finite epoch's end with loader workers (found by review,
7 December 2026).

1. **A resume of a resume across the epoch's end.** A state saved at an odd micro-batch makes
   Energon rotate the restored loader's workers (torch process ``p`` plays worker
   ``p + next_worker_id``) for the loader's life, while torch starts every epoch at process 0:
   the next epoch's micro-batches go out by process. A worker that has run into the end but not
   yet yielded in the new epoch is saved as "the epoch's first micro-batch of my process"; its
   state must say under which rotation, or a second restore hands that worker another
   process's micro-batches (the samples of two micro-batches swapped, then replayed and lost).
2. **An elastic restore one step before the end.** A worker that has already run into the end
   sits in the next epoch while the others still hold the last steps of this one: the elastic
   restore continues this epoch from the others (it lost the last micro-batch, or refused a
   state saved at a step boundary as "inside an optimizer step").

Real prepared datasets with length indexes and real loaders with worker processes (the slow
tier), finite data (``repeat=False``) iterated epoch after epoch, compared by what the model
sees (keys, tokens, packs) against the uninterrupted run without workers.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

from energon_ordering import OrderingConfig, restore_state_rank
from energon_ordering.inspect.rank_simulation import build_train_loader, close_loader, record_batch
from energon_ordering.inspect.synthetic import SourceSpec
from energon_ordering.inspect.synthetic_task import IndexedSyntheticTaskEncoder

sys.path.insert(0, str(Path(__file__).parent))
from indexed_data import indexed_synthetic  # noqa: E402

pytestmark = pytest.mark.slow  # loader worker processes (the slow tier's rule)

#: A worker checkpoint before every sample (Energon's default checkpoints every few seconds:
#: both cadences must resume exactly; this one puts every save at a worker's own state).
EVERY_SAMPLE = dict(checkpoint_every_sec=0, checkpoint_every_min_n_samples=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Two indexed sources: a finite epoch of 28 padded micro-batches of 3 at 1 rank."""
    return indexed_synthetic(
        tmp_path_factory.mktemp("finite_epoch_workers"),
        [SourceSpec("web", 60, "short", weight=0.7), SourceSpec("code", 40, "long", weight=0.3)],
        shard_size=16)


def _config(mix: str, pack: bool, micro_batches_per_step: int = 1) -> OrderingConfig:
    return OrderingConfig(length_sort_mode="planned", length_sort_placement="pre-encode",
                          length_sort_pool_holds="keys", seed=5, plan_window_steps=2,
                          planned_mix=mix, micro_batches_per_step=micro_batches_per_step,
                          **({"pack_seq_length": 1024} if pack else {}))


def _loader(data, cfg, *, workers, pack, rank=0, world_size=1, cadence=None):
    return build_train_loader(data, ordering=cfg, rank=rank, world_size=world_size,
                              num_workers=workers, batch_size=1 if pack else 3,
                              packing_buffer_size=16 if pack else None, repeat=False,
                              task_encoder_factory=IndexedSyntheticTaskEncoder,
                              **(cadence or {}))


def _epochs(loader, epochs, limit=None):
    """Up to ``limit`` micro-batches of ``epochs`` finite epochs of ``loader`` (one ``iter``
    each), with the rank's state saved before every micro-batch; then the loader is closed."""
    records, states = [], []
    for _ in range(epochs):
        it = iter(loader)
        while limit is None or len(records) < limit:
            states.append(pickle.loads(pickle.dumps(loader.save_state_rank())))
            try:
                records.append(record_batch(next(it)))
            except StopIteration:
                states.pop()
                break
        del it
    close_loader(loader)
    return records, states


def _restored(data, cfg, state, **kw):
    loader = _loader(data, cfg, **kw)
    restore_state_rank(loader, state)
    return loader


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("cadence", [None, EVERY_SAMPLE], ids=["energon-default", "every-sample"])
@pytest.mark.parametrize("mix, pack", [("step", False), ("window", True)],
                         ids=["step-padded", "window-packed"])
def test_a_resume_of_a_rotated_resume_continues_the_next_epoch_exactly(data, mix, pack,
                                                                       cadence, workers):
    cfg = _config(mix, pack)
    whole, _ = _epochs(_loader(data, cfg, workers=0, pack=pack), 3)
    first, states = _epochs(_loader(data, cfg, workers=workers, pack=pack, cadence=cadence), 1)
    assert first == whole[:len(first)], "workers do not change what the model sees"
    epoch = len(first)
    cut = 1  # an odd cut: the restored loader's workers are rotated by one
    assert states[cut].next_worker_id == 1
    loader = _restored(data, cfg, states[cut], workers=workers, pack=pack, cadence=cadence)
    seen, states2 = _epochs(loader, 2, limit=epoch - cut + workers + 2)
    assert seen == whole[cut:cut + len(seen)]
    for k in range(epoch - cut, epoch - cut + workers + 2):  # the next epoch's first cuts
        at = cut + k
        loader = _restored(data, cfg, states2[k], workers=workers, pack=pack, cadence=cadence)
        rest, _ = _epochs(loader, 2, limit=len(whole) - at)
        assert rest == whole[at:at + len(rest)] and len(rest) >= epoch - (at - epoch), (
            f"resumed at micro-batch {at - epoch} of epoch 1")


@pytest.mark.parametrize("restore_workers", [0, 1, 3])
@pytest.mark.parametrize("mix, pack", [("step", False), ("window", True)],
                         ids=["step-padded", "window-packed"])
def test_an_elastic_restore_before_the_epochs_end_keeps_its_last_steps(data, mix, pack,
                                                                      restore_workers):
    """Saved with 2 workers one micro-batch before the end (a worker has run into it),
    restored with another num_workers: the last micro-batch, then the next epoch."""
    cfg = _config(mix, pack)
    whole, _ = _epochs(_loader(data, cfg, workers=0, pack=pack), 2)
    first, states = _epochs(_loader(data, cfg, workers=2, pack=pack, cadence=EVERY_SAMPLE), 1)
    epoch = len(first)
    for cut in (epoch - 2, epoch - 1):
        loader = _restored(data, cfg, states[cut], workers=restore_workers, pack=pack)
        rest, _ = _epochs(loader, 2, limit=len(whole) - cut)
        assert rest == whole[cut:], f"cut {cut} of {epoch}"


def test_an_elastic_data_parallel_change_before_the_epochs_end_keeps_its_last_step(data):
    """1 rank x 2 micro-batches with 3 workers, saved at each of the last steps of the epoch,
    restored on 2 ranks x 1: every remaining step holds the samples it held."""
    one, two = _config("step", False, 2), _config("step", False, 1)
    whole, states = _epochs(_loader(data, one, workers=3, pack=False, cadence=EVERY_SAMPLE), 1)
    steps = len(whole) // 2

    def step_keys(records, step):
        return sorted(k for r in records[2 * step:2 * step + 2] for k in r.keys)

    for cut_step in (steps - 2, steps - 1):
        rest = []
        for rank in range(2):
            loader = _restored(data, two, states[2 * cut_step], workers=0, pack=False,
                               rank=rank, world_size=2)
            rest.append(_epochs(loader, 1)[0])
        assert len(rest[0]) == len(rest[1]) == steps - cut_step, f"cut at step {cut_step}"
        got = [sorted(k for r in rest for k in r[s].keys) for s in range(steps - cut_step)]
        assert got == [step_keys(whole, s) for s in range(cut_step, steps)]
