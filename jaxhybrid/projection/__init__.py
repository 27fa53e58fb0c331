"""Step 6 of the flow: data-parallel versus hybrid time-to-accuracy at scale.

Owns the analytical framework (`framework`: step time, S_DP vs S_hyb, crossover, best (data,
model); its gradient exchange over the topology in `comm`), statistical efficiency curves
(`stat_eff`), the steps-to-target measurement that feeds them (`steps_to_target`), the paper's
scenario (`paper_scenario`), reports (`report`: table, plot, S_MP read from planner outputs),
S_MP with its provenance (`s_mp`) and the noise scale a run measured (`measured_noise`).

May import: `jaxhybrid.costs` (hardware, links), `jaxhybrid.noise_scale`, `jaxhybrid.models`
(steps_to_target only); never the program or training.
"""

from jaxhybrid.projection.framework import (
  CommConfig,
  FlopStepTime,
  MeasuredStepTime,
  Projection,
  StepTime,
  Workload,
  allreduce_time,
  assumptions,
  best_factorisation,
  check_layout,
  crossover,
  intra_node_bus_bandwidth,
  project,
  single_device_time_to_accuracy,
  speedup,
  step_time,
)
from jaxhybrid.projection.measured_noise import read_noise_scale, se_from_noise_scale
from jaxhybrid.projection.report import format_table, plot, s_mp_from_json
from jaxhybrid.projection.s_mp import SMPEstimate, user_s_mp

__all__ = [
  "CommConfig", "FlopStepTime", "MeasuredStepTime", "Projection", "SMPEstimate", "StepTime",
  "Workload", "read_noise_scale", "se_from_noise_scale", "user_s_mp",
  "allreduce_time", "assumptions", "best_factorisation", "check_layout", "crossover",
  "format_table", "intra_node_bus_bandwidth", "plot", "project", "s_mp_from_json",
  "single_device_time_to_accuracy", "speedup", "step_time",
]


def __getattr__(name: str):
  """Loads a submodule on first attribute access (`import jaxhybrid`, then `jaxhybrid.<pkg>.<mod>`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
