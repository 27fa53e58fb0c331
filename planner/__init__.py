"""DLPlacer: MILP placement of an op graph on the devices of the model axis."""

from jaxhybrid.planner.bounds import lower_bound
from jaxhybrid.planner.gantt import gantt
from jaxhybrid.planner.options import InfeasibleError, PlannerOptions
from jaxhybrid.planner.place import place, place_problem, reprice
from jaxhybrid.planner.plan import SCHEMA_VERSION, Plan
from jaxhybrid.planner.problem import Problem
from jaxhybrid.planner.schedule import Task, Transfer, validate_schedule
from jaxhybrid.planner.task_schedule import TaskSchedule

__all__ = [
  "InfeasibleError",
  "Plan",
  "PlannerOptions",
  "Problem",
  "SCHEMA_VERSION",
  "Task",
  "TaskSchedule",
  "Transfer",
  "gantt",
  "lower_bound",
  "place",
  "place_problem",
  "reprice",
  "validate_schedule",
]


def __getattr__(name: str):
  """Loads a submodule on first attribute access (`import jaxhybrid`, then `jaxhybrid.<pkg>.<mod>`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
