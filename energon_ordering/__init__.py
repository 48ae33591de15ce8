"""energon_ordering: the order in which training samples reach a Megatron-LM model.

Energon-native stages (each a ``BaseWrapperDataset`` that checkpoints restore keys, never
samples) and the pure ordering functions behind them:

- :class:`LengthPoolSortDataset`: pool, sort by length, permute with a rank-independent seed,
  so every data-parallel rank processes similar lengths at the same step.
- :class:`OrderingTaskEncoder`: a task-encoder mixin that wires the stages into Energon's
  training pipeline from one :class:`OrderingConfig`.
"""

from energon_ordering.config import OrderingConfig
from energon_ordering.errors import (
    NotRestorableError,
    OrderingConfigError,
    OrderingError,
    OrderingTypeError,
    SampleLengthError,
    StateMismatchError,
)
from energon_ordering.length_pool_sort import LengthPoolSortDataset
from energon_ordering.task_encoder import OrderingTaskEncoder

__version__ = "0.1.0"

__all__ = [
    "LengthPoolSortDataset",
    "NotRestorableError",
    "OrderingConfig",
    "OrderingConfigError",
    "OrderingError",
    "OrderingTaskEncoder",
    "OrderingTypeError",
    "SampleLengthError",
    "StateMismatchError",
    "__version__",
]
