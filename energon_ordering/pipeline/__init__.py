"""Which stages a training pipeline gets, in which order, and why: decided in one place.

- ``plan``: :func:`plan_pipeline`, a pure function of the :class:`OrderingConfig` and Energon's
  build arguments (:class:`BuildArgs`) to a frozen :class:`PipelinePlan` (validated once,
  printable with :meth:`PipelinePlan.describe`, testable without a dataset);
- ``sources``: a metadataset entry as the plan sees it (name, blend weight, identity);
- ``stamp``: the state stamp, read off the plan;
- ``build``: how the task encoder's hooks receive the plan during one build (a context
  variable holding an immutable :class:`TrainBuild`; see that module for why);
- ``planned_source``: the source stage of ``length_sort_mode = "planned"``: this rank's
  micro-batches of the plan of the global order, read by byte range.

Print a configuration's pipeline::

    from energon_ordering import OrderingConfig
    from energon_ordering.pipeline import BuildArgs, plan_pipeline

    print(plan_pipeline(OrderingConfig.from_yaml("recipes/demo.yaml"), BuildArgs(batch_size=4)))
"""

from energon_ordering.pipeline.build import SourceLoads, TrainBuild, current_build
from energon_ordering.pipeline.plan import (
    BuildArgs,
    PipelinePlan,
    Source,
    Stage,
    lag_batches,
    plan_pipeline,
)
from energon_ordering.pipeline.sources import describe_source, source_name
from energon_ordering.pipeline.stamp import pipeline_stamp

__all__ = [
    "BuildArgs",
    "PipelinePlan",
    "Source",
    "SourceLoads",
    "Stage",
    "TrainBuild",
    "current_build",
    "describe_source",
    "lag_batches",
    "pipeline_stamp",
    "plan_pipeline",
    "source_name",
]
