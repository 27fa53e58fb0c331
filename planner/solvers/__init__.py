"""Exact solvers and the bounds they prove: MILP (python-mip) and CP-SAT (OR-Tools) models.

Owns the pipelined DLPlacer MILP (`milp`) and the F/B/W task MILP (`fbw_milp`), the CP-SAT
searches (`cpsat`, `lockstep_cpsat`) with their child processes (`cpsat_worker`,
`lockstep_cpsat_worker`, run as plain scripts that import nothing of jaxhybrid), the exact
decomposition at cut vertices (`decompose`, solved segment by segment with `milp`), and the two
bounds that are MILP relaxations built on `milp`'s model (`relax`, `lockstep_bound`).

May import: `planner.core`, `planner.pricing`, `planner.lower_bounds`, `planner.search`.
"""


def __getattr__(name: str):
  """Loads a module of this layer on first attribute access (`planner.core.problem`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
