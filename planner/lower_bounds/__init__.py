"""Combinatorial lower bounds that hold for every placement (the honest side of a plan's gap).

Owns the makespan bounds of node schedules (`bounds`) and the one-machine bound on the lock-step
price, placement by placement (`placement_bound`). Bounds that solve a MILP live with the
solvers (`planner.solvers.relax`, `planner.solvers.lockstep_bound`): they build their model with
`solvers.milp`, which itself reads the bounds here.

May import: `planner.core`, `planner.pricing`.
"""


def __getattr__(name: str):
  """Loads a module of this layer on first attribute access (`planner.core.problem`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
