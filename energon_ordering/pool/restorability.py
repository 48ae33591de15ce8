"""Build-time check that a pipeline can re-create samples from their restore keys.

A wrapper that saves buffered samples as restore keys (Energon's ``ShuffleBufferDataset``, this
package's ``LengthPoolSortDataset``) re-creates them on resume with ``restore_sample``, which
re-runs every stage below it. Energon allows that only for stages marked ``@stateless``; for any
other it fails with a bare ``AssertionError`` inside a loader worker at resume time, hours into
a run. :func:`explain_not_restorable` finds the offending stage when the pipeline is built.
"""

from __future__ import annotations

from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.wrappers.base import BaseWrapperDataset
from megatron.energon.wrappers.map_dataset import MapDataset
from megatron.energon.wrappers.packing_dataset import PackingDataset

from energon_ordering.errors import NotRestorableError

__all__ = ["explain_not_restorable"]


def _culprit(dataset: SavableDataset) -> SavableDataset | None:
    """The outermost dataset that cannot restore samples although all its inputs can."""
    if dataset.can_restore_sample():
        return None
    if isinstance(dataset, BaseWrapperDataset):
        for inner in dataset.datasets:
            found = _culprit(inner)
            if found is not None:
                return found
    return dataset


def explain_not_restorable(dataset: SavableDataset) -> NotRestorableError | None:
    """Returns an error explaining why ``dataset`` cannot restore samples, or None if it can."""
    culprit = _culprit(dataset)
    if culprit is None:
        return None
    why = (
        "The length pool checkpoints its pooled samples as restore keys and re-creates them on "
        "resume by re-running the pipeline below it; Energon only allows that for stateless "
        "stages, and would otherwise fail with a bare AssertionError in a loader worker when the "
        "run resumes."
    )
    if isinstance(culprit, MapDataset):
        fn = SavableDataset._function_config(culprit.map_fn)
        name = getattr(culprit.map_fn, "__name__", "the map function")
        return NotRestorableError(
            f"{fn} is not marked stateless, so samples below the length pool cannot be restored. "
            f"Decorate `{name}` with `@stateless` (`from megatron.energon import stateless`; use "
            f"`@stateless(restore_seeds=True)` if it draws random numbers) and make its output "
            f"depend on the sample only. {why}"
        )
    if isinstance(culprit, PackingDataset):  # Energon's, or our FinitePackingDataset
        fn = SavableDataset._function_config(culprit.final_packer)
        return NotRestorableError(
            f"{fn} (pack_selected_samples) is not marked stateless, so packs cannot be restored "
            f"by key. Decorate it with `@stateless` (`from megatron.energon import stateless`) "
            f"and make its output depend on the selected samples only. {why}"
        )
    return NotRestorableError(
        f"{type(culprit).__name__} cannot restore samples by key ({culprit}). {why}"
    )
