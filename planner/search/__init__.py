"""Heuristic searches: placements and task orders found without a proof of optimality.

Owns the placement heuristics (`heuristics`: m-ETF, pipeline DP, interleaved, local search;
the solvers' warm starts and fallbacks), lock-step task orders for any placement
(`lockstep_order`) and the search over (placement, task schedule) by lock-step price
(`fbw_search`).

May import: `planner.core`, `planner.pricing`, `planner.lower_bounds`.
"""


def __getattr__(name: str):
  """Loads a module of this layer on first attribute access (`planner.core.problem`)."""
  import importlib
  import importlib.util

  if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
