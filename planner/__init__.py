"""DLPlacer: MILP placement of an op graph on the devices of the model axis.

One sub-package per layer; each may import only the layers listed before it:
  core          the problem, options, node and task schedules, the time budget;
  pricing       the lock-step rule and prices of a (placement, task schedule);
  lower_bounds  combinatorial bounds that hold for every placement;
  search        heuristics and lock-step task-order searches;
  solvers       MILP and CP-SAT models, the exact decomposition, MILP-relaxation bounds;
  output        the Plan artifact (JSON, summary) and its Gantt chart.
The orchestration sits at the top and may import every layer: `place` (placement and node
schedule, with k micro-batches), `place_lockstep` (the F/B/W task schedule the program runs) and
`place_shards` (a graph with split leaves against the same graph whole).
"""

from jaxhybrid.planner.lower_bounds.bounds import lower_bound
from jaxhybrid.planner.output.gantt import gantt
from jaxhybrid.planner.core.options import InfeasibleError, PlannerOptions
from jaxhybrid.planner.place import place, place_problem, reprice
from jaxhybrid.planner.place_shards import keeps_sharded, place_shard_or_whole
from jaxhybrid.planner.output.plan import SCHEMA_VERSION, Plan
from jaxhybrid.planner.core.problem import Problem
from jaxhybrid.planner.core.schedule import Task, Transfer, validate_schedule
from jaxhybrid.planner.core.task_schedule import TaskSchedule

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
  "keeps_sharded",
  "lower_bound",
  "place",
  "place_problem",
  "place_shard_or_whole",
  "reprice",
  "validate_schedule",
]


# Where each module of the planner lives: `jaxhybrid.planner.<module>` (the flat names of earlier
# releases) still resolves, to the module in its layer.
_LAYER_OF = {
  "options": "core", "problem": "core", "schedule": "core", "task_schedule": "core",
  "dtypes": "core", "clock": "core", "price": "pricing", "lockstep_rule": "pricing",
  "bounds": "lower_bounds", "placement_bound": "lower_bounds", "heuristics": "search",
  "lockstep_order": "search", "fbw_search": "search", "milp": "solvers", "fbw_milp": "solvers",
  "cpsat": "solvers", "cpsat_worker": "solvers", "lockstep_cpsat": "solvers",
  "lockstep_cpsat_worker": "solvers", "decompose": "solvers", "relax": "solvers",
  "lockstep_bound": "solvers", "plan": "output",
}


class _FlatNames:
  """Import hook: `import jaxhybrid.planner.<module>` by a flat name gives the module in its
  layer (the same module object, not a copy)."""

  @staticmethod
  def find_spec(fullname, path=None, target=None):
    import importlib.util

    head, _, tail = fullname.rpartition(".")
    if head == __name__ and tail in _LAYER_OF:
      return importlib.util.spec_from_loader(fullname, _FlatNames)
    return None

  @staticmethod
  def create_module(spec):
    import importlib

    tail = spec.name.rpartition(".")[2]
    return importlib.import_module(f"{__name__}.{_LAYER_OF[tail]}.{tail}")

  @staticmethod
  def exec_module(module):
    del module  # already executed under its own name


def _install_flat_names() -> None:
  import sys

  if not any(f is _FlatNames for f in sys.meta_path):
    sys.meta_path.append(_FlatNames)


_install_flat_names()


def __getattr__(name: str):
  """Loads a layer or module on first attribute access (`import jaxhybrid`, then
  `jaxhybrid.planner.search.heuristics`, or by its flat name `jaxhybrid.planner.heuristics`)."""
  import importlib
  import importlib.util

  if name in _LAYER_OF:
    return importlib.import_module(f"{__name__}.{_LAYER_OF[name]}.{name}")
  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
