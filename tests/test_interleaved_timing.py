"""time_in_turns: loaders timed side by side, one turn each per round."""

from __future__ import annotations

from energon_ordering import OrderingConfig
from energon_ordering.inspect.interleaved_timing import time_in_turns
from energon_ordering.inspect.rank_simulation import build_train_loader, record_batch


class _Counting:
    """A real loader that also counts the micro-batches drawn from it, and the draw order."""

    def __init__(self, name, loader, log):
        self.name, self.loader, self.log = name, loader, log

    def __iter__(self):
        for batch in self.loader:
            self.log.append(self.name)
            yield record_batch(batch)

    def __getattr__(self, attr):
        return getattr(self.loader, attr)


def test_every_loader_gets_one_timed_turn_per_round_in_rotated_order(small_dataset):
    log: list[str] = []
    loaders = {
        name: _Counting(name, build_train_loader(small_dataset, ordering=cfg, batch_size=4), log)
        for name, cfg in (("off", OrderingConfig()),
                          ("pool", OrderingConfig(length_sort_pool_size=8, length_sort_mode="batch")))
    }
    wall, cpu = time_in_turns(loaders, batches_per_turn=2, rounds=3,
                              after_warmup=lambda: log.append("warm-up done"))
    assert log[4] == "warm-up done"  # after one untimed turn of 2 batches each
    log.remove("warm-up done")
    assert set(wall) == set(cpu) == {"off", "pool"}
    assert all(len(v) == 3 and all(t > 0 for t in v) for v in wall.values())
    assert all(len(v) == 3 and all(t >= 0 for t in v) for v in cpu.values())
    turns = [log[i] for i in range(0, len(log), 2)]
    # one untimed turn each, then rounds AB, BA, AB
    assert turns == ["off", "pool", "off", "pool", "pool", "off", "off", "pool"]
