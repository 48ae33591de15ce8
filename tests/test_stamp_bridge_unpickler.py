"""The stamped state passes Megatron-Bridge's restricted unpickler (issue 12).

Bridge loads Energon dataloader states with ``energon_torch_load``, which only allows builtins,
tensors, numpy and a short list of Energon classes: every stamp, flag and identity this package
adds must be plain builtin values.
"""

from __future__ import annotations

import pytest
import torch

from energon_ordering import OrderingConfig
from energon_ordering.inspect.rank_simulation import build_train_loader, resume, run_with_cuts
from energon_ordering.inspect.synthetic import SourceSpec, make_synthetic_dataset

pytestmark = pytest.mark.py312


def _bridge_safe_pickle():
    """Bridge's ``megatron/bridge/utils/safe_pickle.py``, loaded from its file: importing the
    ``megatron.bridge`` package needs transformer_engine, the module itself only the stdlib."""
    import importlib.util
    from pathlib import Path

    import megatron

    for root in megatron.__path__:
        path = Path(root) / "bridge" / "utils" / "safe_pickle.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("_bridge_safe_pickle", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    pytest.skip("Megatron-Bridge is not installed (run by .ci/py312)")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stamped_state_loads_with_bridges_restricted_unpickler(tmp_path, num_workers):
    safe_pickle = _bridge_safe_pickle()
    meta = make_synthetic_dataset(
        tmp_path, [SourceSpec("web", 96, "short"), SourceSpec("code", 96, "medium")], shard_size=16
    )
    cfg = OrderingConfig(
        length_sort_pool_size=16, length_sort_mode="batch", micro_batches_per_step=2,
        mixture_schedule={"total_steps": 20, "phases": [
            {"until": 0.5, "weights": {"web": 0.7, "code": 0.3}},
            {"until": 1.0, "weights": {"web": 0.3, "code": 0.7}}]},
        seq_length_warmup={"start": 128, "full": 2048, "warmup_steps": 6},
    )

    def make():
        return build_train_loader(meta, ordering=cfg, num_workers=num_workers, batch_size=4,
                                  shuffle_buffer_size=8, max_samples_per_sequence=8)

    records, states = run_with_cuts(make, 12, [7])
    torch.save(states[7], tmp_path / "state.pt")
    loaded = safe_pickle.energon_torch_load(str(tmp_path / "state.pt"))
    assert resume(make, loaded, 5) == records[7:]
