"""Step 2 of the flow: what a node, a transfer and an all-reduce cost on given hardware.

Owns the cost models (`cost_model`: analytic roofline or profiled per node, cached on disk;
`cache_blend`: profiled back to back and cache-flushed, blended where the model's step sits), the
link models and alpha-beta formulas (`links`), hardware specs with their sources (`hardware`),
and measurements on the current backend that fit or check them (`calibrate`), cached per
machine with their provenance (`calibration_cache`); `reports` prints a model's node table.

May import: `jaxhybrid.graph`, `jaxhybrid.mesh`; never the program, training or projection.
"""

from jaxhybrid.costs.cache_blend import CacheBlendedCostModel, cache_blended
from jaxhybrid.costs.cost_model import (
  AnalyticCostModel,
  CostModel,
  ProfiledCostModel,
  dispatch_time_s,
  kernel_count,
  median_time_s,
  time_graph,
  time_node,
  time_node_tasks,
)
from jaxhybrid.costs.reports import time_table
from jaxhybrid.costs.links import (
  Interconnect,
  Link,
  ring_allreduce_time_s,
  ring_bottleneck,
  transfer_time_s,
)

__all__ = [
  "AnalyticCostModel", "CacheBlendedCostModel", "CostModel", "Interconnect", "Link", "ProfiledCostModel",
  "cache_blended", "dispatch_time_s", "kernel_count", "median_time_s", "ring_allreduce_time_s", "ring_bottleneck",
  "time_graph", "time_node", "time_node_tasks", "time_table", "transfer_time_s",
]


def __getattr__(name: str):
  """Loads a submodule on first attribute access (`import jaxhybrid`, then `jaxhybrid.<pkg>.<mod>`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
